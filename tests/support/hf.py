"""HF models for tests: tiny random transformers models saved to disk, corpus tokens, random jaxshare models and
their remote-code exports."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from conftest import tiny_config
from support.runs import export
from jaxshare.train.state import init_state, setup_training

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

_LLAMA = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              rms_norm_eps=1e-5)
_NEOX = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             rotary_pct=0.25, rope_theta=10000.0)

HF_CASES = {
  "llama_gqa": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(_LLAMA, num_key_value_heads=2)),
  "llama_mqa_tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                     dict(_LLAMA, num_key_value_heads=1, tie_word_embeddings=True)),
  "llama_head_dim": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(_LLAMA, head_dim=16)),
  "neox_partial_rotary": (transformers.GPTNeoXConfig, transformers.GPTNeoXForCausalLM, _NEOX),
  "neox_tied_full_rotary": (transformers.GPTNeoXConfig, transformers.GPTNeoXForCausalLM,
                            dict(_NEOX, rotary_pct=1.0, tie_word_embeddings=True)),
  "llama_rope_linear": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                        dict(_LLAMA, rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 4.0})),
  "llama_rope_llama3": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                        dict(_LLAMA, num_key_value_heads=2, rope_parameters={
                          "rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
  "mistral_window": (transformers.MistralConfig, transformers.MistralForCausalLM,
                     dict(_LLAMA, num_key_value_heads=2, head_dim=8, sliding_window=12)),
  "neox_sequential": (transformers.GPTNeoXConfig, transformers.GPTNeoXForCausalLM,
                      dict(_NEOX, use_parallel_residual=False)),
  "qwen2_gqa_tied": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                     dict(_LLAMA, num_key_value_heads=2, tie_word_embeddings=True)),
}


def save_hf_model(tmp_path, case, dtype=None):
  config_cls, model_cls, kw = HF_CASES[case]
  torch.manual_seed(0)
  model = model_cls(config_cls(**kw)).eval()
  with torch.no_grad():  # random norms and biases, so that a swapped scale/bias or q/k/v slice shows in the logits
    for name, p in model.named_parameters():
      if "norm" in name or name.endswith("bias"):
        p.add_(0.1 * torch.randn_like(p))
  if dtype is not None:
    model = model.to(dtype)
  model.save_pretrained(tmp_path)
  return model.float()


def corpus_tokens(corpus, n=64):
  return np.frombuffer(corpus.read_bytes()[1000:1000 + n], np.uint8).astype(np.int32)[None]


def random_params(cfg, seed=0):
  """A fresh model with every leaf perturbed (norm scales and biases too), so that swapped tensors show."""
  setup = setup_training(cfg)
  params = init_state(setup).params
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  leaves = [np.asarray(x + 0.05 * jax.random.normal(k, x.shape, x.dtype)) for x, k in zip(leaves, keys)]
  return setup, jax.tree.unflatten(tree, leaves)


def export_remote(tmp_path, overrides):
  cfg = tiny_config(*overrides)
  setup, params = random_params(cfg)
  arch = export(cfg, params, tmp_path / "hf", ties=setup.ties)
  assert arch == "JaxshareForCausalLM"
  return cfg, setup, params, tmp_path / "hf"
