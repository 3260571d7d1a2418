"""GPT-NeoX / Pythia (``GPTNeoXForCausalLM``): the HF <-> jaxshare table.

LayerNorm with biases, partial rotate-half RoPE (Pythia: 25% of each head), exact-erf GELU MLP with biases, biased
Q/K/V/output projections, parallel or sequential residual (``use_parallel_residual``). HF fuses Q, K and V into one
``query_key_value`` projection whose output is laid out per head, ``[H, (q, k, v), d]``; the table splits and
re-fuses it in that order.
"""

from __future__ import annotations

import numpy as np

from jaxshare.convert import hf_config as C
from jaxshare.convert.mapping import Architecture, Rule, linear, same

_L = "gpt_neox.layers.{i}."


# config.json fields that are model fields as they are (the rest are read below: head width, RoPE, residual)
ROWS = (*C.COMMON_ROWS, C.Row("intermediate_size", "mlp_dim", lambda config: 4 * config["hidden_size"]),
        C.Row("layer_norm_eps", "norm_eps", 1e-5))


def config_overrides(config: dict) -> list[str]:
  """HF config -> jaxshare overrides. Raises UnsupportedModelError (activation, biases, RoPE scaling)."""
  D = C.field(config, "hidden_size", required=True)
  H = C.field(config, "num_attention_heads", required=True)
  C.require(config, "hidden_act", C.field(config, "hidden_act", "gelu"), ("gelu",),
            "the neox flavour's MLP uses the exact (erf) GELU")
  C.require(config, "attention_bias", bool(C.field(config, "attention_bias", True)), (True,),
            "the neox flavour's attention projections have biases")
  theta, rope_type, partial, rope_params = C.rope(config, theta_keys=("rope_theta", "rotary_emb_base"),
                                                  partial_keys=("partial_rotary_factor", "rotary_pct"))
  return ["model.flavor=neox", *C.row_overrides(config, ROWS), f"model.head_dim={D // H}", f"model.rope_theta={theta}",
          f"model.rotary_pct={partial}",
          f"model.residual={'parallel' if C.field(config, 'use_parallel_residual', True) else 'sequential'}",
          *C.rope_overrides(config, rope_type, rope_params)]


def hf_config(plan, seq_len: int) -> dict:
  """The ``GPTNeoXForCausalLM`` config.json of a neox-flavour dense model (``plan``: its
  :class:`~jaxshare.plan.ModelPlan`) trained on ``seq_len`` tokens (v5 ``rope_parameters`` and the older
  ``rotary_pct`` / ``rotary_emb_base`` keys)."""
  m = plan.model
  return {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", **C.row_fields(m, ROWS),
          "hidden_act": "gelu", "rotary_pct": m.rotary_pct, "rotary_emb_base": m.rope_theta,
          "rope_parameters": {**C.rope_parameters(m), "partial_rotary_factor": m.rotary_pct},
          "use_parallel_residual": m.features.parallel_residual, "attention_bias": True,
          "max_position_embeddings": C.max_positions(seq_len), "torch_dtype": m.param_dtype}


def _qkv_weight() -> Rule:
  def to_jax(a, n):
    w = a[0].reshape(n.H, 3, n.d, n.D)
    return [w[:, j].transpose(2, 0, 1) for j in range(3)]  # [H, d, D] -> [D, H, d]

  def to_hf(a, n):
    return [np.stack([k.transpose(1, 2, 0) for k in a], axis=1).reshape(3 * n.H * n.d, n.D)]

  return Rule((_L + "attention.query_key_value.weight",),
              ("attn/q_proj/kernel", "attn/k_proj/kernel", "attn/v_proj/kernel"),
              lambda n: [(3 * n.H * n.d, n.D)], to_jax, to_hf)


def _qkv_bias() -> Rule:
  def to_jax(a, n):
    b = a[0].reshape(n.H, 3, n.d)
    return [b[:, j] for j in range(3)]

  def to_hf(a, n):
    return [np.stack(a, axis=1).reshape(3 * n.H * n.d)]

  return Rule((_L + "attention.query_key_value.bias",), ("attn/q_proj/bias", "attn/k_proj/bias", "attn/v_proj/bias"),
              lambda n: [(3 * n.H * n.d,)], to_jax, to_hf)


def global_rules(model) -> list[Rule]:
  rules = [same("gpt_neox.embed_in.weight", "embedding", lambda n: (n.V, n.D)),
           same("gpt_neox.final_layer_norm.weight", "final_norm/scale", lambda n: (n.D,)),
           same("gpt_neox.final_layer_norm.bias", "final_norm/bias", lambda n: (n.D,))]
  if not model.tie_embeddings:
    rules.append(linear("embed_out.weight", "lm_head/kernel", lambda n: (n.D,), lambda n: (n.V,)))
  return rules


def layer_rules(model) -> list[Rule]:
  del model
  return [
    same(_L + "input_layernorm.weight", "norm1/scale", lambda n: (n.D,)),
    same(_L + "input_layernorm.bias", "norm1/bias", lambda n: (n.D,)),
    same(_L + "post_attention_layernorm.weight", "norm2/scale", lambda n: (n.D,)),
    same(_L + "post_attention_layernorm.bias", "norm2/bias", lambda n: (n.D,)),
    _qkv_weight(), _qkv_bias(),
    linear(_L + "attention.dense.weight", "attn/o_proj/kernel", lambda n: (n.H, n.d), lambda n: (n.D,)),
    same(_L + "attention.dense.bias", "attn/o_proj/bias", lambda n: (n.D,)),
    linear(_L + "mlp.dense_h_to_4h.weight", "mlp/up/kernel", lambda n: (n.D,), lambda n: (n.F,)),
    same(_L + "mlp.dense_h_to_4h.bias", "mlp/up/bias", lambda n: (n.F,)),
    linear(_L + "mlp.dense_4h_to_h.weight", "mlp/down/kernel", lambda n: (n.F,), lambda n: (n.D,)),
    same(_L + "mlp.dense_4h_to_h.bias", "mlp/down/bias", lambda n: (n.D,)),
  ]


NEOX = Architecture(("GPTNeoXForCausalLM", "gpt_neox"), config_overrides, hf_config, global_rules, layer_rules,
                    ignored=("attention.bias", "attention.masked_bias", "rotary_emb.inv_freq"))
