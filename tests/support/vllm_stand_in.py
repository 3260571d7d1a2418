"""A stand-in for vLLM's ``Attention``, for the attention arithmetic the released vLLM runs only with its CUDA or
CPU-build kernels (tests/equivalence/test_vllm_model.py).

``Attention`` keeps its layer's K/V for one sequence, as vLLM's paged cache does for one request, and reads the
cache of the layer named by ``kv_sharing_target_layer_name`` instead of writing its own (vLLM's rule: a sharing
layer gets no cache blocks and skips the cache write). What this proves is jaxshare's side: the model's math on
vLLM's flat token layout; vLLM's own kernels run only on a GPU (docs/serving.md).
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


def install(monkeypatch, path: str = "vllm.model_executor.layers.attention") -> None:
  """Put the stand-in where ``from <path> import Attention`` finds it (vLLM 0.33's module by default), for one
  test."""
  Attention.layers.clear()
  parts = path.split(".")
  for i in range(1, len(parts) + 1):
    module = types.ModuleType(".".join(parts[:i]))
    if i > 1:
      setattr(sys.modules[".".join(parts[:i - 1])], parts[i - 1], module)
    monkeypatch.setitem(sys.modules, module.__name__, module)
  module.Attention = Attention
