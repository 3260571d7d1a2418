"""A remote-code export of a K/V-sharing schedule as a vLLM model: consumer layers allocate no KV cache.

vLLM serves the directory ``python -m jaxshare.convert export`` writes once :mod:`jaxshare.serve.vllm_plugin` has
registered this class (the ``jaxshare[vllm]`` extra installs the plugin's entry point). Every layer builds vLLM's
``Attention``; a K/V consumer (CLA, MLKV: ``layer_plans[i].kv_source != i``) builds it with
``kv_sharing_target_layer_name`` naming its producer's, so vLLM gives it no cache blocks and it reads the producer's
paged K/V (the mechanism Gemma3n's shared suffix uses). A consumer has no K/V projections: it hands vLLM the K/V
its producer computed for the same tokens in this forward pass, which vLLM does not write again
(:func:`~jaxshare.serve.vllm_layers.kv_sharing_targets` gives the names and refuses probability/logit reuse, W_c,
head ties and per-layer K/V head counts, which vLLM's attention cannot express).

The layers' math is the remote code's own (``Norm``, ``MLP``, RoPE from ``modeling_jaxshare``), on vLLM's flat token
layout: ``input_ids``/``positions`` ``[T]`` (every sequence of the batch concatenated), hidden states ``[T, D]``.
Projections are plain ``torch.nn.Linear``: one GPU (``tensor_parallel_size=1``); a larger tensor- or
pipeline-parallel size is refused.

Requires torch, transformers and vLLM (imported here, never by the rest of jaxshare).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from jaxshare.serve.remote_code.modeling_jaxshare import Norm, PreNormResidual, apply_rope, inv_frequencies
from jaxshare.serve.vllm_layers import VLLMUnsupportedError, kv_sharing_targets


def _vllm_attention():
  """vLLM's ``Attention`` layer class: in ``vllm.model_executor.layers.attention`` in vLLM 0.33 (the release the
  ``vllm`` extra pins and the tests run), in ``vllm.attention.layer`` or ``vllm.attention`` in older releases."""
  try:
    from vllm.model_executor.layers.attention import Attention
  except ImportError:
    try:
      from vllm.attention.layer import Attention
    except ImportError:
      from vllm.attention import Attention
  return Attention


def _build_attention(config, heads: int, kv_heads: int, width: int, target: str | None, cache_config, quant_config,
                     dtype, prefix: str):
  """vLLM's ``Attention`` for one layer, with K/V sharing named.

  Raises:
    VLLMUnsupportedError: the attention backend vLLM picked refuses K/V sharing (on CUDA: FlexAttention, its only
      backend for float32 at head width < 32); the message names the layer, dtype, width and vLLM's reason.
  """
  try:
    return _vllm_attention()(heads, width, width ** -0.5, num_kv_heads=kv_heads, cache_config=cache_config,
                             quant_config=quant_config, per_layer_sliding_window=config.sliding_window or None,
                             prefix=prefix, kv_sharing_target_layer_name=target)
  except NotImplementedError as err:
    if target is None or "kv sharing" not in str(err).lower():
      raise
    raise VLLMUnsupportedError(
      f"{prefix}: vLLM's attention backend for dtype {dtype} at head width {width} refuses K/V sharing ({err}); "
      "serve in bfloat16 or float16 (FlashAttention) or export a head width >= 32 (Triton)") from err


class JaxshareAttention(nn.Module):
  """One layer's self-attention: a producer projects Q, K, V; a consumer projects Q and attends with its producer's
  K/V through vLLM's shared cache."""

  def __init__(self, config, layer_idx: int, target: str | None, cache_config, quant_config, dtype, prefix: str):
    super().__init__()
    plan = config.layer_plans[layer_idx]
    D, H, d, G, bias = (config.hidden_size, config.num_attention_heads, config.head_dim, plan["num_kv_heads"],
                        config.attention_bias)
    self.H, self.G, self.d, self.kv_source = H, G, d, plan["kv_source"]
    self.producer = target is None
    self.q_proj = nn.Linear(D, H * d, bias=bias)
    self.k_proj = nn.Linear(D, G * d, bias=bias) if self.producer else None
    self.v_proj = nn.Linear(D, G * d, bias=bias) if self.producer else None
    self.o_proj = nn.Linear(H * d, D, bias=config.dense_bias)
    self.register_buffer("inv_freq", inv_frequencies(config, config.rotary_dim), persistent=False)
    self.attn = _build_attention(config, H, G, d, target, cache_config, quant_config, dtype, f"{prefix}.attn")

  def _rope(self, x: torch.Tensor, positions: torch.Tensor, heads: int) -> torch.Tensor:
    """``[T, heads * d]`` rotated at ``positions [T]`` (the remote code's rotate-half RoPE, on one flat row)."""
    t = x.shape[0]
    x = x.view(t, heads, self.d).transpose(0, 1)[None]  # [1, heads, T, d]
    return apply_rope(x, positions[None], self.inv_freq)[0].transpose(0, 1).reshape(t, heads * self.d)

  def forward(self, x: torch.Tensor, positions: torch.Tensor, kv: dict[int, tuple]) -> torch.Tensor:
    """``x [T, D]`` normalised input -> ``[T, D]``; ``kv`` holds each producer's K/V of these tokens."""
    if self.producer:
      kv[self.kv_source] = (self._rope(self.k_proj(x), positions, self.G), self.v_proj(x))
    k, v = kv[self.kv_source]
    out = self.attn(self._rope(self.q_proj(x), positions, self.H), k, v)
    return self.o_proj(out)


class JaxshareDecoderLayer(PreNormResidual):
  """Pre-norm layer, sequential or parallel (GPT-NeoX) residual, as the remote code's ``DecoderLayer``."""

  def __init__(self, config, layer_idx: int, target: str | None, cache_config, quant_config, dtype, prefix: str):
    super().__init__(config)
    self.self_attn = JaxshareAttention(config, layer_idx, target, cache_config, quant_config, dtype,
                                       f"{prefix}.self_attn")

  def forward(self, x: torch.Tensor, positions: torch.Tensor, kv: dict[int, tuple]) -> torch.Tensor:
    return self.residual(x, self.self_attn(self.input_layernorm(x), positions, kv))


class JaxshareModel(nn.Module):
  def __init__(self, config, cache_config, quant_config, dtype, prefix: str):
    super().__init__()
    targets = kv_sharing_targets(config.to_dict(), f"{prefix}.layers")
    self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
    self.layers = nn.ModuleList(
      JaxshareDecoderLayer(config, i, targets[i], cache_config, quant_config, dtype, f"{prefix}.layers.{i}")
      for i in range(config.num_hidden_layers))
    self.norm = Norm(config)

  def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
              inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
    x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
    kv: dict[int, tuple] = {}
    for layer in self.layers:
      x = layer(x, positions, kv)
    return self.norm(x)


class JaxshareForCausalLM(nn.Module):
  """vLLM's model class for ``architectures: ["JaxshareForCausalLM"]`` exports of K/V schedules (dense, GQA, MQA,
  CLA, MLKV).

  Args:
    vllm_config: vLLM's engine config; ``model_config.hf_config`` is the export's ``JaxshareConfig`` (vLLM loads
      it with ``trust_remote_code=True``).
    prefix: this module's name in vLLM's model tree ("" at the top).

  Raises:
    VLLMUnsupportedError: the export uses probability or logit reuse, UniAttn's W_c, head-wise ties or per-layer
      K/V head counts, the engine asks for tensor or pipeline parallelism, or vLLM's attention backend for the
      dtype and head width refuses K/V sharing.
  """

  def __init__(self, *, vllm_config, prefix: str = ""):
    super().__init__()
    config = vllm_config.model_config.hf_config
    parallel = getattr(vllm_config, "parallel_config", None)
    for field in ("tensor_parallel_size", "pipeline_parallel_size"):
      size = getattr(parallel, field, 1)
      if size != 1:
        raise VLLMUnsupportedError(f"{field}={size}: jaxshare's vLLM model runs on one GPU (set it to 1)")
    self.config = config
    self.model = JaxshareModel(config, vllm_config.cache_config, getattr(vllm_config, "quant_config", None),
                               getattr(vllm_config.model_config, "dtype", None), f"{prefix}.model" if prefix else "model")
    self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    if config.tie_word_embeddings:
      self.lm_head.weight = self.model.embed_tokens.weight

  def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
    """Token embeddings ``[T, D]`` of ``input_ids [T]`` (required by vLLM 0.33's model protocol)."""
    return self.model.embed_tokens(input_ids)

  get_input_embeddings = embed_input_ids  # the name older vLLM releases call

  def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
              inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """Final hidden states ``[T, D]`` of the tokens ``input_ids [T]`` at ``positions [T]``."""
    return self.model(input_ids, positions, inputs_embeds)

  def compute_logits(self, hidden_states: torch.Tensor, *args) -> torch.Tensor:
    """``[T, V]`` logits (older vLLM passes its sampling metadata too; the logits do not depend on it)."""
    return self.lm_head(hidden_states)

  def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy the export's ``model.safetensors`` tensors (the remote code's names) into the parameters.

    Returns:
      The names loaded (vLLM checks them against the parameters).

    Raises:
      ValueError: a tensor this model has no parameter for, or one of another shape.
    """
    params = dict(self.named_parameters())
    loaded = set()
    for name, tensor in weights:
      if name == "lm_head.weight" and self.config.tie_word_embeddings:
        continue  # the embedding's own tensor
      if name not in params:
        raise ValueError(f"weight {name!r} has no parameter in jaxshare's vLLM model (a K/V schedule export?)")
      if tuple(params[name].shape) != tuple(tensor.shape):
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}; the model expects "
                         f"{tuple(params[name].shape)}")
      with torch.no_grad():
        params[name].copy_(tensor)
      loaded.add(name)
    if self.config.tie_word_embeddings:
      loaded.add("lm_head.weight")
    return loaded
