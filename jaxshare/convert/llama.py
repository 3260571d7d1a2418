"""Llama (``LlamaForCausalLM``), Mistral (sliding window) and Qwen2: the HF <-> jaxshare table.

RMSNorm, rotate-half RoPE over the whole head, SwiGLU, GQA, optional tied embeddings, ``head_dim`` that may differ
from ``hidden_size / num_attention_heads``; no biases, except Qwen2's on Q/K/V (``model.qkv_bias``).
"""

from __future__ import annotations

from jaxshare.convert import hf_config as C
from jaxshare.convert.mapping import Architecture, Rule, linear, same

_L = "model.layers.{i}."


# config.json fields that are model fields as they are (the rest are read below: head width, biases, windows, RoPE)
ROWS = (*C.COMMON_ROWS, C.Row("intermediate_size", "mlp_dim"), C.Row("rms_norm_eps", "norm_eps", 1e-6))


def config_overrides(config: dict) -> list[str]:
  """HF config -> jaxshare overrides. Raises UnsupportedModelError (activation, biases, RoPE scaling, window)."""
  D = C.field(config, "hidden_size", required=True)
  H = C.field(config, "num_attention_heads", required=True)
  G = C.field(config, "num_key_value_heads", H)
  C.require(config, "hidden_act", C.field(config, "hidden_act", "silu"), ("silu",), "the llama flavour's MLP is SwiGLU")
  qwen2 = config.get("model_type") == "qwen2"  # Qwen2 always has Q/K/V biases and no flag for them
  C.require(config, "attention_bias", bool(C.field(config, "attention_bias", False)), (False,),
            "Llama's attention_bias also biases the output projection, which the llama flavour does not model")
  C.require(config, "mlp_bias", bool(C.field(config, "mlp_bias", False)), (False,),
            "the llama flavour has no MLP biases")
  if qwen2:  # Qwen2 windows only the layers from max_window_layers on: per-layer windows are not modelled
    C.require(config, "use_sliding_window", bool(C.field(config, "use_sliding_window", False)), (False,),
              "Qwen2's per-layer sliding windows are not modelled")
  window = 0 if qwen2 else int(C.field(config, "sliding_window", 0))
  theta, rope_type, _, rope_params = C.rope(config)
  kv = [] if G == H else ["schedule.kind=gqa", f"schedule.kv_heads={G}"]
  return ["model.flavor=llama", *C.row_overrides(config, ROWS), f"model.head_dim={C.field(config, 'head_dim', D // H)}",
          f"model.rope_theta={theta}", "model.rotary_pct=1.0", f"model.qkv_bias={str(qwen2).lower()}",
          f"model.sliding_window={window}", *kv, *C.rope_overrides(config, rope_type, rope_params)]


def hf_config(plan, seq_len: int) -> dict:
  """The ``LlamaForCausalLM`` config.json of a llama-flavour dense/GQA model (``plan``: its
  :class:`~jaxshare.plan.ModelPlan`) trained on ``seq_len`` tokens (both the transformers v5 ``rope_parameters`` and
  the older ``rope_theta`` key, so that either reads it)."""
  m = plan.model
  if m.qkv_bias:  # Qwen2 is the HF class with Q/K/V biases only
    return {**_llama_config(plan, seq_len), "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
            "use_sliding_window": False, "sliding_window": None}
  if m.sliding_window:
    return {**_llama_config(plan, seq_len), "architectures": ["MistralForCausalLM"], "model_type": "mistral",
            "sliding_window": m.sliding_window}
  return _llama_config(plan, seq_len)


def _llama_config(plan, seq_len: int) -> dict:
  m = plan.model
  return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **C.row_fields(m, ROWS),
          "num_key_value_heads": C.kv_heads(plan), "head_dim": m.resolved_head_dim, "hidden_act": "silu",
          "rope_theta": m.rope_theta, "rope_parameters": C.rope_parameters(m), "attention_bias": False,
          "mlp_bias": False, "max_position_embeddings": C.max_positions(seq_len), "torch_dtype": m.param_dtype}


def global_rules(model) -> list[Rule]:
  rules = [same("model.embed_tokens.weight", "embedding", lambda n: (n.V, n.D)),
           same("model.norm.weight", "final_norm/scale", lambda n: (n.D,))]
  if not model.tie_embeddings:
    rules.append(linear("lm_head.weight", "lm_head/kernel", lambda n: (n.D,), lambda n: (n.V,)))
  return rules


def _bias(m: str, heads) -> Rule:
  """Qwen2's ``[heads·d]`` projection bias <-> jaxshare's ``[heads, d]``."""
  return Rule((_L + f"self_attn.{m}_proj.bias",), (f"attn/{m}_proj/bias",), lambda n: [(heads(n) * n.d,)],
              lambda a, n: [a[0].reshape(heads(n), n.d)], lambda a, n: [a[0].reshape(-1)])


def layer_rules(model) -> list[Rule]:
  biases = [_bias("q", lambda n: n.H), _bias("k", lambda n: n.G), _bias("v", lambda n: n.G)] \
    if model.qkv_bias else []
  return biases + [
    same(_L + "input_layernorm.weight", "norm1/scale", lambda n: (n.D,)),
    same(_L + "post_attention_layernorm.weight", "norm2/scale", lambda n: (n.D,)),
    linear(_L + "self_attn.q_proj.weight", "attn/q_proj/kernel", lambda n: (n.D,), lambda n: (n.H, n.d)),
    linear(_L + "self_attn.k_proj.weight", "attn/k_proj/kernel", lambda n: (n.D,), lambda n: (n.G, n.d)),
    linear(_L + "self_attn.v_proj.weight", "attn/v_proj/kernel", lambda n: (n.D,), lambda n: (n.G, n.d)),
    linear(_L + "self_attn.o_proj.weight", "attn/o_proj/kernel", lambda n: (n.H, n.d), lambda n: (n.D,)),
    linear(_L + "mlp.gate_proj.weight", "mlp/gate/kernel", lambda n: (n.D,), lambda n: (n.F,)),
    linear(_L + "mlp.up_proj.weight", "mlp/up/kernel", lambda n: (n.D,), lambda n: (n.F,)),
    linear(_L + "mlp.down_proj.weight", "mlp/down/kernel", lambda n: (n.F,), lambda n: (n.D,)),
  ]


LLAMA = Architecture(("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "llama", "mistral", "qwen2"),
                     config_overrides, hf_config,
                     global_rules, layer_rules, ignored=("rotary_emb.inv_freq",))
