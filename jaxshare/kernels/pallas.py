"""The Pallas kernels as the model calls them: inside ``jax.shard_map`` under a mesh.

Mosaic (and Triton) custom calls cannot be partitioned by XLA, so under a mesh each device runs the kernel on its
own shard: batch split as ``activation_batch`` and heads as ``activation_heads``/``activation_kv_heads`` in the
logical rules, sequence whole (a kernel needs every key of its rows). Head sharding is kept only when it maps query
head h to K/V head ``h // (H/G)`` on the same device: K/V heads split like the query heads, or a single K/V head
(MQA) replicated; otherwise heads are not split.
"""

from __future__ import annotations

import functools
import math

import jax
from jax.sharding import PartitionSpec as P

from jaxshare import parallel
from jaxshare.kernels import decode, flash, tuning


def _head_specs(mesh, q_shape, kv_heads: tuple[int, ...]):
  """``(batch axes, query-head axes, [K/V-head axes per K/V-like input])`` for the shard_map specs."""
  batch = parallel.logical_to_spec(("activation_batch",), q_shape[:1], mesh)[0]
  heads = parallel.logical_to_spec(("activation_heads",), q_shape[2:3], mesh)[0]
  size = math.prod(mesh.shape[a] for a in ((heads,) if isinstance(heads, str) else heads or ()))
  if any(g % size and g != 1 for g in kv_heads):
    heads = None
  return batch, heads, [None if (g == 1 or heads is None) else heads for g in kv_heads]


def _mesh():
  """The ambient mesh when it has more than one device, else None (the kernels run unwrapped)."""
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh.empty or math.prod(mesh.axis_sizes) == 1 else mesh


def attention(q, k, v, q_segment_ids, kv_segment_ids, *, causal: bool = True, scale: float | None = None,
              window: int = 0, return_lse: bool = False, backend: str | None = None):
  """:func:`jaxshare.kernels.flash.attention` per device under the ambient mesh (same contract)."""
  kernel = functools.partial(flash.attention, causal=causal, scale=scale, window=window, return_lse=return_lse,
                             backend=backend or tuning.default_backend())
  return per_device(kernel, q, k, v, q_segment_ids, kv_segment_ids, return_lse=return_lse)


def per_device(kernel, q, k, v, q_segment_ids, kv_segment_ids, *, return_lse: bool = False):
  """``kernel(q, k, v, q_segment_ids, kv_segment_ids)`` (any attention of the reference contract, returning the
  LSE when ``return_lse``) per device under the ambient mesh, unwrapped without one."""
  args = (q, k, v, q_segment_ids, kv_segment_ids)
  if (mesh := _mesh()) is None:
    return kernel(*args)
  batch, heads, (gk, gv) = _head_specs(mesh, q.shape, (k.shape[2], v.shape[2]))
  out = P(batch, None, heads, None)
  specs = (out, P(batch, None, gk, None), P(batch, None, gv, None), P(batch, None), P(batch, None))
  out_specs = (out, P(batch, heads, None)) if return_lse else out
  return jax.shard_map(kernel, mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=False)(*args)


def attention_from_lse(q, k, lse, v, q_segment_ids, kv_segment_ids, *, scale: float, causal: bool = True,
                       window: int = 0, backend: str | None = None):
  """:func:`jaxshare.kernels.flash.attention_from_lse` per device under the ambient mesh (same contract)."""
  kernel = functools.partial(flash.attention_from_lse, scale=scale, causal=causal, window=window,
                             backend=backend or tuning.default_backend())
  args = (q, k, lse, v, q_segment_ids, kv_segment_ids)
  if (mesh := _mesh()) is None:
    return kernel(*args)
  batch, heads, (gk, gv) = _head_specs(mesh, q.shape, (k.shape[2], v.shape[2]))
  out = P(batch, None, heads, None)
  specs = (out, P(batch, None, gk, None), P(batch, heads, None), P(batch, None, gv, None), P(batch, None),
           P(batch, None))
  return jax.shard_map(kernel, mesh=mesh, in_specs=specs, out_specs=out, check_vma=False)(*args)


def decode_attention(q, k, v, mask, *, scale: float, dtype, backend: str | None = None):
  """:func:`jaxshare.kernels.decode.split_attention` (the Pallas decode kernel over the cache) per device under the
  ambient mesh: batch and K/V heads split as the cache is (same contract)."""
  kernel = functools.partial(decode.split_attention, scale=scale, dtype=dtype,
                             backend=backend or tuning.default_backend())
  if (mesh := _mesh()) is None:
    return kernel(q, k, v, mask)
  batch, heads, (kv,) = _head_specs(mesh, q.shape, (k[0].shape[1],))
  out, blocks = P(batch, None, heads, None), (P(batch, kv, None, None),) * 2
  return jax.shard_map(kernel, mesh=mesh, in_specs=(out, blocks, blocks, P(batch, None, None)), out_specs=out,
                       check_vma=False)(q, tuple(k), tuple(v), mask)
