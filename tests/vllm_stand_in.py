"""A stand-in for the two vLLM pieces jaxshare's vLLM model uses, for machines without vLLM (it needs CUDA).

``Attention`` keeps its layer's K/V for one sequence, as vLLM's paged cache does for one request, and reads the
cache of the layer named by ``kv_sharing_target_layer_name`` instead of writing its own (vLLM's rule: a sharing
layer gets no cache blocks and skips the cache write). ``ModelRegistry`` records registrations. What this proves is
jaxshare's side: the model's math, its weight loading and the names it hands vLLM; vLLM's own kernels and block
allocator are run only on a GPU (docs/serving.md).
"""

from __future__ import annotations

import sys
import types

import torch


class Attention(torch.nn.Module):
  """Causal attention over the cached and new tokens of one sequence: ``q [T, H*d]``, ``k``/``v`` ``[T, G*d]``
  (ignored when sharing) -> ``[T, H*d]``."""

  layers: dict[str, "Attention"] = {}  # vLLM's static forward context: prefix -> layer

  def __init__(self, num_heads, head_size, scale, num_kv_heads=None, cache_config=None, quant_config=None,
               per_layer_sliding_window=None, prefix="", kv_sharing_target_layer_name=None):
    super().__init__()
    self.H, self.d, self.scale, self.G = num_heads, head_size, scale, num_kv_heads or num_heads
    self.window, self.target, self.prefix = per_layer_sliding_window, kv_sharing_target_layer_name, prefix
    self.k = self.v = None  # [S, G, d]
    Attention.layers[prefix] = self

  def forward(self, q, k, v):
    t = q.shape[0]
    if self.target is None:
      new_k, new_v = k.view(t, self.G, self.d), v.view(t, self.G, self.d)
      self.k = new_k if self.k is None else torch.cat([self.k, new_k])
      self.v = new_v if self.v is None else torch.cat([self.v, new_v])
    owner = Attention.layers[self.target] if self.target else self
    keys, values = owner.k, owner.v
    s = keys.shape[0]
    group = self.H // self.G
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)  # [S, H, d]
    logits = torch.einsum("thd,shd->hts", q.view(t, self.H, self.d).float(), keys.float()) * self.scale
    query_pos = torch.arange(s - t, s)[:, None]
    key_pos = torch.arange(s)[None, :]
    allowed = key_pos <= query_pos
    if self.window:
      allowed &= query_pos - key_pos < self.window
    probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1)
    return torch.einsum("hts,shd->thd", probs, values.float()).reshape(t, self.H * self.d).to(q.dtype)

  def cache_bytes(self) -> int:
    return 0 if self.k is None else self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


class ModelRegistry:
  registered: dict[str, str] = {}

  @classmethod
  def get_supported_archs(cls):
    return list(cls.registered)

  @classmethod
  def register_model(cls, arch: str, model_cls: str) -> None:
    cls.registered[arch] = model_cls


def install(monkeypatch) -> None:
  """Put the stand-in where ``import vllm`` finds it, for one test."""
  Attention.layers.clear()
  ModelRegistry.registered.clear()
  vllm = types.ModuleType("vllm")
  vllm.ModelRegistry = ModelRegistry
  attention = types.ModuleType("vllm.attention")
  layer = types.ModuleType("vllm.attention.layer")
  layer.Attention = attention.Attention = Attention
  vllm.attention = attention
  attention.layer = layer
  for name, module in (("vllm", vllm), ("vllm.attention", attention), ("vllm.attention.layer", layer)):
    monkeypatch.setitem(sys.modules, name, module)
