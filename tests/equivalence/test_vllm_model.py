"""The attention arithmetic of jaxshare's vLLM model, which the released vLLM cannot run on a CPU (its kernels are
CUDA's, and its CPU kernels need vLLM's CPU build), against a stand-in for vLLM's ``Attention``
(tests/support/vllm_stand_in.py): for every K/V schedule, the model gives the transformers remote code's logits at every
step of a prefill and a greedy decode, and the cache holds exactly the accounting's bytes per token. Everything real
vLLM runs here (entry point, engine config, loading, KV-cache specs and blocks, refusals) is tested inside it:
tests/support/vllm_released_checks.py."""

from __future__ import annotations

import numpy as np
import pytest

from jaxshare.config.catalogue import schedule_matrix
from jaxshare import accounting

from support import vllm_stand_in
from support.hf import export_remote

CASES = schedule_matrix("remote_code")

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

  from jaxshare.serve.vllm_model import JaxshareForCausalLM

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
  cfg, setup, _, out = export_remote(tmp_path, KV_KINDS[kind])
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


@pytest.mark.parametrize("path", ["vllm.model_executor.layers.attention", "vllm.attention.layer", "vllm.attention"])
def test_attention_is_found_where_each_vllm_release_keeps_it(monkeypatch, path):
  from jaxshare.serve.vllm_model import _vllm_attention

  vllm_stand_in.install(monkeypatch, path)
  assert _vllm_attention() is vllm_stand_in.Attention


def test_sharing_targets_follow_the_prefix_vllm_gives_the_model(tmp_path, monkeypatch):
  """A model nested in another (vLLM's ``prefix``, e.g. a multimodal wrapper's ``language_model``) names its
  producers under that prefix, where vLLM registered their attention."""
  from jaxshare.serve.vllm_model import JaxshareForCausalLM

  vllm_stand_in.install(monkeypatch)
  _, _, _, out = export_remote(tmp_path, KV_KINDS["cla"])
  hf_config = transformers.AutoConfig.from_pretrained(out, trust_remote_code=True, local_files_only=True)
  model = JaxshareForCausalLM(vllm_config=_vllm_config(hf_config), prefix="language_model")
  attns = [layer.self_attn.attn for layer in model.model.layers]
  assert [a.prefix for a in attns] == [f"language_model.model.layers.{i}.self_attn.attn" for i in range(4)]
  assert [a.target for a in attns] == [None, "language_model.model.layers.0.self_attn.attn", None,
                                       "language_model.model.layers.2.self_attn.attn"]
