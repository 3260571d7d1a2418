"""Pallas flash attention that understands the sharing schedule: one kernel family for TPU (Mosaic) and GPU
(Triton lowering), run with ``interpret=True`` on CPU.

Three kernels, each a grid over (batch, head, block) with a loop over the other sequence axis in blocks
(FlashAttention-2, Dao 2023, Alg. 1 and 2):

- forward: online softmax over key blocks; writes the output and the log-sum-exp (the ``lse`` residual, also handed
  to probability-reusing layers). With ``reuse`` the softmax statistics are an *input*: the output is
  ``exp(s·q kᵀ − lse) · V`` with no reduction (Shared Attention Alg. 1, UniAttn Eq. 3), the V being a consumer's;
- dQ: per query block, loop over key blocks;
- dK/dV: per K/V head and key block, loop over the ``H/G`` query heads that read it and their query blocks, so GQA and
  MQA never repeat K/V and their gradients are summed in the kernel.

Both modes share the backward: with ``P = exp(s·q kᵀ − lse)`` recomputed per tile,
``dV = Pᵀ dO``, ``dS = P ∘ (dO Vᵀ − δ)``, ``dQ = s·dS K``, ``dK = s·dSᵀ Q``, where flash attention has
``δ = rowsum(dO ∘ O) − d̄lse`` (``d̄lse`` the cotangent of the returned LSE) and reuse has ``δ = 0`` and sends
``d̄lse = −rowsum(dO ∘ O)`` to the source layer (``∂O/∂lse = −O``).

Layout inside: heads-major ``[B, H, T, e]``; sequences padded to the block sizes (padded keys masked by index),
feature widths padded with zeros to a power of two of at least 16 (Triton needs power-of-two tiles; zero features
leave ``q kᵀ`` unchanged, so LISA_plus's concatenated widths work as they are). K/V blocks span the whole key
sequence in on-chip memory: on TPU that bounds ``S·(e + d)`` per head to VMEM (about 16k keys at e = d = 128 bf16).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxshare.kernels import tuning
from jaxshare.kernels.reference import _MASK_VALUE

_NT = (((1,), (1,)), ((), ()))  # a @ bᵀ

def _mask(geo: tuning.Geometry, q_start, k_start, q_seg: jax.Array, k_seg: jax.Array, transposed: bool = False
          ) -> jax.Array:
  """``[bq, bk]`` (``q_seg [bq, 1]``, ``k_seg [1, bk]``), or ``[bk, bq]`` when ``transposed`` (``q_seg [1, bq]``,
  ``k_seg [bk, 1]``): same segment, a real (unpadded) key, causal and window constraints."""
  shape = (k_seg.shape[0], q_seg.shape[1]) if transposed else (q_seg.shape[0], k_seg.shape[1])
  q_pos = lax.broadcasted_iota(jnp.int32, shape, 1 if transposed else 0) + q_start
  k_pos = lax.broadcasted_iota(jnp.int32, shape, 0 if transposed else 1) + k_start
  mask = (q_seg == k_seg) & (k_pos < geo.s)
  if geo.causal:
    mask = mask & (k_pos <= q_pos)
  if geo.window:
    mask = mask & (q_pos - k_pos < geo.window)
  return mask


def _key_blocks(geo: tuning.Geometry, i, offset=0):
  """Half-open range of key blocks that query block ``i`` can see (causal and window skip the rest); its rows are
  tokens ``offset + i·block_q ..`` of the keys' sequence."""
  nk = geo.s_padded // geo.block_k
  lo, hi = 0, nk
  if geo.causal:
    hi = jnp.minimum(nk, lax.div((i + 1) * geo.block_q + offset + geo.block_k - 1, geo.block_k))
  if geo.window:
    lo = jnp.minimum(hi, lax.div(jnp.maximum(i * geo.block_q + offset - geo.window + 1, 0), geo.block_k))
  return lo, hi


def _query_blocks(geo: tuning.Geometry, j, offset=0):
  """Half-open range of query blocks that can see key block ``j`` (query rows are tokens ``offset + row``)."""
  nq = geo.t_padded // geo.block_q
  lo, hi = 0, nq
  if geo.causal:
    lo = jnp.minimum(nq, lax.div(jnp.maximum(j * geo.block_k - offset, 0), geo.block_q))
  if geo.window:  # the last row r with r + offset - ((j + 1) block_k - 1) < window, plus one, as a block count
    hi = jnp.minimum(nq, lax.div(jnp.maximum((j + 1) * geo.block_k + geo.window - 2 - offset + geo.block_q, 0),
                                 geo.block_q))
  return lo, hi


def _offset(refs, geo: tuning.Geometry):
  """``(query offset, the other refs)``: with ``geo.offset`` the first ref holds the queries' offset in the keys'
  sequence (an int32 ``[1]`` in SMEM on TPU), else it is 0."""
  if not geo.offset:
    return 0, refs
  return refs[0][0], refs[1:]


def _dot(a, b, dims=(((1,), (0,)), ((), ()))):
  """A float32-accumulated tile matmul; mixed operand dtypes (LISA_plus's float32 features against bf16 values, a
  float32 output cotangent against bf16 V) meet in the wider one, as Triton and Mosaic need equal types."""
  dtype = jnp.promote_types(a.dtype, b.dtype)
  return lax.dot_general(a.astype(dtype), b.astype(dtype), dims, preferred_element_type=jnp.float32)


def _block_slice(i, block: int, padded: int):
  """Block ``i`` of a whole-sequence axis of ``padded`` positions. A single block is sliced statically: Mosaic must
  prove a dynamic lane-dimension offset (of ``[1, S]`` segment ids or ``[1, T]`` row statistics) a multiple of 128,
  which a short block is not."""
  if padded == block:
    return pl.ds(0, block)
  return pl.ds(pl.multiple_of(i * block, block), block)


def _probs(geo: tuning.Geometry, q, k, lse, mask):
  return jnp.where(mask, jnp.exp(_dot(q, k, _NT) * geo.scale - lse), 0.0)


def _forward_kernel(*refs, geo: tuning.Geometry, reuse: bool):
  offset, refs = _offset(refs, geo)
  if reuse:
    q_ref, k_ref, v_ref, q_seg_ref, k_seg_ref, lse_in_ref, o_ref = refs
  else:
    q_ref, k_ref, v_ref, q_seg_ref, k_seg_ref, o_ref, lse_ref = refs
  bq, bk = geo.block_q, geo.block_k
  i = pl.program_id(2)
  q, q_seg = q_ref[...], q_seg_ref[...]

  def tile(j):
    keys = _block_slice(j, geo.block_k, geo.s_padded)
    return k_ref[keys, :], v_ref[keys, :], _mask(geo, i * bq + offset, j * bk, q_seg, k_seg_ref[:, keys])

  lo, hi = _key_blocks(geo, i, offset)
  acc = jnp.zeros((bq, v_ref.shape[-1]), jnp.float32)
  if reuse:
    lse = lse_in_ref[...]

    def reuse_body(j, acc):
      k, v, mask = tile(j)
      p = _probs(geo, q, k, lse, mask)
      return acc + _dot(p.astype(v.dtype), v)

    o_ref[...] = lax.fori_loop(lo, hi, reuse_body, acc).astype(o_ref.dtype)
    return

  def body(j, carry):
    acc, m, l = carry
    k, v, mask = tile(j)
    s = jnp.where(mask, _dot(q, k, _NT) * geo.scale, _MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
    alpha = jnp.exp(m - m_new)
    l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
    acc = alpha * acc + _dot(p.astype(v.dtype), v)
    return acc, m_new, l

  m = jnp.full((bq, 1), _MASK_VALUE, jnp.float32)
  acc, m, l = lax.fori_loop(lo, hi, body, (acc, m, jnp.zeros((bq, 1), jnp.float32)))
  l = jnp.where(l == 0.0, 1.0, l)  # a row with no visible key (padding only): output 0, finite lse
  o_ref[...] = (acc / l).astype(o_ref.dtype)
  lse_ref[...] = m + jnp.log(l)


def _dq_kernel(*refs, geo: tuning.Geometry):
  offset, (q_ref, k_ref, v_ref, q_seg_ref, k_seg_ref, lse_ref, delta_ref, do_ref, dq_ref) = _offset(refs, geo)
  bq, bk = geo.block_q, geo.block_k
  i = pl.program_id(2)
  q, q_seg, lse, delta, do = q_ref[...], q_seg_ref[...], lse_ref[...], delta_ref[...], do_ref[...]

  def body(j, dq):
    keys = _block_slice(j, geo.block_k, geo.s_padded)
    k, v = k_ref[keys, :], v_ref[keys, :]
    p = _probs(geo, q, k, lse, _mask(geo, i * bq + offset, j * bk, q_seg, k_seg_ref[:, keys]))
    ds = p * (_dot(do, v, _NT) - delta)
    return dq + _dot(ds.astype(k.dtype), k)

  lo, hi = _key_blocks(geo, i, offset)
  dq = lax.fori_loop(lo, hi, body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (dq * geo.scale).astype(dq_ref.dtype)


def _dkv_kernel(*refs, geo: tuning.Geometry):
  """Keys × queries orientation: ``Pᵀ = exp(s·K Qᵀ − lse)`` with the row statistics lane-dense (``[1, T]`` per
  head, 4 bytes a position in VMEM where a ``[T, 1]`` column takes a 128-lane row), and no tile transposes."""
  offset, (q_ref, k_ref, v_ref, q_seg_ref, k_seg_ref, lse_ref, delta_ref, do_ref, dk_ref, dv_ref) = _offset(refs, geo)
  bk = geo.block_k
  j = pl.program_id(2)
  k, v, k_seg = k_ref[...], v_ref[...], k_seg_ref[...]
  lo, hi = _query_blocks(geo, j, offset)

  def head(r, carry):
    def body(i, carry):
      dk, dv = carry
      rows = pl.ds(pl.multiple_of(i * geo.block_q, geo.block_q), geo.block_q)  # sublane offsets: any multiple of 8
      cols = _block_slice(i, geo.block_q, geo.t_padded)
      q, do = q_ref[r, rows, :], do_ref[r, rows, :]
      mask = _mask(geo, i * geo.block_q + offset, j * bk, q_seg_ref[:, cols], k_seg, transposed=True)
      p_t = jnp.where(mask, jnp.exp(_dot(k, q, _NT) * geo.scale - lse_ref[r, :, cols]), 0.0)  # [bk, bq]
      dv = dv + _dot(p_t.astype(do.dtype), do)
      ds_t = p_t * (_dot(v, do, _NT) - delta_ref[r, :, cols])
      dk = dk + _dot(ds_t.astype(q.dtype), q)
      return dk, dv

    return lax.fori_loop(lo, hi, body, carry)

  zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  dk, dv = lax.fori_loop(0, q_ref.shape[0], head, zeros)
  dk_ref[...] = (dk * geo.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _offset_spec(backend: str) -> list:
  """The BlockSpec of the int32 ``[1]`` query offset, first among a kernel's inputs (none without one): in SMEM on
  TPU, where loop bounds are scalars; a one-element block elsewhere."""
  if backend == "mosaic_tpu":
    from jax.experimental.pallas import tpu as pltpu
    return [pl.BlockSpec(memory_space=pltpu.SMEM)]
  return [pl.BlockSpec((1,), lambda *_: (0,))]


def _specs(geo: tuning.Geometry, q, k, v):
  """BlockSpecs of the query-block grid ``(B, H, T/bq)``: query head h reads K/V head ``h // (H/G)``."""
  r = q.shape[1] // k.shape[1]
  bq, sp = geo.block_q, k.shape[2]
  return dict(
    q=pl.BlockSpec((None, None, bq, q.shape[3]), lambda b, h, i: (b, h, i, 0)),
    k=pl.BlockSpec((None, None, sp, k.shape[3]), lambda b, h, i: (b, h // r, 0, 0)),
    v=pl.BlockSpec((None, None, sp, v.shape[3]), lambda b, h, i: (b, h // r, 0, 0)),
    q_seg=pl.BlockSpec((None, bq, 1), lambda b, h, i: (b, i, 0)),
    k_seg=pl.BlockSpec((None, 1, sp), lambda b, h, i: (b, 0, 0)),
    row=pl.BlockSpec((None, None, bq, 1), lambda b, h, i: (b, h, i, 0)),
    o=pl.BlockSpec((None, None, bq, v.shape[3]), lambda b, h, i: (b, h, i, 0)),
  )


def _forward(q, k, v, q_seg, k_seg, lse_in, offset, geo: tuning.Geometry, backend: str):
  geo = geo.forward()
  b, h, tp, _ = q.shape
  spec = _specs(geo, q, k, v)
  reuse = lse_in is not None
  out_shape = [jax.ShapeDtypeStruct((b, h, tp, v.shape[3]), v.dtype if reuse else q.dtype)]
  out_specs = [spec["o"]]
  if not reuse:  # a [.., T, 1] column: on TPU its HBM tiles pad it to 128 lanes (a lane-dense LSE is left to do)
    out_shape.append(jax.ShapeDtypeStruct((b, h, tp, 1), jnp.float32))
    out_specs.append(spec["row"])
  outs = pl.pallas_call(
    functools.partial(_forward_kernel, geo=geo, reuse=reuse), out_shape=out_shape,
    grid=(b, h, tp // geo.block_q),
    in_specs=_offsets(geo, backend) + [spec["q"], spec["k"], spec["v"], spec["q_seg"], spec["k_seg"]]
    + ([spec["row"]] if reuse else []),
    out_specs=out_specs,
    **tuning.launch_params(backend, "jaxshare_flash_forward", geo, tuning.operands(q, k, v, out_shape[0].dtype)),
  )(*_offset_arg(offset), q, k, v, q_seg, k_seg, *([lse_in] if reuse else []))
  return outs[0] if reuse else (outs[0], outs[1])


def _offsets(geo: tuning.Geometry, backend: str) -> list:
  return _offset_spec(backend) if geo.offset else []


def _offset_arg(offset) -> tuple:
  return () if offset is None else (offset,)


def _backward(q, k, v, q_seg, k_seg, lse, delta, do, offset, geo: tuning.Geometry, backend: str):
  """``(dQ, dK, dV)`` in the input dtypes; ``lse``/``delta [B, H, Tp, 1]`` float32; segment ids as the forward's."""
  b, h, tp, e = q.shape
  g, sp = k.shape[1], k.shape[2]
  r, bk = h // g, geo.block_k
  spec = _specs(geo, q, k, v)
  ops = tuning.operands(q, k, v, do.dtype)
  dq = pl.pallas_call(
    functools.partial(_dq_kernel, geo=geo), out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
    grid=(b, h, tp // geo.block_q),
    in_specs=_offsets(geo, backend) + [spec["q"], spec["k"], spec["v"], spec["q_seg"], spec["k_seg"], spec["row"],
                                       spec["row"], spec["o"]],
    out_specs=spec["q"], **tuning.launch_params(backend, "jaxshare_flash_dq", geo, ops),
  )(*_offset_arg(offset), q, k, v, q_seg, k_seg, lse, delta, do)
  # The dK/dV grid (B, G, S/bk): a K/V head's block against the whole query sequence of its H/G query heads; row
  # statistics and query segment ids as lane-dense rows, key segment ids as a column.
  heads = lambda *tail: pl.BlockSpec((None, r, *tail), lambda b_, g_, j: (b_, g_, 0, 0))  # noqa: E731
  keys = lambda width: pl.BlockSpec((None, None, bk, width), lambda b_, g_, j: (b_, g_, j, 0))  # noqa: E731
  dk, dv = pl.pallas_call(
    functools.partial(_dkv_kernel, geo=geo),
    out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
    grid=(b, g, sp // bk),
    in_specs=_offsets(geo, backend) + [
      heads(tp, e), keys(e), keys(v.shape[3]), pl.BlockSpec((None, 1, tp), lambda b_, g_, j: (b_, 0, 0)),
      pl.BlockSpec((None, bk, 1), lambda b_, g_, j: (b_, j, 0)), heads(1, tp), heads(1, tp), heads(tp, v.shape[3])],
    out_specs=[keys(e), keys(v.shape[3])], **tuning.launch_params(backend, "jaxshare_flash_dkv", geo, ops),
  )(*_offset_arg(offset), q, k, v, q_seg.reshape(b, 1, tp), k_seg.reshape(b, sp, 1), lse.reshape(b, h, 1, tp),
    delta.reshape(b, h, 1, tp), do)
  return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _flash(q, k, v, q_seg, k_seg, offset, geo, backend):
  return _forward(q, k, v, q_seg, k_seg, None, offset, geo, backend)


def _flash_fwd(q, k, v, q_seg, k_seg, offset, geo, backend):
  out, lse = _forward(q, k, v, q_seg, k_seg, None, offset, geo, backend)
  return (out, lse), (q, k, v, q_seg, k_seg, offset, out, lse)


def _flash_bwd(geo, backend, res, cotangents):
  q, k, v, q_seg, k_seg, offset, out, lse = res
  d_out, d_lse = cotangents
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True) - d_lse
  return (*_backward(q, k, v, q_seg, k_seg, lse, delta, d_out, offset, geo, backend), None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _reuse(q, k, lse, v, q_seg, k_seg, offset, geo, backend):
  return _forward(q, k, v, q_seg, k_seg, lse, offset, geo, backend)


def _reuse_fwd(q, k, lse, v, q_seg, k_seg, offset, geo, backend):
  out = _forward(q, k, v, q_seg, k_seg, lse, offset, geo, backend)
  return out, (q, k, lse, v, q_seg, k_seg, offset, out)


def _reuse_bwd(geo, backend, res, d_out):
  q, k, lse, v, q_seg, k_seg, offset, out = res
  rowsum = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
  dq, dk, dv = _backward(q, k, v, q_seg, k_seg, lse, jnp.zeros_like(rowsum), d_out, offset, geo, backend)
  return dq, dk, -rowsum, dv, None, None, None


_reuse.defvjp(_reuse_fwd, _reuse_bwd)


def _to_kernel_layout(x: jax.Array, length: int) -> jax.Array:
  """``[B, T, H, w]`` -> ``[B, H, length, w']``: heads-major, zero-padded to ``length`` and a power-of-two width."""
  x = x.transpose(0, 2, 1, 3)
  return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[2]), (0, tuning.pow2(x.shape[3]) - x.shape[3])))


def _segments(q_segment_ids, kv_segment_ids, geo: tuning.Geometry):
  q_seg = jnp.pad(q_segment_ids.astype(jnp.int32), ((0, 0), (0, geo.t_padded - geo.t)))[:, :, None]
  k_seg = jnp.pad(kv_segment_ids.astype(jnp.int32), ((0, 0), (0, geo.s_padded - geo.s)))[:, None, :]
  return q_seg, k_seg


def _offset_operand(q_offset) -> jax.Array | None:
  return None if q_offset is None else jnp.asarray(q_offset, jnp.int32).reshape(1)


def _check(q, k, v):
  if q.shape[2] % k.shape[2] or k.shape[2] != v.shape[2]:
    raise ValueError(f"flash attention needs K/V heads that divide the query heads: q {q.shape}, k {k.shape}, "
                     f"v {v.shape} ([B, T, heads, width])")


def _attention_geometry(q, k, v, causal, scale, window, backend, block_q, block_k, q_offset):
  """``(backend, geometry)`` of an :func:`attention` call and of its backward alone (checked shapes, default scale)."""
  _check(q, k, v)
  scale = q.shape[3] ** -0.5 if scale is None else scale
  backend = backend or tuning.default_backend()
  return backend, tuning.call_geometry(q.shape[1], k.shape[1], tuning.operands(q, k, v, q.dtype), causal, window,
                                       scale, backend, block_q, block_k, offset=q_offset is not None)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_segment_ids: jax.Array, kv_segment_ids: jax.Array,
              *, causal: bool = True, scale: float | None = None, window: int = 0, return_lse: bool = False,
              backend: str | None = None, block_q: int | None = None, block_k: int | None = None,
              q_offset: jax.Array | int | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Flash attention; same contract as :func:`jaxshare.kernels.reference.attention`.

  Args:
    q: ``[B, T, H, e]``; k: ``[B, S, G, e]``; v: ``[B, S, G, d]``, G dividing H (GQA/MQA by index map; K/V may be
      another layer's, and gradients reach it). fp32 or bf16; logits, softmax and accumulators are float32.
    q_segment_ids, kv_segment_ids: ``[B, T]`` / ``[B, S]`` int packed-document ids.
    causal, scale, window: as the reference. T and S need not be multiples of the blocks (padded and masked).
    return_lse: also return the ``[B, H, T]`` float32 log-sum-exp; its cotangent is honoured.
    backend: ``mosaic_tpu``, ``triton`` or ``interpret`` (Pallas interpret mode, any platform); None: the default
      device's (see :func:`default_backend`).
    block_q, block_k: tile sizes of both phases (upper bounds; shortened for short sequences); None: the backend's
      (:func:`default_block` for the backward, :func:`default_forward_blocks` for the forward).
    q_offset: the queries are tokens ``q_offset ..`` of the keys' sequence (an int32 scalar, traced: context
      parallelism's query chunks); None: 0, and the kernels take no offset operand.

  Returns:
    ``[B, T, H, d]`` in q's dtype (and the LSE).

  Raises:
    ValueError: K/V heads that do not divide the query heads, or K and V head counts that differ.
  """
  t = q.shape[1]
  backend, geo = _attention_geometry(q, k, v, causal, scale, window, backend, block_q, block_k, q_offset)
  out, lse = _flash(_to_kernel_layout(q, geo.t_padded), _to_kernel_layout(k, geo.s_padded),
                    _to_kernel_layout(v, geo.s_padded), *_segments(q_segment_ids, kv_segment_ids, geo),
                    _offset_operand(q_offset), geo, backend)
  out = out[:, :, :t, :v.shape[3]].transpose(0, 2, 1, 3)
  return (out, lse[:, :, :t, 0]) if return_lse else out


def attention_backward(q: jax.Array, k: jax.Array, v: jax.Array, q_segment_ids: jax.Array, kv_segment_ids: jax.Array,
                       lse: jax.Array, delta: jax.Array, d_out: jax.Array, *, causal: bool = True,
                       scale: float | None = None, window: int = 0, backend: str | None = None,
                       block_q: int | None = None, block_k: int | None = None,
                       q_offset: jax.Array | int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The backward kernels of :func:`attention` alone: ``(dQ, dK, dV)`` from the log-sum-exp ``lse [B, H, T]``,
  ``delta = rowsum(dO ∘ O) − dlse`` (``[B, H, T]`` float32) and ``d_out [B, T, H, d]``, without the forward pass: the
  contract of :func:`jaxshare.kernels.xla.attention_backward` (a block of a longer row's keys, ring attention;
  probability reuse with ``delta = 0``). Other arguments as :func:`attention`."""
  t = q.shape[1]
  backend, geo = _attention_geometry(q, k, v, causal, scale, window, backend, block_q, block_k, q_offset)
  rows = lambda x: jnp.pad(x.astype(jnp.float32), ((0, 0), (0, 0), (0, geo.t_padded - t)))[..., None]  # noqa: E731
  dq, dk, dv = _backward(_to_kernel_layout(q, geo.t_padded), _to_kernel_layout(k, geo.s_padded),
                         _to_kernel_layout(v, geo.s_padded), *_segments(q_segment_ids, kv_segment_ids, geo), rows(lse),
                         rows(delta), _to_kernel_layout(d_out.astype(q.dtype), geo.t_padded),
                         _offset_operand(q_offset), geo, backend)
  back = lambda x, n, w: x[:, :, :n, :w].transpose(0, 2, 1, 3)  # noqa: E731
  return back(dq, t, q.shape[3]), back(dk, k.shape[1], q.shape[3]), back(dv, k.shape[1], v.shape[3])


def attention_from_lse(q: jax.Array, k: jax.Array, lse: jax.Array, v: jax.Array, q_segment_ids: jax.Array,
                       kv_segment_ids: jax.Array, *, scale: float, causal: bool = True, window: int = 0,
                       backend: str | None = None, block_q: int | None = None, block_k: int | None = None,
                       q_offset: jax.Array | int | None = None) -> jax.Array:
  """Probability reuse as a kernel: ``exp(scale q kᵀ − lse) · v`` tile by tile, no softmax reduction; same contract
  as :func:`jaxshare.kernels.reference.attention_from_lse`.

  Args:
    q, k: the source layer's ``[B, T, H, e]`` / ``[B, S, Gk, e]``; lse: its ``[B, H, T]`` float32 log-sum-exp.
    v: the consumer's ``[B, S, Gv, d]`` values (Gk ≠ Gv are both repeated to their least common multiple).
    backend, block_q, block_k, q_offset: as :func:`attention`.

  Returns:
    ``[B, T, H, d]`` in v's dtype; gradients reach q, k, lse and v.
  """
  b, t, h, _ = q.shape
  heads = math.lcm(k.shape[2], v.shape[2])
  k, v = (x if x.shape[2] == heads else jnp.repeat(x, heads // x.shape[2], axis=2) for x in (k, v))
  _check(q, k, v)
  backend = backend or tuning.default_backend()
  geo = tuning.call_geometry(t, k.shape[1], tuning.operands(q, k, v, v.dtype), causal, window, scale, backend,
                             block_q, block_k, offset=q_offset is not None)
  lse = jnp.pad(lse.astype(jnp.float32), ((0, 0), (0, 0), (0, geo.t_padded - t)))[..., None]
  out = _reuse(_to_kernel_layout(q, geo.t_padded), _to_kernel_layout(k, geo.s_padded), lse,
               _to_kernel_layout(v, geo.s_padded), *_segments(q_segment_ids, kv_segment_ids, geo),
               _offset_operand(q_offset), geo, backend)
  return out[:, :, :t, :v.shape[3]].transpose(0, 2, 1, 3)
