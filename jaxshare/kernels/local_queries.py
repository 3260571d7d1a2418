"""Attention under context parallelism (:mod:`jaxshare.context`): each device's local queries against the gathered keys.

In a ``shard_map`` over the mesh each device runs a kernel on each of its two query chunks (the load-balanced
layout's chunks ``i`` and ``2c - 1 - i``), telling it where the chunk starts in the sequence (``q_offset``: query row
``t`` is token ``q_offset + t``), so that causal masks, sliding windows and packed documents (the chunk's segment ids
are sliced from the gathered ones) follow the tokens. The keys arrive gathered and in order (:func:`jaxshare.context
.gather_keys`): the kernels issue no collective.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxshare import parallel
from jaxshare.context import AXIS, GATHERED, in_order, size


def _chunks(q_rows: int) -> tuple[tuple[int, jax.Array], ...]:
  """This device's two query chunks in a ``shard_map``: ``(start row in the local block, offset in the sequence)``."""
  c, i = size(), jax.lax.axis_index(AXIS)
  half = q_rows // 2
  return (0, i * half), (half, (2 * c - 1 - i) * half)


def local_queries(kernel: Callable, queries: Sequence[tuple[jax.Array, tuple]], keys: Sequence[tuple],
                  out_axes, *, query_axis: Sequence[int], out_query_axis) -> object:
  """Run ``kernel(*local query chunks, *keys, q_offset)`` on each device's two query chunks and join the results.

  Args:
    kernel: called twice per device with each query array's chunk, the key arrays whole and the chunk's offset in
      the sequence (int32 scalar); returns an array or a tuple of arrays.
    queries: ``(array, logical axes)`` pairs sharded along the sequence (``activation_length``: over the context
      axis) in the load-balanced layout (:func:`jaxshare.context.layout`).
    keys: ``(array, logical axes, sequence axis)`` triples replicated along the sequence: gathered keys in the
      layout (:func:`jaxshare.context.gather_keys`), put in order on each device (:func:`~jaxshare.context.in_order`)
      along their sequence axis; None where the array is in order already or has none (document ids, weights). A
      pytree with axes None is replicated whole.
    out_axes: the logical axes of each output (a tuple of tuples for several outputs).
    query_axis: the sequence axis of each query array; out_query_axis: of each output (an int or a tuple).

  Returns:
    The outputs in the layout, sharded like the queries.
  """
  mesh = jax.sharding.get_abstract_mesh()

  def spec(a, axes):
    if axes is None:
      return jax.tree.map(lambda _: P(), a)
    return parallel.logical_to_spec(axes, a.shape, mesh)

  several = isinstance(out_query_axis, tuple)

  c = size()

  def per_device(*args):
    local_q = args[:len(queries)]
    local_k = [x if ax is None else in_order(x, ax, c) for x, (_, _, ax) in zip(args[len(queries):], keys)]
    rows = local_q[0].shape[query_axis[0]]
    outs = []
    for start, offset in _chunks(rows):
      chunk = [jax.lax.slice_in_dim(a, start, start + rows // 2, axis=ax) for a, ax in zip(local_q, query_axis)]
      outs.append(kernel(*chunk, *local_k, offset))
    if several:
      return tuple(jnp.concatenate(parts, axis=ax) for parts, ax in zip(zip(*outs), out_query_axis))
    return jnp.concatenate(outs, axis=out_query_axis)

  in_specs = tuple(spec(a, axes) for a, axes, *_ in (*queries, *keys))
  with jax.named_scope("kv_gather"):  # its transpose sums the keys' gradients over the context axis: K/V traffic
    return jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=_out_specs(out_axes, queries, mesh),
                         check_vma=False)(*(a for a, *_ in (*queries, *keys)))


def _out_specs(out_axes, queries, mesh):
  """Output specs: each output's logical axes mapped as the first query's dimensions of the same names are (its
  shape is known only inside the ``shard_map``)."""
  q, names = queries[0]
  by_name = dict(zip(names, parallel.logical_to_spec(names, q.shape, mesh)))
  as_spec = lambda axes: P(*(by_name.get(a) if a else None for a in axes))  # noqa: E731
  if all(a is None or isinstance(a, str) for a in out_axes):
    return as_spec(out_axes)
  return tuple(as_spec(a) for a in out_axes)


_Q = ("activation_batch", "activation_length", "activation_heads", None)
_KV = GATHERED
_SEG = ("activation_batch", None)
_LSE = ("activation_batch", "activation_heads", "activation_length")


def kv_axes(q: jax.Array, k: jax.Array, v: jax.Array, base: tuple = _KV) -> tuple[tuple, tuple]:
  """K/V logical axes from ``base`` (gathered keys by default): heads split like the queries' only where query head h
  finds K/V head ``h // (H/G)`` on its own device (as :mod:`jaxshare.kernels.pallas` splits them), else whole.

  Raises:
    NotImplementedError: K/V heads that split neither like the query heads nor not at all.
  """
  mesh = jax.sharding.get_abstract_mesh()
  heads = parallel.logical_to_spec(("activation_heads",), q.shape[2:3], mesh)[0]
  split = math.prod(mesh.shape[a] for a in ((heads,) if isinstance(heads, str) else heads or ()))
  axes = lambda g: base if split > 1 and g % split == 0 else (*base[:2], None, None)  # noqa: E731
  if split > 1 and any(g % split and g != 1 for g in (k.shape[2], v.shape[2])):
    raise NotImplementedError("context parallelism with K/V heads that do not split like the query heads")
  return axes(k.shape[2]), axes(v.shape[2])


def attention(kernel: Callable, q, k, v, segment_ids, *, causal: bool = True, scale: float | None = None,
              window: int = 0, return_lse: bool = False):
  """Softmax attention (the contract of :func:`jaxshare.kernels.reference.attention`) of local queries ``q [B, T, H,
  e]`` (in the :func:`~jaxshare.context.layout`) against gathered keys ``k [B, S, G, e]``, ``v [B, S, G, d]`` (in the
  layout too) and document ids ``segment_ids [B, S]`` (in order): ``kernel`` (that contract plus ``q_offset``) per
  device and query chunk."""
  k_axes, v_axes = kv_axes(q, k, v)

  def chunk(q, k, v, seg, offset):
    q_seg = jax.lax.dynamic_slice_in_dim(seg, offset, q.shape[1], axis=1)
    return kernel(q, k, v, q_seg, seg, causal=causal, scale=scale, window=window, return_lse=return_lse,
                  q_offset=offset)

  out_axes, out_query_axis = ((_Q, _LSE), (1, 2)) if return_lse else (_Q, 1)
  return local_queries(chunk, [(q, _Q)], [(k, k_axes, 1), (v, v_axes, 1), (segment_ids, _SEG, None)], out_axes,
                       query_axis=(1,), out_query_axis=out_query_axis)


def attention_from_lse(kernel: Callable, q, k, lse, v, segment_ids, *, scale: float, causal: bool = True,
                       window: int = 0):
  """Probability reuse (the contract of :func:`jaxshare.kernels.reference.attention_from_lse`) of the source's local
  queries ``q`` and log-sum-exp ``lse [B, H, T]`` (in the :func:`~jaxshare.context.layout`) against its gathered
  keys ``k`` and the reuser's gathered values ``v``: ``kernel`` (that contract plus ``q_offset``) per device and query
  chunk."""
  k_axes, v_axes = kv_axes(q, k, v)

  def chunk(q, lse, k, v, seg, offset):
    q_seg = jax.lax.dynamic_slice_in_dim(seg, offset, q.shape[1], axis=1)
    return kernel(q, k, lse, v, q_seg, seg, scale=scale, causal=causal, window=window, q_offset=offset)

  return local_queries(chunk, [(q, _Q), (lse, _LSE)], [(k, k_axes, 1), (v, v_axes, 1), (segment_ids, _SEG, None)],
                       _Q, query_axis=(1, 2), out_query_axis=1)
