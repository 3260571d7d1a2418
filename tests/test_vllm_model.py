"""jaxshare's vLLM plugin (issue 29 part 5) against a stand-in for vLLM's ``Attention`` and ``ModelRegistry``
(tests/vllm_stand_in.py; vLLM itself needs CUDA): for every K/V schedule, the model vLLM would build from an export
gives the transformers remote code's logits at every step of a prefill and a greedy decode, each consumer layer names
its producer's attention and keeps no K/V of its own (the cache holds exactly the accounting's bytes per token), the
export's weights load by name, schedules vLLM cannot express are refused, and the entry point registers the model."""

from __future__ import annotations

import importlib.metadata

import numpy as np
import pytest

from jaxshare import accounting

import vllm_stand_in
from test_remote_code import CASES, _export

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# The K/V schedules exported as remote code (dense, GQA and MQA leave as transformers' own classes, which vLLM serves
# without the plugin).
KV_KINDS = {k: CASES[k] for k in ("cla", "mlkv", "neox_mlkv", "window_tied_cla", "mlkv_matched")}
DECODE_STEPS = 8


def _vllm_config(hf_config, tensor_parallel_size=1):
  from types import SimpleNamespace

  return SimpleNamespace(model_config=SimpleNamespace(hf_config=hf_config), cache_config=None, quant_config=None,
                         parallel_config=SimpleNamespace(tensor_parallel_size=tensor_parallel_size,
                                                         pipeline_parallel_size=1))


def _models(out):
  """The transformers remote-code model and jaxshare's vLLM model loaded from the export ``out``."""
  from safetensors.torch import load_file

  from jaxshare.convert.vllm_model import JaxshareForCausalLM

  reference = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True,
                                                                local_files_only=True).eval()
  model = JaxshareForCausalLM(vllm_config=_vllm_config(reference.config)).eval()
  weights = load_file(out / "model.safetensors")
  loaded = model.load_weights(weights.items())
  assert loaded >= {name for name, _ in model.named_parameters()}
  return reference, model


@pytest.mark.parametrize("kind", KV_KINDS)
def test_vllm_model_equals_the_remote_code_and_caches_only_producers(tmp_path, monkeypatch, kind):
  vllm_stand_in.install(monkeypatch)
  cfg, setup, _, out = _export(tmp_path, KV_KINDS[kind])
  reference, model = _models(out)
  plans = reference.config.layer_plans
  attns = [layer.self_attn.attn for layer in model.model.layers]
  assert [a.target for a in attns] == [None if p["kv_source"] == i else f"model.layers.{p['kv_source']}.self_attn.attn"
                                       for i, p in enumerate(plans)]
  assert [a.prefix for a in attns] == [f"model.layers.{i}.self_attn.attn" for i in range(len(plans))]

  tokens = list(b"ROMEO: O, she doth teach")
  with torch.no_grad():
    step = torch.tensor(tokens)
    positions = torch.arange(len(tokens))
    for i in range(DECODE_STEPS + 1):  # the prefill, then one token at a time
      ours = model.compute_logits(model(step, positions))[-1]
      want = reference(torch.tensor([tokens])).logits[0, -1]
      np.testing.assert_allclose(ours.numpy(), want.numpy(), atol=1e-4, rtol=1e-4, err_msg=f"{kind} step {i}")
      tokens.append(int(ours.argmax()))
      step, positions = torch.tensor(tokens[-1:]), torch.tensor([len(tokens) - 1])
  cached = len(tokens) - 1  # the last greedy token is not fed back
  per_token = accounting.kv_cache_bytes_per_token(cfg.model, setup.schedule, bytes_per_element=4)
  assert sum(a.cache_bytes() for a in attns) == per_token * cached
  assert all(a.cache_bytes() == 0 for a in attns if a.target is not None)


@pytest.mark.parametrize("kind, feature", [("sa", "probability reuse"), ("uniattn", "probability reuse"),
                                           ("lisa_plus", "logit reuse"), ("directshare", "head-wise weight tying"),
                                           ("per_layer_gqa", "per-layer K/V head counts")])
def test_vllm_model_refuses_what_vllm_cannot_express(tmp_path, monkeypatch, kind, feature):
  from jaxshare.convert.vllm_layers import VLLMUnsupportedError
  from jaxshare.convert.vllm_model import JaxshareForCausalLM

  vllm_stand_in.install(monkeypatch)
  _, _, _, out = _export(tmp_path, CASES[kind])
  hf_config = transformers.AutoConfig.from_pretrained(out, trust_remote_code=True, local_files_only=True)
  with pytest.raises(VLLMUnsupportedError, match=f"vLLM cannot serve {feature}"):
    JaxshareForCausalLM(vllm_config=_vllm_config(hf_config))


def test_vllm_model_refuses_tensor_parallelism_and_foreign_weights(tmp_path, monkeypatch):
  from jaxshare.convert.vllm_layers import VLLMUnsupportedError
  from jaxshare.convert.vllm_model import JaxshareForCausalLM

  vllm_stand_in.install(monkeypatch)
  _, _, _, out = _export(tmp_path, CASES["cla"])
  hf_config = transformers.AutoConfig.from_pretrained(out, trust_remote_code=True, local_files_only=True)
  with pytest.raises(VLLMUnsupportedError, match="tensor_parallel_size=2: .* one GPU"):
    JaxshareForCausalLM(vllm_config=_vllm_config(hf_config, tensor_parallel_size=2))
  model = JaxshareForCausalLM(vllm_config=_vllm_config(hf_config))
  with pytest.raises(ValueError, match=r"'model.layers.1.self_attn.k_proj.weight' has no parameter"):
    model.load_weights([("model.layers.1.self_attn.k_proj.weight", torch.zeros(8, 32))])
  with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(3,\); the model expects \(32,\)"):
    model.load_weights([("model.norm.weight", torch.zeros(3))])


def test_entry_point_registers_the_model_once(monkeypatch):
  from jaxshare.convert import remote, vllm_plugin

  vllm_stand_in.install(monkeypatch)
  (entry,) = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "jaxshare"]
  assert entry.load() is vllm_plugin.register
  vllm_plugin.register()
  vllm_plugin.register()
  assert vllm_stand_in.ModelRegistry.registered == {remote.ARCHITECTURE: "jaxshare.convert.vllm_model:JaxshareForCausalLM"}
  module, _, name = vllm_plugin.MODEL_CLASS.partition(":")
  assert getattr(importlib.import_module(module), name).__name__ == remote.ARCHITECTURE
