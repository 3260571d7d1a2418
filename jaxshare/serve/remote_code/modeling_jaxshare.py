"""PyTorch model of a jaxshare sharing schedule, for transformers' remote code (``trust_remote_code=True``).

Self-contained (torch and transformers only): written beside the weights by ``python -m jaxshare.convert export``.
Each layer does what its ``config.layer_plans`` entry says (see ``configuration_jaxshare.py``):

- K/V sharing (CLA, MLKV): a consumer layer has no K/V projections and attends with its producer's K/V;
- probability reuse (Shared Attention Alg. 1, UniAttn Eq. 3): the layer applies the source layer's softmax
  probabilities to its own V; UniAttn's compensation adds ``x W_c`` (Eq. 5);
- logit reuse (LISA Eq. 3-4): the layer takes the previous layer's pre-softmax logits, adds its low-rank delta
  ``q_LR k_LRᵀ / √r`` (``add``) or mixes both per head with an aligner (``linear``/``ffn``), then softmax;
- head-wise sharing (DirectShare): W_q/W_k/W_v rows come from a table shared across layers.

:class:`JaxshareCache` stores only what later tokens read: K and V of producers that compute their own scores, V
alone for producers that reuse scores, LISA's low-rank K and V; nothing for K/V consumers. Score rows pass from
source to reusing layers within a step and are never cached.

Shapes: B batch, n new tokens, S keys (cached + new), H query heads, G K/V heads, d head width, D model width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_jaxshare import JaxshareConfig

try:
  from transformers.cache_utils import DummyLayer  # transformers >= 5.23: skipped by the cache's offloading
except ImportError:

  class DummyLayer:
    """A K/V consumer's place in the cache on transformers < 5.23 (as 5.23's ``DummyLayer``): it holds nothing
    (the layer reads its producer's entry), and the cache's per-layer operations (crop, reorder, reset, offload)
    leave it as it is."""

    is_sliding = False
    is_compileable = True

    def __init__(self):
      self.is_initialized, self.keys, self.values = True, None, None

    def update(self, *args, **kwargs):
      raise NotImplementedError("a K/V consumer layer stores no cache: it reads its producer's entry")

    def get_seq_length(self) -> int:
      return 0

    def get_max_cache_shape(self) -> int:
      return -1

    def offload(self): ...
    def prefetch(self): ...
    def reset(self): ...
    def crop(self, max_length: int): ...
    def reorder_cache(self, beam_idx): ...
    def batch_repeat_interleave(self, repeats: int): ...
    def batch_select_indices(self, indices): ...

# transformers 5.23 renamed the cache argument and output field `past_key_values` to `cache`.
_CACHE_NAME = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"

_MASK_VALUE = -0.7 * torch.finfo(torch.float32).max  # finite: a fully masked (padding) row stays finite


class ProducerLayer(DynamicLayer):
  """A producer layer's cache: V ``[B, G, S, d]`` and K (post-RoPE ``[B, G, S, d]``; LISA's low-rank
  ``[B, G, S, r]``; nothing — width 0 — when the layer reuses scores without a delta)."""

  def update(self, key_states, value_states, *args, **kwargs):
    if key_states is None:
      key_states = value_states.new_zeros(*value_states.shape[:-1], 0)
    return super().update(key_states, value_states)

  def get_seq_length(self) -> int:
    if not self.is_initialized or self.values is None or self.values.dim() < 3:
      return 0
    return self.values.shape[-2]


class JaxshareCache(Cache):
  """A transformers :class:`Cache` with entries only for K/V producer layers; consumer layers (CLA, MLKV) hold a
  ``DummyLayer`` and read their producer's entry."""

  def __init__(self, config: JaxshareConfig, **kwargs):
    super().__init__(layers=[ProducerLayer() if plan["kv_source"] == i else DummyLayer()
                             for i, plan in enumerate(config.layer_plans)])


class Norm(nn.Module):
  """RMSNorm (scale only) or LayerNorm (scale and bias), computed in float32."""

  def __init__(self, config: JaxshareConfig):
    super().__init__()
    self.eps, self.layernorm = config.norm_eps, config.norm_type == "layernorm"
    self.weight = nn.Parameter(torch.ones(config.hidden_size))
    self.bias = nn.Parameter(torch.zeros(config.hidden_size)) if self.layernorm else None

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    if self.layernorm:
      x32 = x32 - x32.mean(-1, keepdim=True)
      y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float() + self.bias.float()
    else:
      y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
    return y.to(x.dtype)


class MLP(nn.Module):
  """SwiGLU ``down(silu(gate x) * up x)`` or GELU ``down(gelu(up x))`` (exact erf), biases per ``dense_bias``."""

  def __init__(self, config: JaxshareConfig):
    super().__init__()
    D, F_, bias = config.hidden_size, config.intermediate_size, config.dense_bias
    self.swiglu = config.hidden_act == "silu"
    self.gate_proj = nn.Linear(D, F_, bias=False) if self.swiglu else None
    self.up_proj = nn.Linear(D, F_, bias=bias)
    self.down_proj = nn.Linear(F_, D, bias=bias)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    if self.swiglu:
      return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
    return self.down_proj(F.gelu(self.up_proj(x)))


def inv_frequencies(config: JaxshareConfig, rotary_dim: int) -> torch.Tensor:
  """``[rotary_dim // 2]`` float32 inverse frequencies ``theta^(-2i/rotary_dim)``, rescaled as transformers'
  ``linear`` and ``llama3`` rope types do."""
  inv = 1.0 / (torch.tensor(config.rope_theta, dtype=torch.float32)
               ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
  scaling = config.rotary_scaling or {}
  kind = scaling.get("rope_type", "default")
  if kind == "linear":
    return inv / scaling["factor"]
  if kind == "llama3":
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return torch.where(medium, smoothed, scaled)
  return inv


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
  """Rotate the first ``2 * len(inv_freq)`` dims of ``x [B, N, n, e]`` (rotate-half) at ``positions [B, n]``."""
  rotary = 2 * inv_freq.shape[0]
  angles = positions.float()[:, None, :, None] * inv_freq.to(x.device)  # [B, 1, n, rotary/2]
  cos, sin = angles.cos(), angles.sin()
  rot, rest = x[..., :rotary].float(), x[..., rotary:]
  x1, x2 = rot[..., :rotary // 2], rot[..., rotary // 2:]
  rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
  return torch.cat([rotated, rest], dim=-1)


def heads(x: torch.Tensor, num: int) -> torch.Tensor:
  """``[B, n, num * e]`` -> ``[B, num, n, e]``."""
  b, n, _ = x.shape
  return x.view(b, n, num, -1).transpose(1, 2)


def scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
  """Float32 logits ``scale · q kᵀ`` ``[B, H, n, S]`` of ``q [B, H, n, e]``, ``k [B, G, S, e]``: query head h reads
  K/V head ``h // (H / G)``, grouped by a reshape (the cache is never copied per query head)."""
  b, h, n, e = q.shape
  g = k.shape[1]
  return (torch.matmul(q.float().reshape(b, g, h // g * n, e), k.float().transpose(-1, -2)) * scale).reshape(
    b, h, n, -1)


def apply_probs(probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
  """``[B, H, n, S]`` probabilities times ``v [B, G, S, d]`` -> ``[B, H, n, d]`` in v's dtype."""
  b, h, n, s = probs.shape
  g = v.shape[1]
  return torch.matmul(probs.to(v.dtype).reshape(b, g, h // g * n, s), v).reshape(b, h, n, -1)


def masked_softmax(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
  """Float32 softmax of ``[B, H, n, S]`` logits over the keys ``mask [B, 1, n, S]`` allows."""
  return torch.softmax(torch.where(mask, logits.float(), _MASK_VALUE), dim=-1)


class Step:
  """What every layer of one forward pass shares: positions ``[B, n]``, key mask ``[B, 1, n, S]``, the cache, the
  producers' K/V and the score tensors handed on (``[B, H, n, S]`` float32)."""

  def __init__(self, positions, mask, cache, nf_prefill):
    self.positions, self.mask, self.cache, self.nf_prefill = positions, mask, cache, nf_prefill
    # The fused kernel returns NaN for a query with no key (a padding row), which would reach later layers through
    # the padding's K/V (0 x NaN); such rows attend everywhere instead (their outputs are never read).
    self.fused_mask = mask | ~mask.any(-1, keepdim=True)
    self.kv: dict[int, tuple] = {}
    self.handed: dict[int, torch.Tensor] = {}


class Attention(nn.Module):
  """Self-attention of one layer in the role its ``layer_plans`` entry gives it."""

  def __init__(self, config: JaxshareConfig, layer_idx: int):
    super().__init__()
    plan = config.layer_plans[layer_idx]
    self.layer_idx, self.plan = layer_idx, plan
    D, H, d = config.hidden_size, config.num_attention_heads, config.head_dim
    G, bias = plan["num_kv_heads"], config.attention_bias
    self.H, self.G, self.d = H, G, d
    self.producer = plan["kv_source"] == layer_idx
    self.reuse, self.integrator = plan.get("score_reuse", ""), plan.get("integrator", "")
    self.feeds, self.rank = plan.get("feeds", ""), plan.get("lisa_rank", 0)
    self.low_rank = self.reuse == "logits" and self.integrator not in ("", "none")
    own = not plan.get("tied_qkv", False)
    full_qk = not self.reuse or plan.get("keep_qk", False)
    self.q_proj = nn.Linear(D, H * d, bias=bias) if own and full_qk else None
    self.k_proj = nn.Linear(D, G * d, bias=bias) if own and self.producer and full_qk else None
    self.v_proj = nn.Linear(D, G * d, bias=bias) if own and self.producer else None
    self.o_proj = nn.Linear(H * d, D, bias=config.dense_bias)
    r = self.rank
    self.q_lr = nn.Linear(D, H * r, bias=bias and r == d) if self.low_rank else None
    self.k_lr = nn.Linear(D, G * r, bias=bias and r == d) if self.low_rank else None
    hidden = plan.get("lisa_hidden", 0)
    self.align_in = nn.Parameter(torch.zeros(2 * H, hidden)) if self.integrator == "ffn" and self.low_rank else None
    self.align_out = nn.Parameter(torch.zeros(hidden, H)) if self.integrator == "ffn" and self.low_rank else None
    self.align = nn.Parameter(torch.zeros(2 * H, H)) if self.integrator == "linear" and self.low_rank else None
    # RoPE frequencies are computed at use, not kept as buffers: from_pretrained builds modules on the meta device,
    # where a non-persistent buffer computed here would hold no data.
    self.config = config
    self.lr_rotary = r - r % 2 if plan.get("lisa_rope", False) else 0

  def _project(self, name: str, x: torch.Tensor, num: int, tied: dict | None) -> torch.Tensor:
    if tied is not None:  # head-wise sharing: [D, heads, d] gathered from the table
      return torch.einsum("bnD,Dhe->bhne", x, tied[name].to(x.dtype))
    return heads(getattr(self, f"{name}_proj")(x), num)

  def _low_rank(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = heads(self.q_lr(x), self.H), heads(self.k_lr(x), self.G)
    if self.lr_rotary:
      inv_freq = inv_frequencies(self.config, self.lr_rotary)
      q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    return q, k

  def _integrate(self, prev: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """LISA Eq. 4 on ``[B, H, n, S]`` float32 logits."""
    if self.integrator == "add":
      return prev + delta
    z = torch.cat([prev, delta], dim=1)  # [B, 2H, n, S]
    if self.integrator == "linear":
      return torch.einsum("bets,eh->bhts", z, self.align.float())
    hidden = torch.relu(torch.einsum("bets,ef->bfts", z, self.align_in.float()))
    return torch.einsum("bfts,fh->bhts", hidden, self.align_out.float())

  def forward(self, x: torch.Tensor, step: Step, tied: dict | None) -> torch.Tensor:
    """``x [B, n, D]`` normalised input -> ``[B, n, D]``."""
    i, pos = self.layer_idx, step.positions
    inv_freq = inv_frequencies(self.config, self.config.rotary_dim)
    if self.producer:
      v = self._project("v", x, self.G, tied)
      key = q_lr = None
      if not self.reuse:
        key = apply_rope(self._project("k", x, self.G, tied), pos, inv_freq)
      elif self.low_rank:
        q_lr, key = self._low_rank(x, pos)
      if step.cache is not None:
        key, v = step.cache.update(key, v, i)
        key = key if key.shape[-1] else None
      step.kv[i] = (key, v)
    k, v = step.kv[self.plan["kv_source"]]
    scale = self.d ** -0.5
    if not self.reuse:
      q = apply_rope(self._project("q", x, self.H, tied), pos, inv_freq)
      if not self.feeds:  # nothing later reads these scores: a fused kernel, no [B, H, n, S] tensor kept
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=step.fused_mask, scale=scale,
                                             enable_gqa=self.G != self.H)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1).to(x.dtype))
      logits = scores(q, k, scale)
      probs = masked_softmax(logits, step.mask)
      step.handed[i] = {"probs": probs, "logits": logits}.get(self.feeds)
    elif self.reuse == "probs":
      probs = step.handed[self.plan["score_source"]]
    else:
      if step.nf_prefill:  # LISA Sec. 5.1: the original attention over the prompt
        if self.q_proj is None or self.k_proj is None:
          raise ValueError("lisa_nf_prefill attends with the LISA layers' original W_q/W_k; this model did not keep "
                           "them (jaxshare's schedule.lisa.keep_qk)")
        q = apply_rope(heads(self.q_proj(x), self.H), pos, inv_freq)
        k_full = apply_rope(heads(self.k_proj(x), self.G), pos, inv_freq)
        logits = scores(q, k_full, scale)
      else:
        logits = step.handed.pop(i - 1)  # the chain's only reader: free it as the next layer's logits are made
        if self.low_rank:
          delta = scores(q_lr, k, self.rank ** -0.5)
          logits = self._integrate(logits, delta)
      probs = masked_softmax(logits, step.mask)
      step.handed[i] = logits
    out = apply_probs(probs, v)
    return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1).to(x.dtype))


class PreNormResidual(nn.Module):
  """The residual around a layer's attention output and its MLP, sequential or parallel (GPT-NeoX); the vLLM layer
  (``jaxshare.serve.vllm_model``) uses it too."""

  def __init__(self, config: JaxshareConfig):
    super().__init__()
    self.parallel_residual = config.parallel_residual
    self.input_layernorm = Norm(config)
    self.post_attention_layernorm = Norm(config)
    self.mlp = MLP(config)

  def residual(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``x`` the layer's input, ``a`` its attention output (both ``[..., D]``) -> the layer's output."""
    if self.parallel_residual:
      return x + a + self.mlp(self.post_attention_layernorm(x))
    y = x + a
    return y + self.mlp(self.post_attention_layernorm(y))


class DecoderLayer(PreNormResidual):
  """Pre-norm layer, sequential or parallel residual; UniAttn's ``x W_c`` (or ``Norm(x) W_c``) joins the attention
  output."""

  def __init__(self, config: JaxshareConfig, layer_idx: int):
    super().__init__(config)
    plan = config.layer_plans[layer_idx]
    self.wc_normed = plan.get("wc_normed", False)
    self.self_attn = Attention(config, layer_idx)
    self.compensation = (nn.Linear(config.hidden_size, config.hidden_size, bias=False)
                         if plan.get("compensation", False) else None)

  def forward(self, x: torch.Tensor, step: Step, tied: dict | None) -> torch.Tensor:
    h = self.input_layernorm(x)
    a = self.self_attn(h, step, tied)
    if self.compensation is not None:
      a = a + self.compensation(h if self.wc_normed else x)
    return self.residual(x, a)


class HeadTable(nn.Module):
  """Head-wise sharing's stored heads ``q``/``k``/``v`` ``[rows, D, d]`` and each layer's ``[L, H]`` row index."""

  def __init__(self, config: JaxshareConfig):
    super().__init__()
    D, d = config.hidden_size, config.head_dim
    self.index = config.head_index  # plain lists, not buffers (see Attention.__init__ on the meta device)
    for m in ("q", "k", "v"):
      setattr(self, m, nn.Parameter(torch.zeros(config.head_rows[m], D, d)))

  def kernels(self, layer: int) -> dict[str, torch.Tensor]:
    """Layer ``layer``'s ``{"q", "k", "v"}: [D, H, d]`` kernels."""
    return {m: getattr(self, m)[self.index[m][layer]].transpose(0, 1) for m in ("q", "k", "v")}


class JaxsharePreTrainedModel(PreTrainedModel):
  config_class = JaxshareConfig
  base_model_prefix = "model"
  _no_split_modules = ["DecoderLayer"]

  def _init_weights(self, module):
    std = 0.02
    if isinstance(module, nn.Linear):
      module.weight.data.normal_(0.0, std)
      if module.bias is not None:
        module.bias.data.zero_()
    elif isinstance(module, nn.Embedding):
      module.weight.data.normal_(0.0, std)


class JaxshareModel(JaxsharePreTrainedModel):
  """Embeddings, the layers and the final norm."""

  def __init__(self, config: JaxshareConfig):
    super().__init__(config)
    self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
    self.head_table = HeadTable(config) if config.head_index else None
    self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
    self.norm = Norm(config)
    self.post_init()

  def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
              position_ids: torch.LongTensor | None = None, cache: Cache | None = None,
              use_cache: bool | None = None) -> tuple[torch.Tensor, Cache | None]:
    """Hidden states ``[B, n, D]`` of ``input_ids [B, n]`` after the ``cache``'s tokens; ``attention_mask [B, S]``
    (1: a token, 0: padding) covers the cached and the new tokens."""
    b, n = input_ids.shape
    if use_cache and cache is None:
      cache = JaxshareCache(self.config)
    past = cache.get_seq_length() if cache is not None else 0
    total = past + n
    keep = (torch.ones(b, total, dtype=torch.bool, device=input_ids.device) if attention_mask is None
            else attention_mask.bool())
    if keep.shape != (b, total):
      raise ValueError(f"attention_mask has shape {tuple(keep.shape)}; expected ({b}, {total}): cached + new tokens")
    if position_ids is None:
      position_ids = (keep.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
    slots = torch.arange(past, total, device=input_ids.device)
    offset = slots[:, None] - torch.arange(total, device=input_ids.device)[None, :]  # [n, S]
    allowed = offset >= 0
    if self.config.sliding_window:
      allowed = allowed & (offset < self.config.sliding_window)
    mask = (keep[:, None, :] & allowed[None])[:, None]  # [B, 1, n, S]
    step = Step(position_ids, mask, cache, self.config.lisa_nf_prefill and cache is not None and past == 0)
    x = self.embed_tokens(input_ids)
    for i, layer in enumerate(self.layers):
      x = layer(x, step, self.head_table.kernels(i) if self.head_table is not None and
                layer.self_attn.plan.get("tied_qkv") else None)
    return self.norm(x), cache


class JaxshareForCausalLM(JaxsharePreTrainedModel, GenerationMixin):
  """Next-token logits (float32) of a jaxshare schedule; ``generate()`` uses :class:`JaxshareCache`."""

  _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

  def __init__(self, config: JaxshareConfig):
    super().__init__(config)
    self.model = JaxshareModel(config)
    self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    self.post_init()

  def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
    if model_kwargs.get(_CACHE_NAME) is None and generation_config.use_cache is not False:
      model_kwargs[_CACHE_NAME] = JaxshareCache(self.config)
    return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)

  def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
              position_ids: torch.LongTensor | None = None, cache: Cache | None = None,
              labels: torch.LongTensor | None = None, use_cache: bool | None = None,
              logits_to_keep: int | torch.Tensor = 0, past_key_values: Cache | None = None,
              **kwargs) -> CausalLMOutputWithPast:
    """Logits ``[B, n, V]`` float32 (only the last ``logits_to_keep`` positions, or those indexed, unless ``labels``
    are given) and the cache; with ``labels`` also the mean next-token cross-entropy (labels -100 ignored)."""
    cache = cache if cache is not None else past_key_values
    hidden, cache = self.model(input_ids, attention_mask, position_ids, cache, use_cache)
    if labels is None and not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
      hidden = hidden[:, slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep]
    logits = self.lm_head(hidden).float()
    loss = None
    if labels is not None:
      loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                             ignore_index=-100)
    return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_NAME: cache})
