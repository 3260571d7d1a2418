"""Every sharing schedule leaves jaxshare as a transformers remote-code directory (issue 29): a plain transformers
process loads it offline with ``trust_remote_code=True``; its logits on a left-padded batch equal jaxshare's cached
prefill within 1e-4 (fp32); its cached greedy generation equals jaxshare's for 32 tokens; its cache holds exactly the
bytes per token jaxshare's accounting gives; ``convert import`` brings it back bit-exactly; a hand-edited or
older-format directory is refused with one line. Every model is tiny and random, with every parameter perturbed
(aligners, W_c and norms too), so that a swapped or mis-shaped tensor shows."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxshare import accounting
from jaxshare.config.catalogue import schedule_matrix
from jaxshare.convert.hf_import import load_hf_model
from jaxshare.convert.mapping import UnsupportedModelError
from jaxshare.evaluation.generate import Generator
from jaxshare.model.cache import init_cache
from jaxshare.plan import plan_of

from conftest import CORPUS, REPO, tiny_config
from scripts.hf_generate import cache_bytes, cache_name, output_cache
from support.hf import export_remote

KINDS = schedule_matrix("kinds")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Every kind transformers has no class for, both flavours, and the features that change the code path.
CASES = schedule_matrix("remote_code")
NEW_TOKENS = 32


def _prompts() -> list[list[int]]:
  text = CORPUS.read_text()[:400]
  return [list(text[:23].encode()), list(text[100:109].encode())]


def _padded(prompts):
  width = max(map(len, prompts))
  ids = np.zeros((len(prompts), width), np.int64)
  mask = np.zeros_like(ids)
  for row, p in enumerate(prompts):
    ids[row, width - len(p):], mask[row, width - len(p):] = p, 1
  return ids, mask


@pytest.mark.parametrize("kind", CASES)
def test_remote_code_model_equals_jaxshare(tmp_path, kind):
  cfg, setup, params, out = export_remote(tmp_path, CASES[kind])
  assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "configuration_jaxshare.py",
                                               "modeling_jaxshare.py", "tokenizer.json"}
  hf_cfg = transformers.AutoConfig.from_pretrained(out, trust_remote_code=True, local_files_only=True)
  model = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, local_files_only=True).eval()
  tok = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True, local_files_only=True)
  assert type(model).__name__ == "JaxshareForCausalLM" and hf_cfg.model_type == "jaxshare"
  prompts = _prompts()
  assert tok(CORPUS.read_text()[:23])["input_ids"] == prompts[0]  # the byte tokenizer, as transformers reads it
  ids, mask = _padded(prompts)
  jax_model = nnx.merge(setup.graphdef, params)

  # logits of a left-padded batch: jaxshare's cached prefill of the same rows
  start = jnp.asarray(ids.shape[1] - mask.sum(1))
  cache = init_cache(plan_of(cfg), len(prompts), ids.shape[1], start=start)
  want, _ = jax_model.decode(jnp.asarray(ids, jnp.int32), cache)
  with torch.no_grad():
    got = model(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), use_cache=True)
  keep = mask.astype(bool)
  np.testing.assert_allclose(got.logits.numpy()[keep], np.asarray(want)[keep], atol=1e-4, rtol=0)
  assert np.abs(np.asarray(want)[keep]).max() > 0.1

  # the cache stores only what the schedule needs: jaxshare's accounting, fp32
  per_token = accounting.kv_cache_bytes_per_token(cfg.model, setup.schedule, bytes_per_element=4)
  assert cache_bytes(output_cache(got)) == per_token * ids.size

  # cached greedy generation, 32 tokens, batched left-padded prompts
  generated = Generator(jax_model, plan_of(cfg)).generate(prompts, NEW_TOKENS)
  with torch.no_grad():
    seqs = model.generate(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), max_new_tokens=NEW_TOKENS,
                          min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
  assert seqs[:, ids.shape[1]:].tolist() == generated

  # convert import: the same parameters, bit for bit, and the same ties
  back = load_hf_model(out)
  assert back.cfg.model == cfg.model and back.ties == setup.ties
  jax.tree.map(np.testing.assert_array_equal, back.params, params)


@pytest.mark.parametrize("kind", ["cla", "lisa_plus"])
def test_generate_reuses_a_cache_and_samples(tmp_path, kind):
  """``cache`` reuse: 8 greedy tokens, then 8 more from the returned cache, equal 16 at once, and so do 12 more
  from that cache cropped to 4 fewer tokens; seeded sampling is reproducible and differs from greedy."""
  _, _, _, out = export_remote(tmp_path, KINDS[kind])
  model = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, local_files_only=True).eval()
  ids, mask = (torch.from_numpy(a) for a in _padded(_prompts()))
  greedy = dict(do_sample=False, pad_token_id=0)
  with torch.no_grad():
    whole = model.generate(ids, attention_mask=mask, max_new_tokens=16, min_new_tokens=16, **greedy)
    first = model.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, return_dict_in_generate=True,
                           **greedy)
    cache = output_cache(first)
    assert type(cache).__name__ == "JaxshareCache"
    mask2 = torch.cat([mask, torch.ones(mask.shape[0], 8, dtype=mask.dtype)], 1)
    second = model.generate(first.sequences, attention_mask=mask2, **{cache_name(): cache}, max_new_tokens=8,
                            min_new_tokens=8, **greedy)
    assert second.tolist() == whole.tolist()

    # cropped back (as assisted decoding does), consumer layers' places included: the same continuation
    width = ids.shape[1]
    cache.crop(-12)  # it holds the prompt and 15 of the 16 new tokens (the last is never fed back)
    assert cache.get_seq_length() == width + 3
    third = model.generate(first.sequences[:, :width + 4], attention_mask=mask2[:, :width + 4],
                           **{cache_name(): cache}, max_new_tokens=12, min_new_tokens=12, **greedy)
    assert third.tolist() == whole.tolist()

    def sample():
      torch.manual_seed(3)
      return model.generate(ids, attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=True,
                            temperature=1.0, top_k=50, pad_token_id=0).tolist()

    assert sample() == sample() != whole.tolist()


def test_lisa_nf_prefill_equals_jaxshare(tmp_path):
  """LISA's NF decoding (Sec. 4): the prompt through the kept original W_q/W_k, then LISA. The exported model with
  ``lisa_nf_prefill`` prefills with jaxshare's ``nf=True`` logits (not LISA's) and generates what jaxshare does."""
  cfg, setup, params, out = export_remote(tmp_path, [*KINDS["lisa"], "schedule.lisa.keep_qk=true"])
  model = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, local_files_only=True,
                                                            lisa_nf_prefill=True).eval()
  prompts = _prompts()
  ids, mask = _padded(prompts)
  jax_model = nnx.merge(setup.graphdef, params)
  start = jnp.asarray(ids.shape[1] - mask.sum(1))
  prefill = {nf: np.asarray(jax_model.decode(jnp.asarray(ids, jnp.int32), init_cache(
    plan_of(cfg), len(prompts), ids.shape[1], start=start), nf=nf)[0]) for nf in (True, False)}
  keep = mask.astype(bool)
  assert np.abs(prefill[True][keep] - prefill[False][keep]).max() > 1e-2
  with torch.no_grad():
    got = model(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), use_cache=True).logits.numpy()
    seqs = model.generate(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), max_new_tokens=16,
                          min_new_tokens=16, do_sample=False, pad_token_id=0)
  np.testing.assert_allclose(got[keep], prefill[True][keep], atol=1e-4, rtol=0)
  want = Generator(jax_model, plan_of(cfg)).generate(prompts, 16, nf=True)
  assert seqs[:, ids.shape[1]:].tolist() == want


@pytest.mark.parametrize("edit,message", [
  (lambda c: c["layer_plans"][1].update(kv_source=1), "layer_plans="),
  (lambda c: c.update(num_attention_heads=8), "num_attention_heads=8 disagrees"),
  (lambda c: c.pop("jaxshare_format_version"), "older jaxshare's native export"),
], ids=["layer_plans", "heads", "old_format"])
def test_a_hand_edited_or_older_directory_is_refused_with_one_line(tmp_path, edit, message):
  """A config.json that no longer matches its jaxshare config, or a format-1 (native layout) directory, is refused;
  run overrides on import (``data.seq_len``) are not edits."""
  _, _, _, out = export_remote(tmp_path, KINDS["cla"])
  assert load_hf_model(out, ["data.seq_len=64"]).cfg.data.seq_len == 64
  config = json.loads((out / "config.json").read_text())
  edit(config)
  (out / "config.json").write_text(json.dumps(config))
  with pytest.raises(UnsupportedModelError, match=message) as e:
    load_hf_model(out)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind,targets", [
  ("cla", [None, 0, None, 2]),
  ("mlkv", [None, 0, None, 2]),
  ("per_layer_gqa", "per-layer K/V head counts"),
  ("sa", "probability reuse"),
  ("uniattn", "probability reuse"),
  ("lisa_plus", "logit reuse"),
  ("directshare", "head-wise weight tying"),
])
def test_vllm_layer_names_for_every_kv_schedule(kind, targets):
  """vLLM's ``kv_sharing_target_layer_name`` per layer, from the config.json an export writes (no vLLM import)."""
  from jaxshare.config import to_yaml
  from jaxshare.convert.remote import config_json
  from jaxshare.serve.vllm_layers import VLLMUnsupportedError, kv_sharing_targets
  from jaxshare.train.state import setup_training

  cfg = tiny_config(*CASES[kind])
  setup = setup_training(cfg)
  config = json.loads(json.dumps(config_json(setup.plan, to_yaml(cfg), cfg.data.seq_len, setup.ties)))
  if isinstance(targets, str):
    with pytest.raises(VLLMUnsupportedError, match=f"vLLM cannot serve {targets}.*layer_plans\\[\\d\\]"):
      kv_sharing_targets(config)
  else:
    assert kv_sharing_targets(config) == [None if t is None else f"model.layers.{t}.self_attn.attn" for t in targets]


def test_hf_generate_script_prints_continuations_and_the_cache_bytes(tmp_path, capsys):
  """scripts/hf_generate.py (transformers only) on a CLA export: the batch's continuations and the cache's measured
  bytes per token, which equal the accounting's."""
  import runpy

  cfg, setup, _, out = export_remote(tmp_path, KINDS["cla"])
  main = runpy.run_path(str(REPO / "scripts" / "hf_generate.py"))["main"]
  assert main([str(out), "--prompt", "ROMEO:", "--prompt", "JULIET: O", "--max-new-tokens", "8"]) == 0
  text = capsys.readouterr().out
  per_token = accounting.kv_cache_bytes_per_token(cfg.model, setup.schedule, bytes_per_element=4)
  assert f"JaxshareForCausalLM from {out}; cache JaxshareCache: {per_token:,} bytes per token" in text
  assert "--- 'ROMEO:'\nROMEO:" in text and "--- 'JULIET: O'\nJULIET: O" in text


def test_the_model_code_reads_the_format_the_exporter_writes():
  from jaxshare.convert import remote
  from jaxshare.serve.remote_code import configuration_jaxshare

  assert configuration_jaxshare.FORMAT_VERSION == remote.FORMAT_VERSION
  with pytest.raises(ValueError, match=r"layer_plans\[1\] has keys \['kv_source', 'num_kv_heads', 'shared'\]"):
    configuration_jaxshare.JaxshareConfig(num_hidden_layers=2, layer_plans=[
      {"kv_source": 0, "num_kv_heads": 4}, {"kv_source": 0, "num_kv_heads": 4, "shared": True}])


def test_nf_prefill_needs_the_kept_projections(tmp_path):
  _, _, _, out = export_remote(tmp_path, KINDS["lisa"])
  model = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, local_files_only=True,
                                                            lisa_nf_prefill=True).eval()
  with pytest.raises(ValueError, match="did not keep them"), torch.no_grad():
    model(torch.ones(1, 4, dtype=torch.long), use_cache=True)
