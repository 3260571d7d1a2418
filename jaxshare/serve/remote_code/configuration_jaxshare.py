"""Configuration of a jaxshare model exported for transformers' remote code (``trust_remote_code=True``).

Written beside the weights by ``python -m jaxshare.convert export``; self-contained (transformers only). Every layer's
part in the sharing schedule is spelled out in ``layer_plans`` (one dict per layer, absolute layer indices), so the
modeling code needs no schedule language:

- ``kv_source``: the layer whose K/V this layer attends with (itself: a producer; CLA, MLKV consumers name another);
- ``num_kv_heads``: the K/V heads G it attends with (GQA/MQA/MLKV);
- ``score_reuse``: ``""`` (own softmax), ``"probs"`` (the probabilities of layer ``score_source``: Shared Attention,
  UniAttn) or ``"logits"`` (the pre-softmax logits of layer ``score_source``, the previous one: LISA family), with
  ``integrator`` (``none`` DS, ``add`` LISA_plus, ``linear``/``ffn`` LISA's head aligners), ``lisa_rank``,
  ``lisa_hidden``, ``lisa_rope`` and ``keep_qk`` (W_q/W_k kept for LISA's NF prefill);
- ``feeds``: what later layers reuse from this layer's own scores (``""``, ``"probs"``, ``"logits"``);
- ``compensation`` / ``wc_normed``: UniAttn's ``x W_c`` (Eq. 5) added to the attention output (``Norm(x) W_c`` when
  ``wc_normed``);
- ``tied_qkv``: head-wise sharing (DirectShare): W_q, W_k, W_v are rows of the model's head table, chosen per head
  by ``head_index`` (``{"q"|"k"|"v": [L][H] row}``).
"""

from __future__ import annotations

from transformers import PretrainedConfig

FORMAT_VERSION = 2
LAYER_KEYS = ("kv_source", "num_kv_heads", "score_reuse", "score_source", "feeds", "integrator", "lisa_rank",
              "lisa_hidden", "lisa_rope", "keep_qk", "compensation", "wc_normed", "tied_qkv")


class JaxshareConfig(PretrainedConfig):
  """A decoder-only transformer whose attention follows a jaxshare sharing schedule.

  Args:
    hidden_act: ``silu`` (SwiGLU MLP, Llama) or ``gelu`` (exact-erf GELU MLP, GPT-NeoX).
    norm_type: ``rmsnorm`` or ``layernorm``; ``norm_eps`` its epsilon.
    parallel_residual: ``y = x + attn(norm1 x) + mlp(norm2 x)`` (GPT-NeoX) instead of the sequential residual.
    attention_bias: biases on the Q/K/V projections; ``dense_bias``: on the output projection and the MLP.
    rotary_dim: leading dims of each head rotated by RoPE (rotate-half layout); ``rotary_scaling``: None or
      ``{"rope_type": "linear"|"llama3", "factor", "low_freq_factor", "high_freq_factor",
      "original_max_position_embeddings"}``.
    sliding_window: 0 (full causal attention) or the window W (each query sees itself and W - 1 keys before it).
    layer_plans: one dict per layer with :data:`LAYER_KEYS` (see the module docstring).
    head_index / head_rows: head-wise sharing's table (None without).
    lisa_nf_prefill: LISA's NF decoding (LISA Sec. 5.1): prefill with the kept original W_q/W_k.
    jaxshare_format_version: the export format (:data:`FORMAT_VERSION`).
  """

  model_type = "jaxshare"

  def __init__(self, vocab_size: int = 256, hidden_size: int = 64, intermediate_size: int = 256,
               num_hidden_layers: int = 2, num_attention_heads: int = 4, head_dim: int = 16,
               hidden_act: str = "silu", norm_type: str = "rmsnorm", norm_eps: float = 1e-6,
               parallel_residual: bool = False, attention_bias: bool = False, dense_bias: bool = False,
               rope_theta: float = 10000.0, rotary_dim: int | None = None, rotary_scaling: dict | None = None,
               sliding_window: int = 0, max_position_embeddings: int = 2048, layer_plans: list | None = None,
               head_index: dict | None = None, head_rows: dict | None = None, lisa_nf_prefill: bool = False,
               tie_word_embeddings: bool = False, jaxshare_format_version: int = FORMAT_VERSION, **kwargs):
    self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
    self.num_hidden_layers, self.num_attention_heads, self.head_dim = num_hidden_layers, num_attention_heads, head_dim
    self.hidden_act, self.norm_type, self.norm_eps = hidden_act, norm_type, norm_eps
    self.parallel_residual, self.attention_bias, self.dense_bias = parallel_residual, attention_bias, dense_bias
    self.rope_theta, self.rotary_dim, self.rotary_scaling = rope_theta, rotary_dim or head_dim, rotary_scaling
    self.sliding_window, self.max_position_embeddings = sliding_window, max_position_embeddings
    self.layer_plans = layer_plans if layer_plans is not None else [
      {"kv_source": i, "num_kv_heads": num_attention_heads} for i in range(num_hidden_layers)]
    self.head_index, self.head_rows, self.lisa_nf_prefill = head_index, head_rows, lisa_nf_prefill
    self.jaxshare_format_version = jaxshare_format_version
    # transformers' generic code (masks, caches) reads these
    self.num_key_value_heads = self.layer_plans[0].get("num_kv_heads", num_attention_heads) if self.layer_plans else 0
    super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
    self._validate_plans()

  def _validate_plans(self) -> None:
    if self.jaxshare_format_version != FORMAT_VERSION:
      raise ValueError(f"jaxshare_format_version={self.jaxshare_format_version!r}; this code reads {FORMAT_VERSION}")
    if len(self.layer_plans) != self.num_hidden_layers:
      raise ValueError(f"layer_plans has {len(self.layer_plans)} entries; num_hidden_layers={self.num_hidden_layers}")
    for i, plan in enumerate(self.layer_plans):
      unknown = sorted(set(plan) - set(LAYER_KEYS))
      if unknown or "kv_source" not in plan or "num_kv_heads" not in plan:
        raise ValueError(f"layer_plans[{i}] has keys {sorted(plan)}: allowed {list(LAYER_KEYS)}, kv_source and "
                         "num_kv_heads required")
      src = plan["kv_source"]
      if not 0 <= src <= i or self.layer_plans[src]["kv_source"] != src:
        raise ValueError(f"layer_plans[{i}].kv_source={src}: must name this or an earlier producer layer")
      if plan.get("score_reuse") == "logits" and src != i and plan.get("integrator", "none") != "none":
        raise ValueError(f"layer_plans[{i}]: a LISA layer with a low-rank delta must project its own K/V")
      if plan.get("score_reuse") not in (None, "", "probs", "logits"):
        raise ValueError(f"layer_plans[{i}].score_reuse={plan['score_reuse']!r}: allowed '', 'probs', 'logits'")
