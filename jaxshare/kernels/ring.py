"""Ring attention under context parallelism (``attention.context_strategy=ring``; MaxText's
``context_parallel_strategy: ring``): each device's queries attend the keys block by block as the blocks travel
round the context axis, so no device ever holds more than its own sequence shard of K/V.

The all-gather path (:mod:`jaxshare.kernels.local_queries`) gathers a producer's K/V once for all its readers; it
pays while the gathered K/V of a layer fit beside the step's other activations. Past that (dense beyond ~512k tokens
on 8 H100s) the ring holds one block of ``T / c`` tokens at a time, at the price of every reader rotating its keys
itself: ``(c - 1) / c`` of a layer's K/V per reader and direction, where the gather moves it once per producer.

Per device (in a ``shard_map``), with the load-balanced layout (:func:`jaxshare.context.layout`: device ``i`` holds
chunks ``i`` and ``2c - 1 - i`` of ``C = T / 2c`` tokens), at ring step ``s`` the device holds the key block of device
``j = i - s (mod c)``. Each of its two query chunks ``a`` attends each of the block's chunks ``b`` that it can see
(causal: ``b <= a``; sliding window: the nearest key within it) with the kernel's query offset ``(a - b) C``; at every
step after the first exactly two of the four chunk pairs are visible, so every device does the same work. Blocks
combine by their log-sum-exp (FlashAttention's rescaling: ``L = logsumexp_j lse_j``, ``O = sum_j exp(lse_j - L) O_j``)
or, for probability reuse, whose probabilities are final (``exp(s q kᵀ - lse)`` with the source's whole-row lse),
by a plain sum.

The backward pass is a second ring (a ``custom_vjp``: autodiff would keep every block that passed): the key blocks
travel again with their gradients, which arrive home after ``c`` steps. A block's gradients are the kernel's backward
pass alone (:func:`jaxshare.kernels.xla.attention_backward`, :func:`jaxshare.kernels.flash.attention_backward`) run
with the whole row's ``O`` and ``L``: FlashAttention-2's ``dS = P ∘ (dP − rowsum(dO ∘ O) + dL)`` with ``P = exp(s q kᵀ −
L)`` is, block by block, the block's share of the row's gradient. Where no such backward exists (full LISA's aligner
chains) a block's gradient is its vjp given its share of the cotangent, ``dO_j = w_j dO`` and ``dlse_j = w_j
(rowsum(dO ∘ (O_j − O)) + dL)`` with ``w_j = exp(lse_j − L)``, which runs the block's forward once more.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jaxshare import parallel
from jaxshare.context import AXIS, size
from jaxshare.kernels.local_queries import kv_axes

# Logical axes of a layer's K/V under the ring: sharded along the sequence like the activations.
_KV = ("activation_batch", "activation_length", "activation_kv_heads", None)
_OUTPUT = "ring_attention_output"  # the ring's output among its backward pass's residuals, named
_Q = ("activation_batch", "activation_length", "activation_heads", None)
_SEG = ("activation_batch", None)
_LSE = ("activation_batch", "activation_heads", "activation_length")

Block = Callable  # (query chunks, key chunks, extras, q segment ids, k segment ids, q_offset) -> out | (out, lse)


def _shift(tree):
  """Every device's block to the next device of the context ring."""
  c = size()
  return jax.lax.ppermute(tree, AXIS, [(j, (j + 1) % c) for j in range(c)])


def _halves(arrays: Sequence[jax.Array], axes: Sequence[int]) -> tuple[tuple, tuple]:
  """Each array's two chunks along its sequence axis: ``(first chunks, second chunks)``."""
  def cut(x, ax, n):
    return jax.lax.slice_in_dim(x, n * x.shape[ax] // 2, (n + 1) * x.shape[ax] // 2, axis=ax)
  return tuple(tuple(cut(x, ax, n) for x, ax in zip(arrays, axes)) for n in (0, 1))


def _join(halves: Sequence[Sequence[jax.Array]], axes: Sequence[int]) -> tuple:
  return tuple(jnp.concatenate(pair, axis=ax) for *pair, ax in zip(*halves, axes))


def _visible(a, b, chunk: int, causal: bool, window: int):
  """Whether query chunk ``a`` sees any key of chunk ``b`` (offsets ``(a - b) C ± (C - 1)``)."""
  seen = jnp.bool_(True)
  if causal:
    seen &= b <= a
  if window:
    seen &= (a - b) * chunk - (chunk - 1) < window
  return seen


def _pairs(c: int):
  """The chunk pairs of ring step ``s`` on device ``i``: ``(query half, query chunk, key half, key chunk)``."""
  i = jax.lax.axis_index(AXIS)

  def at(s: int):
    j = (i - s) % c
    return [(n, a, m, b) for n, a in enumerate((i, 2 * c - 1 - i)) for m, b in enumerate((j, 2 * c - 1 - j))]
  return at


def _add(acc, result, merge: bool):
  """Fold one block's result into a query chunk's accumulator (float32)."""
  if not merge:
    return acc + result.astype(jnp.float32)
  (o, l), (o_j, l_j) = acc, result
  total = jnp.logaddexp(l, l_j)
  weight = lambda x: jnp.where(x == -jnp.inf, 0.0, jnp.exp(x - total))  # noqa: E731
  rows = lambda w: jnp.swapaxes(w, 1, 2)[..., None]  # noqa: E731  [B, H, C] -> [B, C, H, 1]
  return o * rows(weight(l)) + o_j.astype(jnp.float32) * rows(weight(l_j)), total


def _around(c: int, step: Callable, keys, carry):
  """Run ``carry = step(s, key blocks, carry)`` for the ``c`` steps of the ring (a scan: the program does not grow with
  ``c``), the key blocks passed on after each step but the last. ``step`` returns ``(state, travelling)``:
  ``travelling`` (the key blocks' gradients) is passed on after every step, the last included, which brings it home;
  None when nothing travels."""
  def body(held, s):
    kv, carry = held
    state, travelling = step(s, kv, carry)
    return (_shift(kv), state if travelling is None else (state, _shift(travelling))), None

  if c > 1:
    (keys, carry), _ = jax.lax.scan(body, (keys, carry), jnp.arange(c - 1))
  state, travelling = step(c - 1, keys, carry)
  return state if travelling is None else (state, _shift(travelling))


def _ring(block: Block, merge: bool, q_axes: Sequence[int], key_axes: Sequence[int], causal: bool, window: int,
          block_grad: Callable | None):
  """The per-device ring attention of ``block`` as a function ``(queries, keys, extras, (segment_ids, fixed)) ->
  out`` (with ``merge``: ``(out, lse)``), its backward a second ring; ``extras`` are differentiable, ``fixed`` not."""
  c = size()

  def segments(segment_ids, n, chunk):
    return jax.lax.dynamic_slice_in_dim(segment_ids, n * chunk, chunk, axis=1)

  def call(q, kv, extras, consts, a, b, chunk):
    segment_ids, fixed = consts
    return block(q, kv, extras, fixed, segments(segment_ids, a, chunk), segments(segment_ids, b, chunk),
                 (a - b) * chunk)

  def call_grad(q, kv, consts, a, b, chunk, *row):
    segment_ids, _ = consts
    return block_grad(q, kv, segments(segment_ids, a, chunk), segments(segment_ids, b, chunk), (a - b) * chunk, *row)

  def forward(queries, keys, extras, consts):
    q_half = _halves(queries, q_axes)
    chunk = queries[0].shape[q_axes[0]] // 2
    shape = jax.eval_shape(lambda: call(q_half[0], _halves(keys, key_axes)[0], extras, consts, 0, 0, chunk))
    zeros = lambda s: jnp.zeros(s.shape, jnp.float32)  # noqa: E731
    acc = [(zeros(shape[0]), jnp.full(shape[1].shape, -jnp.inf)) if merge else zeros(shape)] * 2
    pairs = _pairs(c)

    def step(s, kv, acc):  # every visible chunk pair of ring step s
      kv_half, acc = _halves(kv, key_axes), list(acc)
      for n, a, m, b in pairs(s):
        visit = lambda acc_n, n=n, a=a, m=m, b=b: _add(acc_n, call(q_half[n], kv_half[m], extras, consts, a, b,
                                                                      chunk), merge)
        acc[n] = jax.lax.cond(_visible(a, b, chunk, causal, window), visit, lambda acc_n: acc_n, acc[n])
      return acc

    acc = _around(c, lambda s, kv, acc: (step(s, kv, acc), None), keys, acc)
    dtype = shape[0].dtype if merge else shape.dtype
    if merge:
      return (jnp.concatenate([o for o, _ in acc], 1).astype(dtype), jnp.concatenate([l for _, l in acc], 2))
    return jnp.concatenate(acc, 1).astype(dtype)

  @jax.custom_vjp
  def ring(queries, keys, extras, consts):
    return forward(queries, keys, extras, consts)

  def ring_fwd(queries, keys, extras, consts):
    out = forward(queries, keys, extras, consts)
    # named, so that a checkpoint policy that recomputes casts and concatenations (model.remat=none's) keeps the
    # output rather than running the forward ring again in the backward pass
    return out, (queries, keys, extras, consts, jax.tree.map(lambda x: checkpoint_name(x, _OUTPUT), out))

  def ring_bwd(res, d_out):
    queries, keys, extras, consts, out = res
    q_half = _halves(queries, q_axes)
    chunk = queries[0].shape[q_axes[0]] // 2
    out_axes = (1, 2) if merge else (1,)
    o_half = _halves(out if merge else (out,), out_axes)  # o_half[n]: chunk n's (out, lse) or (out,)
    do_half = _halves(d_out if merge else (d_out,), out_axes)
    if merge:  # each query chunk's lse and delta = rowsum(dO ∘ O) − dL, read by every pair's backward
      grad_rows = [(l, jnp.einsum("bthd,bthd->bht", do.astype(jnp.float32), o.astype(jnp.float32)) - dl, do)
                   for (o, l), (do, dl) in zip(o_half, do_half)]
    else:
      grad_rows = do_half
    f32 = lambda tree: jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), tree)  # noqa: E731
    d_q, d_kv, d_extras = [f32(h) for h in q_half], f32(keys), f32(extras)
    pairs = _pairs(c)

    def visit(n, a, b, kv_m, carry):
      d_q_n, d_kv_m, d_extras = carry
      plus = lambda acc, g: jax.tree.map(lambda x, y: x + y.astype(jnp.float32), acc, g)  # noqa: E731
      if block_grad is not None:  # the kernel's backward alone, from the whole rows' statistics: no forward rerun
        g_q, g_kv = call_grad(q_half[n], kv_m, consts, a, b, chunk, *grad_rows[n])
        return plus(d_q_n, g_q), plus(d_kv_m, g_kv), d_extras
      primal, vjp = jax.vjp(lambda q, kv, e: call(q, kv, e, consts, a, b, chunk), q_half[n], kv_m, extras)
      o, do = o_half[n][0], do_half[n][0]
      if merge:
        (o_j, l_j), l, dl = primal, o_half[n][1], do_half[n][1]
        w = jnp.where(l_j == -jnp.inf, 0.0, jnp.exp(l_j - l))  # [B, H, C]: the block's share of the row
        rows = jnp.swapaxes(w, 1, 2)[..., None]
        spread = jnp.einsum("bthd,bthd->bht", do.astype(jnp.float32), o_j.astype(jnp.float32) - o.astype(jnp.float32))
        grads = vjp(((rows * do.astype(jnp.float32)).astype(o_j.dtype), w * (spread + dl)))
      else:
        grads = vjp(do.astype(primal.dtype))
      return plus(d_q_n, grads[0]), plus(d_kv_m, grads[1]), plus(d_extras, grads[2])

    def step(s, kv, carry):  # every visible chunk pair of ring step s; its key chunks' gradients travel on
      (d_q, d_extras), d_kv = carry
      kv_half, d_kv_half, d_q = _halves(kv, key_axes), list(_halves(d_kv, key_axes)), list(d_q)
      for n, a, m, b in pairs(s):
        d_q[n], d_kv_half[m], d_extras = jax.lax.cond(
          _visible(a, b, chunk, causal, window), lambda carry, n=n, a=a, b=b, m=m: visit(n, a, b, kv_half[m], carry),
          lambda carry: carry, (d_q[n], d_kv_half[m], d_extras))
      return (d_q, d_extras), _join(d_kv_half, key_axes)

    (d_q, d_extras), d_kv = _around(c, step, keys, ((d_q, d_extras), d_kv))
    cast = lambda grads, primals: jax.tree.map(lambda g, x: g.astype(x.dtype), grads, primals)  # noqa: E731
    return (cast(_join(d_q, q_axes), queries), cast(d_kv, keys), cast(d_extras, extras), None)

  ring.defvjp(ring_fwd, ring_bwd)
  return ring


def ring_attention(block: Block, queries: Sequence[tuple[jax.Array, tuple, int]],
                   keys: Sequence[tuple[jax.Array, tuple, int]], extras, segment_ids: jax.Array, out_axes, *,
                   merge: bool, causal: bool = True, window: int = 0, block_grad: Callable | None = None):
  """Ring attention of ``block`` over the context axis.

  Args:
    block: ``block(query chunks, key chunks, extras, q_segment_ids, kv_segment_ids, q_offset)``: one query chunk's
      attention to one key chunk (tuples of arrays as given, each cut along its sequence axis), the queries tokens
      ``q_offset ..`` of the keys' (int32 scalar, traced); returns ``(out [B, C, H, d], lse [B, H, C] float32)``
      with ``merge``, else an ``out`` that adds up over the key chunks (probability reuse).
    queries: ``(array, logical axes, sequence axis)`` of the query side, sharded along the sequence over the context
      axis in the load-balanced layout (:func:`jaxshare.context.layout`).
    keys: the same for the key side (keys, values): the blocks that travel round the ring.
    extras: a pytree every device reads whole (aligner weights); its gradient is summed over the ring.
    segment_ids: ``[B, T]`` int32 document ids of the whole sequence, in order.
    out_axes: the logical axes of ``out`` (and of ``lse`` with ``merge``).
    merge: combine blocks by their log-sum-exp (own softmax) rather than summing them (probability reuse).
    causal, window: the mask, as :func:`jaxshare.kernels.reference.attention_mask`: chunk pairs it hides entirely are
      skipped.
    block_grad: ``block_grad(query chunks, key chunks, q_segment_ids, kv_segment_ids, q_offset, *rows)`` -> the
      gradients of both (tuples as given) of one chunk pair, without rerunning ``block``: ``rows`` are the query
      chunk's whole-row ``lse``, ``delta = rowsum(dO ∘ O) − dL`` and ``d_out`` with ``merge``, else ``d_out``. None: each pair's gradient is its
      ``block``'s vjp weighted by its share of the row (its forward runs again); ``extras`` need that.

  Returns:
    ``out [B, T, H, d]`` (and ``lse [B, H, T]`` float32 with ``merge``) in the layout, sharded like the queries.
  """
  mesh = jax.sharding.get_abstract_mesh()
  spec = lambda x, axes: parallel.logical_to_spec(axes, x.shape, mesh)  # noqa: E731
  leaves, tree = jax.tree.flatten(extras)
  inexact = [jnp.issubdtype(x.dtype, jnp.inexact) for x in leaves]

  def split_block(q, kv, floats, fixed, q_seg, k_seg, offset):  # the extras whole again, for the block
    floats, fixed = iter(floats), iter(fixed)
    return block(q, kv, tree.unflatten([next(floats) if f else next(fixed) for f in inexact]), q_seg, k_seg, offset)

  if block_grad is not None and leaves:
    raise ValueError("a ring block with extras has its gradient by vjp: pass no block_grad")
  ring = _ring(split_block, merge, [ax for *_, ax in queries], [ax for *_, ax in keys], causal, window, block_grad)
  q_spec = dict(zip(queries[0][1], spec(*queries[0][:2])))
  as_spec = lambda axes: P(*(q_spec.get(a) if a else None for a in axes))  # noqa: E731
  out_specs = tuple(as_spec(a) for a in out_axes) if merge else as_spec(out_axes)
  floats = tuple(x for x, f in zip(leaves, inexact) if f)
  fixed = tuple(x for x, f in zip(leaves, inexact) if not f)
  in_specs = (tuple(spec(x, axes) for x, axes, _ in queries), tuple(spec(x, axes) for x, axes, _ in keys),
              tuple(P() for _ in floats), (spec(segment_ids, _SEG), tuple(P() for _ in fixed)))
  with jax.named_scope("kv_gather"):  # the ring's permutes move K/V: the fit check counts them so
    return jax.shard_map(ring, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(
      tuple(x for x, *_ in queries), tuple(x for x, *_ in keys), floats, (segment_ids, fixed))


def attention(kernel: Callable, q, k, v, segment_ids, *, causal: bool = True, scale: float | None = None,
              window: int = 0, return_lse: bool = False, backward: Callable | None = None):
  """Softmax attention (the contract of :func:`jaxshare.kernels.reference.attention`) of ``q [B, T, H, e]``, ``k [B,
  T, G, e]``, ``v [B, T, G, d]``, all in the layout and sharded along the sequence, ``segment_ids [B, T]`` whole and
  in order, round the ring: ``kernel`` (that contract plus ``q_offset``) per device and chunk pair, and in the
  backward pass ``backward`` (:func:`jaxshare.kernels.xla.attention_backward`'s contract; None: the kernel's vjp,
  its forward run again)."""
  k_axes, v_axes = kv_axes(q, k, v, _KV)

  def block(q, kv, extras, q_seg, k_seg, offset):
    del extras
    return kernel(q[0], *kv, q_seg, k_seg, causal=causal, scale=scale, window=window, return_lse=True,
                  q_offset=offset)

  def grad(q, kv, q_seg, k_seg, offset, lse, delta, d_out):
    dq, dk, dv = backward(q[0], *kv, q_seg, k_seg, lse, delta, d_out, causal=causal, scale=scale, window=window,
                          q_offset=offset)
    return (dq,), (dk, dv)

  out, lse = ring_attention(block, [(q, _Q, 1)], [(k, k_axes, 1), (v, v_axes, 1)], (), segment_ids, (_Q, _LSE),
                            merge=True, causal=causal, window=window, block_grad=backward and grad)
  return (out, lse) if return_lse else out


def attention_from_lse(kernel: Callable, q, k, lse, v, segment_ids, *, scale: float, causal: bool = True,
                       window: int = 0, backward: Callable | None = None):
  """Probability reuse (the contract of :func:`jaxshare.kernels.reference.attention_from_lse`) round the ring: the
  source's ``q`` and whole-row ``lse [B, H, T]`` stay, its ``k`` and the reuser's ``v`` travel (all in the layout,
  sharded along the sequence); each chunk pair's probabilities are final, so the blocks add up. In the backward
  pass ``backward`` (:func:`jaxshare.kernels.xla.attention_backward`'s contract, run with ``delta = 0``; None: the
  kernel's vjp) gives each pair's gradients; ``lse``'s, ``-rowsum(dO ∘ O)`` (``∂O/∂lse = -O``), is taken once,
  outside the ring."""
  k_axes, v_axes = kv_axes(q, k, v, _KV)
  fixed = jax.lax.stop_gradient(lse)

  def block(q_side, kv, extras, q_seg, k_seg, offset):
    del extras
    (q, lse), (k, v) = q_side, kv
    return kernel(q, k, lse, v, q_seg, k_seg, scale=scale, causal=causal, window=window, q_offset=offset)

  def grad(q_side, kv, q_seg, k_seg, offset, d_out):
    (q, lse), (k, v) = q_side, kv
    heads = math.lcm(k.shape[2], v.shape[2])  # source K and reuser V heads, both repeated to their lcm
    wide = lambda x: jnp.repeat(x, heads // x.shape[2], axis=2)  # noqa: E731
    fold = lambda d, g: d.reshape(*d.shape[:2], g, heads // g, d.shape[3]).sum(3)  # noqa: E731
    dq, dk, dv = backward(q, wide(k), wide(v), q_seg, k_seg, lse, jnp.zeros_like(lse), d_out, causal=causal,
                          scale=scale, window=window, q_offset=offset)
    return (dq, jnp.zeros_like(lse)), (fold(dk, k.shape[2]), fold(dv, v.shape[2]))

  out = ring_attention(block, [(q, _Q, 1), (fixed, _LSE, 2)], [(k, k_axes, 1), (v, v_axes, 1)], (), segment_ids, _Q,
                       merge=False, causal=causal, window=window, block_grad=backward and grad)
  # zero in value; its gradient takes lse's share, -rowsum(dO ∘ O), that the ring (fed a constant lse) leaves out
  moved = jnp.swapaxes(lse - fixed, 1, 2)[..., None] * jax.lax.stop_gradient(out).astype(jnp.float32)
  return (out.astype(jnp.float32) - moved).astype(out.dtype)
