"""Reading HF directories: every tensor exactly as PyTorch saved it (single file, sharded, fp32/fp16/bf16), and bad
directories refused with errors that name the file, tensor, shape or fix."""

import json

import numpy as np
import pytest

from jaxshare.convert.hf_checkpoint import HFCheckpoint, HFCheckpointError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _tiny_llama(directory, dtype=None, **save_kw):
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)
  model = transformers.LlamaForCausalLM(cfg)
  if dtype is not None:
    model = model.to(dtype)
  model.save_pretrained(directory, **save_kw)
  return {k: v for k, v in model.state_dict().items()}


@pytest.mark.parametrize("dtype,shards", [(None, False), (None, True), ("float16", False), ("bfloat16", True)])
def test_every_tensor_reads_back_exactly(tmp_path, dtype, shards):
  state = _tiny_llama(tmp_path, getattr(torch, dtype) if dtype else None,
                      **({"max_shard_size": "20KB"} if shards else {}))
  assert (tmp_path / "model.safetensors.index.json").is_file() == shards
  ckpt = HFCheckpoint(tmp_path)
  assert ckpt.architecture == "LlamaForCausalLM"
  assert ckpt.names() == sorted(state)
  for name, array in ckpt.tensors():
    want = state[name]
    assert str(array.dtype) == str(want.dtype).removeprefix("torch."), name
    assert ckpt.spec(name) == (tuple(want.shape), array.dtype)
    np.testing.assert_array_equal(array.astype(np.float32), want.float().numpy(), err_msg=name)


def test_wrong_shape_and_missing_tensor_are_named(tmp_path):
  _tiny_llama(tmp_path)
  ckpt = HFCheckpoint(tmp_path)
  name = "model.layers.0.self_attn.k_proj.weight"
  with pytest.raises(HFCheckpointError, match=r"k_proj.weight.*shape \[16, 32\] \(float32\).*expected \[32, 32\]"):
    ckpt.read(name, shape=(32, 32))
  with pytest.raises(HFCheckpointError, match="'model.layers.7.mlp.up_proj.weight' is missing"):
    ckpt.read("model.layers.7.mlp.up_proj.weight")
  with pytest.raises(HFCheckpointError, match=r"'model.layers.7.mlp.up_proj.weight' is missing .*expected shape "
                                              r"\[48, 32\] in F32, F16, BF16, F64"):
    ckpt.read("model.layers.7.mlp.up_proj.weight", shape=(48, 32))


def test_pickle_only_directory_is_refused_without_unpickling(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
  (tmp_path / "pytorch_model.bin").write_bytes(b"not even a pickle: reading it would fail differently")
  with pytest.raises(HFCheckpointError,
                     match=r"only pickle weights \(pytorch_model.bin\).*safetensors.*save_pretrained"):
    HFCheckpoint(tmp_path)


def test_truncated_file_is_caught_before_reading(tmp_path):
  _tiny_llama(tmp_path)
  f = tmp_path / "model.safetensors"
  f.write_bytes(f.read_bytes()[:-100])
  with pytest.raises(HFCheckpointError, match="model.safetensors is truncated"):
    HFCheckpoint(tmp_path)
  f.write_bytes(b"\x00" * 4)
  with pytest.raises(HFCheckpointError, match="truncated: 4 bytes"):
    HFCheckpoint(tmp_path)


def test_index_with_missing_shard_is_named(tmp_path):
  _tiny_llama(tmp_path, max_shard_size="20KB")
  shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
  shard.unlink()
  with pytest.raises(HFCheckpointError, match=f"names shards that are not in .*{shard.name}"):
    HFCheckpoint(tmp_path)


def test_not_a_model_directory(tmp_path):
  with pytest.raises(HFCheckpointError, match="no config.json"):
    HFCheckpoint(tmp_path)
  with pytest.raises(HFCheckpointError, match="does not exist"):
    HFCheckpoint(tmp_path / "nope")
  (tmp_path / "config.json").write_text("{}")
  with pytest.raises(HFCheckpointError, match="has no weights: expected model.safetensors"):
    HFCheckpoint(tmp_path)
