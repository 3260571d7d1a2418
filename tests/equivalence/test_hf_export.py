"""jaxshare -> HF export: transformers loads dense/GQA exports offline with the same logits; import -> export
reproduces the original safetensors bit for bit; other schedules round-trip exactly through the remote-code layout
(tests/equivalence/test_remote_code.py checks that transformers runs it)."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from jaxshare.convert.hf_export import export_run, hf_incompatibility
from jaxshare.plan import plan_of
from jaxshare.convert.hf_import import load_hf_model

from conftest import tiny_config
from support.hf import corpus_tokens, random_params, save_hf_model
from support.runs import as_run, export

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("overrides", [
  ("schedule.kind=gqa", "schedule.kv_heads=2", "model.head_dim=16"),
  ("model.tie_embeddings=true",),
  ("model.flavor=neox", "model.rotary_pct=0.25"),
  ("model.flavor=neox", "model.tie_embeddings=true"),
  ("model.flavor=neox", "model.residual=sequential"),
  ("model.qkv_bias=true", "schedule.kind=gqa", "schedule.kv_heads=2"),
  ("model.rope_theta=500", "model.rope_scaling=llama3", "model.rope_scaling_factor=8",
   "model.rope_original_max_positions=16"),
  ("model.flavor=neox", "model.rope_scaling=linear", "model.rope_scaling_factor=4"),
  ("model.sliding_window=12", "schedule.kind=gqa", "schedule.kv_heads=2"),
], ids=["llama_gqa_head_dim", "llama_tied", "neox", "neox_tied", "neox_sequential", "qwen2", "llama3_rope",
        "neox_linear_rope", "mistral_window"])
def test_transformers_loads_the_export_with_the_same_logits(tmp_path, corpus, overrides):
  cfg = tiny_config(*overrides)
  setup, params = random_params(cfg)
  assert hf_incompatibility(plan_of(cfg)) is None
  export(cfg, params, tmp_path)
  model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
  tokens = corpus_tokens(corpus, 32)
  with torch.no_grad():
    want = model(torch.from_numpy(tokens).long()).logits.numpy()
  got = np.asarray(nnx.merge(setup.graphdef, params)(tokens))
  np.testing.assert_allclose(want, got, atol=1e-5, rtol=0)
  assert np.abs(got).max() > 0.1


@pytest.mark.parametrize("case", ["llama_gqa", "llama_mqa_tied", "neox_partial_rotary", "qwen2_gqa_tied"])
def test_import_export_reproduces_the_checkpoint_bit_for_bit(tmp_path, case):
  from safetensors.numpy import load_file

  save_hf_model(tmp_path / "hf", case)
  setup = load_hf_model(tmp_path / "hf")
  cfg, params = setup.cfg, setup.params
  export(cfg, params, tmp_path / "out")
  original = load_file(tmp_path / "hf" / "model.safetensors")
  exported = load_file(tmp_path / "out" / "model.safetensors")
  assert sorted(exported) == sorted(original)
  for name in original:
    np.testing.assert_array_equal(exported[name], original[name], err_msg=name)
  model = load_hf_model(tmp_path / "out")
  again = model.params
  jax.tree.map(np.testing.assert_array_equal, again, params)


@pytest.mark.parametrize("overrides,why", [
  (("schedule.kind=mlkv", "schedule.kv_layers=2", "schedule.kv_heads=2"), "another layer's K/V"),
  (("schedule.kind=uniattn", "schedule.uniattn.block_size=2"), "reuse attention scores"),
  (("schedule.kind=gqa", "schedule.kv_heads_per_layer=[4,2,2,1]"), "different K/V head counts"),
  (("model.flavor=neox", "schedule.kind=gqa", "schedule.kv_heads=2"), "GPT-NeoX has neither GQA"),
  (("model.residual=parallel",), "Llama has no parallel residual"),
  (("model.flavor=neox", "model.sliding_window=8"), "only Mistral has a sliding window"),
])
def test_other_schedules_round_trip_exactly_as_remote_code(tmp_path, corpus, overrides, why):
  from jaxshare.store.runs import write_run

  cfg = tiny_config(*overrides)
  setup, params = random_params(cfg)
  write_run(tmp_path / "run", as_run(cfg, params))
  arch, reason = export_run(tmp_path / "run", tmp_path / "out")
  assert arch == "JaxshareForCausalLM" and why in reason
  setup2 = load_hf_model(tmp_path / "out")
  cfg2, params2 = setup2.cfg, setup2.params
  assert setup2.schedule.describe() == setup.schedule.describe() and cfg2.model == cfg.model
  jax.tree.map(np.testing.assert_array_equal, params2, params)
  tokens = corpus_tokens(corpus, 32)
  np.testing.assert_array_equal(np.asarray(nnx.merge(setup2.graphdef, params2)(tokens)),
                                np.asarray(nnx.merge(setup.graphdef, params)(tokens)))


def test_cli_export_and_refusal_to_overwrite(tmp_path, capsys):
  from jaxshare.convert.__main__ import main
  from jaxshare.store.runs import write_run

  cfg = tiny_config("schedule.kind=cla", "schedule.factor=2")
  setup, params = random_params(cfg)
  write_run(tmp_path / "run", as_run(cfg, params))
  assert main(["export", str(tmp_path / "run"), str(tmp_path / "out")]) == 0
  out = capsys.readouterr().out
  assert "JaxshareForCausalLM" in out and "another layer's K/V" in out
  assert main(["export", str(tmp_path / "run"), str(tmp_path / "out")]) == 2
  assert "exists and is not empty" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    main(["export", str(tmp_path / "run"), str(tmp_path / "out2"), "--max-shard-gb", "0"])
  assert "--max-shard-gb=0.0 is invalid: must be > 0" in capsys.readouterr().err


@pytest.mark.parametrize("overrides", [("model.flavor=neox",), ("schedule.kind=cla", "schedule.factor=2")],
                         ids=["transformers", "remote_code"])
def test_sharded_export_loads_and_reimports_exactly(tmp_path, corpus, overrides):
  """Shards of at most ~one layer (HF's index file), loaded by transformers and re-imported bit-exactly; no group
  of tensors is split and every tensor is in the index exactly once."""
  cfg = tiny_config(*overrides)
  setup, params = random_params(cfg)
  export(cfg, params, tmp_path, max_shard_bytes=40_000)
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  files = sorted(set(index["weight_map"].values()))
  assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
  assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == files
  assert not (tmp_path / "model.safetensors").exists()
  model = load_hf_model(tmp_path)
  again = model.params
  jax.tree.map(np.testing.assert_array_equal, again, params)
  if overrides[0].startswith("model.flavor"):
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    tokens = corpus_tokens(corpus, 32)
    with torch.no_grad():
      want = model(torch.from_numpy(tokens).long()).logits.numpy()
    np.testing.assert_allclose(want, np.asarray(nnx.merge(setup.graphdef, params)(tokens)), atol=1e-5, rtol=0)


TOKENIZER_TEXT = "ROMEO:\nBut soft, what light through yonder window breaks?  Élan, naïve — 🌹\x00 end\n"


@pytest.mark.parametrize("overrides,arch", [
  ((), "LlamaForCausalLM"),
  (("model.flavor=neox", "model.rotary_pct=0.5"), "GPTNeoXForCausalLM"),
  (("schedule.kind=cla",), "JaxshareForCausalLM"),
], ids=["llama", "neox", "remote-code"])
def test_every_export_of_a_byte_run_loads_its_tokenizer_and_imports_back_as_bytes(tmp_path, overrides, arch):
  """issue 43: dense exports had no tokenizer files (AutoTokenizer: "Couldn't instantiate the backend tokenizer")."""
  from jaxshare.convert.__main__ import main as convert_main
  from jaxshare.data import ByteTokenizer
  from jaxshare.store.runs import read_config, write_run

  cfg = tiny_config(*overrides)
  write_run(tmp_path / "run", as_run(cfg, random_params(cfg)[1]))
  assert export_run(tmp_path / "run", tmp_path / "hf")[0] == arch
  tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
  ids = tok(TOKENIZER_TEXT)["input_ids"]
  assert ids == ByteTokenizer().encode(TOKENIZER_TEXT) and tok.decode(ids) == TOKENIZER_TEXT
  assert tok.eos_token_id == 0 == ByteTokenizer().eos_id
  assert convert_main(["import", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
  assert read_config(tmp_path / "back").data.tokenizer == "byte" and not (tmp_path / "back" / "tokenizer").exists()


@pytest.mark.parametrize("overrides", [(), ("schedule.kind=cla",)], ids=["llama", "remote-code"])
def test_every_export_of_a_run_with_a_hf_tokenizer_carries_it(tmp_path, corpus, overrides):
  from conftest import write_bpe_tokenizer
  from jaxshare.data import HFTokenizer
  from jaxshare.store.runs import write_run

  tokenizer = write_bpe_tokenizer(tmp_path / "tk", corpus.read_text()[:20000])
  cfg = tiny_config("model.vocab_size=300", *overrides)
  write_run(tmp_path / "run", as_run(cfg, random_params(cfg)[1]), tokenizer_files=sorted(tokenizer.iterdir()))
  export_run(tmp_path / "run", tmp_path / "hf")
  ids = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")(TOKENIZER_TEXT)["input_ids"]
  assert ids == HFTokenizer(str(tokenizer)).encode(TOKENIZER_TEXT)


def test_the_byte_tokenizer_json_is_what_the_tokenizers_library_writes(tmp_path):
  """write_byte_tokenizer writes the JSON by hand (exporting needs no tokenizers install): the library's own save of
  the same model must be the same document."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers

  from jaxshare.convert.byte_tokenizer import byte_alphabet, is_byte_tokenizer, write_byte_tokenizer

  write_byte_tokenizer(tmp_path, 128)
  alphabet = byte_alphabet()
  tok = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = decoders.ByteLevel()
  assert json.loads(tok.to_str()) == json.loads((tmp_path / "tokenizer.json").read_text())
  assert is_byte_tokenizer(tmp_path) and not is_byte_tokenizer(tmp_path / "nothing")
