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

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxshare.kernels.reference import _MASK_VALUE

_NT = (((1,), (1,)), ((), ()))  # a @ bᵀ

BACKENDS = ("mosaic_tpu", "triton", "interpret")
_DEFAULT_BACKEND = {"tpu": "mosaic_tpu", "gpu": "triton"}


def _target_device():
  """The device being compiled for: the ambient mesh's (``jax.set_mesh``; a TPU topology mesh on a CPU host compiles
  for TPU), else the default device."""
  return jax.sharding.get_abstract_mesh().abstract_device or jax.devices()[0]


def platform() -> str:
  """The platform being compiled for (``tpu``, ``gpu``, ``cpu``; see :func:`_target_device`)."""
  return _target_device().platform


def device_kind() -> str:
  """The ``device_kind`` of the device being compiled for (``NVIDIA H100 80GB HBM3``; see :func:`_target_device`)."""
  return _target_device().device_kind


def default_backend() -> str:
  """The Pallas backend for :func:`platform`: Mosaic on TPU, Triton on GPU, interpret mode elsewhere."""
  return _DEFAULT_BACKEND.get(platform(), "interpret")


_VMEM_LIMIT = 64 * 2 ** 20  # on-chip memory a Mosaic kernel may use (v5e/v6e have 128 MiB per core, v5p 95 MiB)
_TRITON_MAX_WIDTH = 256


def unsupported(q, k, v, *, backend: str) -> str | None:
  """Why the kernels cannot run ``q [B,T,H,e]``, ``k [B,S,Gk,e]``, ``v [B,S,Gv,d]`` (arrays or shape structs) on
  ``backend``, or None. Mosaic keeps whole key (forward, dQ) or query (dK/dV, all query heads of a K/V head)
  sequences in VMEM, double buffered. The estimate is conservative (the dK/dV kernel at T = 16k, 4 query heads per K/V
  head, width 128 bf16 is refused here yet compiles for v5e; at T = 64k with one it does not)."""
  e, d, s = _pow2(q.shape[3]), _pow2(v.shape[3]), k.shape[1]
  if backend == "triton" and max(e, d) > _TRITON_MAX_WIDTH:
    return f"head width {max(q.shape[3], v.shape[3])} pads to {max(e, d)} > {_TRITON_MAX_WIDTH} on Triton"
  if backend != "mosaic_tpu":
    return None
  geo = geometry(q.shape[1], s, causal=True, window=0, scale=1.0)
  item, heads = jnp.dtype(q.dtype).itemsize, q.shape[2] // math.gcd(k.shape[2], v.shape[2])
  column = 128 * 4  # a float32 or int32 [.., 1] column takes a 128-lane row per position; a [1, T] row 8 sublanes
  forward = geo.s_padded * ((e + d) * item + 8 * 4) + geo.block_q * ((e + 2 * d) * item + 3 * column)
  dkv = (heads * geo.t_padded * ((e + d) * item + 2 * 8 * 4) + geo.t_padded * 8 * 4
         + geo.block_k * (4 * (e + d) * item + column))
  need = 2 * max(forward, dkv)
  if need > _VMEM_LIMIT:
    return (f"T={q.shape[1]}, S={s}, {heads} query heads per K/V head, widths {e}/{d} need ~{need / 2 ** 20:.0f} MiB "
            f"of VMEM > {_VMEM_LIMIT // 2 ** 20} MiB")
  return None


# Tile sizes per backend. On Triton 64 x 64 tiles beat 128 x 128 ones 1.4x (forward) to 4x (backward at width 128,
# whose 128-row accumulators spill registers) on an H200 (docs/gpu.md, scripts/tune_attention.py).
_BLOCK = {"triton": 64}
_DEFAULT_BLOCK = 128
# The forward's own tiles where they differ from the backward's: on an H100 the Triton forward above width 64 took
# 1.391 ms with 128 x 64 tiles and 8 warps against 1.668 ms with 64 x 64 and 4 (T = 4096, d = 128), while the
# backward with 128 x 64 tiles was 26% slower (docs/gpu.md, "Triton launch sweep on the H100").
_FORWARD_BLOCK_WIDE = {"triton": (128, 64)}
_WIDE = 64
# Overrides of :func:`triton_launch`, {kernel name: (num_warps, num_stages)}, for scripts/tune_attention.py.
TRITON_LAUNCH: dict[str, tuple[int, int]] = {}
# Shared memory one Triton block may use (the opt-in limit, bytes) by device-kind substring: sm_80 (A100, A800, A30)
# 163 KiB, sm_90 and sm_100 (H100, H200, H800, B200, B300) 227 KiB; any other GPU (sm_86/89/120: RTX, A10, L4, L40)
# 99 KiB. A kernel asking for more is refused at compile time (RESOURCE_EXHAUSTED), so tiles are fitted to it.
_SHARED_MEMORY = (("A100", 166_912), ("A800", 166_912), ("A30", 166_912), ("H100", 232_448), ("H200", 232_448),
                  ("H800", 232_448), ("B200", 232_448), ("B300", 232_448))
_SHARED_MEMORY_DEFAULT = 101_376
# Blackwell (sm_100) above head width 128: its MMA accumulators live in tensor memory (512 columns), which 64-key
# tiles overflow at width 256 (the backward asked a B200 for 608), and its pipelines take more shared memory than
# the estimate below (262,976 bytes asked for bf16 width 256 where sm_90 compiled): tiles of at most 64 x 32 compile.
_BLACKWELL = ("B200", "B300")
_BLACKWELL_WIDE_TILES = (64, 32)


def default_block(backend: str) -> int:
  """The query and key tile length a backend's kernels use unless told otherwise (the backward's; see
  :func:`default_forward_blocks`)."""
  return _BLOCK.get(backend, _DEFAULT_BLOCK)


def default_forward_blocks(backend: str, width: int) -> tuple[int, int]:
  """``(block_q, block_k)`` of the forward kernel (attention and probability reuse) at padded head width ``width``
  unless told otherwise: on Triton above width 64, 128 x 64; elsewhere :func:`default_block`'s square tile."""
  if width > _WIDE and backend in _FORWARD_BLOCK_WIDE:
    return _FORWARD_BLOCK_WIDE[backend]
  return default_block(backend), default_block(backend)


def triton_launch(name: str, width: int, block_q: int = 64) -> tuple[int, int]:
  """``(num_warps, num_stages)`` of Triton kernel ``name`` at padded head width ``width`` and query tile ``block_q``,
  as tuned at T = 4096: the forward with 3 pipeline stages, and 8 warps for 128-row tiles above width 64 (H100; 4
  warps at 64 x 64, where 8 were 1.5-2.5x slower on an H200); the backward with 3 stages up to width 64 and 2 above
  (3 is 11% slower there); the decode kernel, not tuned yet, with 2."""
  if name in TRITON_LAUNCH:
    return TRITON_LAUNCH[name]
  if name == "jaxshare_flash_forward":
    return (8 if width > _WIDE and block_q >= 128 else 4), 3
  if name in ("jaxshare_flash_dq", "jaxshare_flash_dkv"):
    return 4, 3 if width <= _WIDE else 2
  return 4, 2


def shared_memory_limit(kind: str) -> int:
  """Bytes of shared memory a Triton block may use on a GPU of jax ``device_kind`` ``kind``."""
  return next((limit for key, limit in _SHARED_MEMORY if key in kind), _SHARED_MEMORY_DEFAULT)


@dataclasses.dataclass(frozen=True)
class Operands:
  """Padded widths and item sizes (bytes) of a call's operands: queries (and their gradient) ``e``/``q``, keys
  ``k``, values ``d``/``v``, output and its cotangent ``o``."""

  e: int
  d: int
  q: int
  k: int
  v: int
  o: int


def triton_shared_memory(name: str, block_q: int, block_k: int, ops: Operands, stages: int) -> int:
  """Bytes of shared memory Triton kernel ``name`` asks for (an estimate, checked against the compiler for sm_80,
  sm_90 and sm_100 by tests/test_aot.py): the tiles loaded once, plus ``stages`` pipelined copies of the tiles
  loaded in the loop. Forward: Q once, K and V per key block; dQ: Q and dO once, K and V per key block; dK/dV: K and
  V once, Q and dO per query block. (The forward at f32 width 256 with bf16 values, 128 x 64 tiles and 3 stages:
  376,832 estimated, 377,344 asked of an H100.)"""
  queries, keys = ops.e * ops.q, ops.e * ops.k + ops.d * ops.v
  if name == "jaxshare_flash_forward":
    return block_q * queries + stages * block_k * keys
  if name == "jaxshare_flash_dq":
    return block_q * (queries + ops.d * ops.o) + stages * block_k * keys
  if name == "jaxshare_flash_dkv":
    return block_k * keys + stages * block_q * (queries + ops.d * ops.o)
  raise ValueError(f"no shared-memory estimate for Triton kernel {name!r}")


def _fit_stages(name: str, block_q: int, block_k: int, ops: Operands, limit: int) -> int:
  """The tuned pipeline depth of ``name``, lowered until its tiles fit in ``limit`` bytes (at least 1)."""
  stages = triton_launch(name, max(ops.e, ops.d), block_q)[1]
  while stages > 1 and triton_shared_memory(name, block_q, block_k, ops, stages) > limit:
    stages -= 1
  return stages


def _fit_tiles(names: tuple[str, ...], block_q: int, block_k: int, ops: Operands, limit: int) -> tuple[int, int]:
  """``(block_q, block_k)`` halved (the larger first, at least 16: ``tl.dot``'s least) until every kernel in
  ``names`` fits in ``limit`` bytes with 2 pipeline stages (or its tuned depth, if less)."""
  def fits(bq, bk):
    return all(triton_shared_memory(n, bq, bk, ops, min(2, triton_launch(n, max(ops.e, ops.d), bq)[1])) <= limit
               for n in names)

  while not fits(block_q, block_k) and max(block_q, block_k) > 16:
    if block_q >= block_k:
      block_q //= 2
    else:
      block_k //= 2
  return block_q, block_k


def _platform(backend: str, name: str, width: int, block_q: int = 64) -> dict:
  """``pallas_call`` keywords (the name included) for kernel ``name`` at head width ``width`` and query tile
  ``block_q`` on a backend. Triton is named explicitly:
  jax's GPU default is Mosaic GPU, whose kernels keep whole K/V blocks in shared memory. Every grid axis of these
  kernels is independent (the sequential axis is the loop inside), so Mosaic may split all of them across
  TensorCores."""
  if backend == "interpret":
    return {"interpret": True, "name": name}
  if backend == "triton":
    from jax.experimental.pallas import triton as pltriton
    num_warps, num_stages = triton_launch(name, width, block_q)
    return {"compiler_params": pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages), "name": name}
  if backend == "mosaic_tpu":
    from jax.experimental.pallas import tpu as pltpu
    return {"compiler_params": pltpu.CompilerParams(dimension_semantics=("parallel",) * 3,
                                                   vmem_limit_bytes=_VMEM_LIMIT), "name": name}
  raise ValueError(f"Pallas backend {backend!r} is invalid: must be one of {BACKENDS}")


def _launch(backend: str, name: str, geo: Geometry, ops: Operands) -> dict:
  """:func:`_platform` of a flash kernel tiled by ``geo``; on Triton its pipeline as deep as the device's shared
  memory holds (:func:`_fit_stages`)."""
  params = _platform(backend, name, max(ops.e, ops.d), geo.block_q)
  if backend == "triton" and name not in TRITON_LAUNCH:
    from jax.experimental.pallas import triton as pltriton
    stages = _fit_stages(name, geo.block_q, geo.block_k, ops, shared_memory_limit(device_kind()))
    params["compiler_params"] = pltriton.CompilerParams(num_warps=params["compiler_params"].num_warps,
                                                        num_stages=stages)
  return params


@dataclasses.dataclass(frozen=True)
class Geometry:
  """Static shape facts of one call: real lengths ``t``/``s``, the backward's block sizes, the forward's
  (:meth:`forward`), mask kind, logit scale. Sequences are padded to a multiple of both phases' tiles."""

  t: int
  s: int
  block_q: int
  block_k: int
  causal: bool
  window: int
  scale: float
  forward_block_q: int
  forward_block_k: int
  pad_q: int  # the padding multiple of each axis: the larger of the two phases' tiles
  pad_k: int

  @property
  def t_padded(self) -> int:
    return -(-self.t // self.pad_q) * self.pad_q

  @property
  def s_padded(self) -> int:
    return -(-self.s // self.pad_k) * self.pad_k

  def forward(self) -> Geometry:
    """The geometry the forward kernel tiles by (the same padded lengths)."""
    return dataclasses.replace(self, block_q=self.forward_block_q, block_k=self.forward_block_k)


def _pow2(n: int, least: int = 16) -> int:
  return max(least, 1 << (n - 1).bit_length())


def geometry(t: int, s: int, *, causal: bool, window: int, scale: float, block_q: int = 128,
             block_k: int = 128, forward_blocks: tuple[int, int] | None = None) -> Geometry:
  """Blocks no longer than the (power-of-two-rounded) sequence, so a short sequence is one block. ``forward_blocks``:
  the forward's ``(block_q, block_k)`` when they differ from the backward's (powers of two, as the others)."""
  bq, bk = min(block_q, _pow2(t)), min(block_k, _pow2(s))
  fq, fk = (min(forward_blocks[0], _pow2(t)), min(forward_blocks[1], _pow2(s))) if forward_blocks else (bq, bk)
  return Geometry(t, s, bq, bk, causal, window, scale, fq, fk, max(bq, fq), max(bk, fk))


def _mask(geo: Geometry, q_start, k_start, q_seg: jax.Array, k_seg: jax.Array, transposed: bool = False
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


def _key_blocks(geo: Geometry, i):
  """Half-open range of key blocks that query block ``i`` can see (causal and window skip the rest)."""
  nk = geo.s_padded // geo.block_k
  lo, hi = 0, nk
  if geo.causal:
    hi = jnp.minimum(nk, lax.div((i + 1) * geo.block_q + geo.block_k - 1, geo.block_k))
  if geo.window:
    lo = lax.div(jnp.maximum(i * geo.block_q - geo.window + 1, 0), geo.block_k)
  return lo, hi


def _query_blocks(geo: Geometry, j):
  """Half-open range of query blocks that can see key block ``j``."""
  nq = geo.t_padded // geo.block_q
  lo, hi = 0, nq
  if geo.causal:
    lo = lax.div(j * geo.block_k, geo.block_q)
  if geo.window:
    hi = jnp.minimum(nq, lax.div((j + 1) * geo.block_k + geo.window - 2, geo.block_q) + 1)
  return lo, hi


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


def _probs(geo: Geometry, q, k, lse, mask):
  return jnp.where(mask, jnp.exp(_dot(q, k, _NT) * geo.scale - lse), 0.0)


def _forward_kernel(*refs, geo: Geometry, reuse: bool):
  if reuse:
    q_ref, k_ref, v_ref, q_seg_ref, k_seg_ref, lse_in_ref, o_ref = refs
  else:
    q_ref, k_ref, v_ref, q_seg_ref, k_seg_ref, o_ref, lse_ref = refs
  bq, bk = geo.block_q, geo.block_k
  i = pl.program_id(2)
  q, q_seg = q_ref[...], q_seg_ref[...]

  def tile(j):
    keys = _block_slice(j, geo.block_k, geo.s_padded)
    return k_ref[keys, :], v_ref[keys, :], _mask(geo, i * bq, j * bk, q_seg, k_seg_ref[:, keys])

  lo, hi = _key_blocks(geo, i)
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


def _dq_kernel(q_ref, k_ref, v_ref, q_seg_ref, k_seg_ref, lse_ref, delta_ref, do_ref, dq_ref, *, geo: Geometry):
  bq, bk = geo.block_q, geo.block_k
  i = pl.program_id(2)
  q, q_seg, lse, delta, do = q_ref[...], q_seg_ref[...], lse_ref[...], delta_ref[...], do_ref[...]

  def body(j, dq):
    keys = _block_slice(j, geo.block_k, geo.s_padded)
    k, v = k_ref[keys, :], v_ref[keys, :]
    p = _probs(geo, q, k, lse, _mask(geo, i * bq, j * bk, q_seg, k_seg_ref[:, keys]))
    ds = p * (_dot(do, v, _NT) - delta)
    return dq + _dot(ds.astype(k.dtype), k)

  lo, hi = _key_blocks(geo, i)
  dq = lax.fori_loop(lo, hi, body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (dq * geo.scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, q_seg_ref, k_seg_ref, lse_ref, delta_ref, do_ref, dk_ref, dv_ref, *,
                geo: Geometry):
  """Keys × queries orientation: ``Pᵀ = exp(s·K Qᵀ − lse)`` with the row statistics lane-dense (``[1, T]`` per
  head, 4 bytes a position in VMEM where a ``[T, 1]`` column takes a 128-lane row), and no tile transposes."""
  bk = geo.block_k
  j = pl.program_id(2)
  k, v, k_seg = k_ref[...], v_ref[...], k_seg_ref[...]
  lo, hi = _query_blocks(geo, j)

  def head(r, carry):
    def body(i, carry):
      dk, dv = carry
      rows = pl.ds(pl.multiple_of(i * geo.block_q, geo.block_q), geo.block_q)  # sublane offsets: any multiple of 8
      cols = _block_slice(i, geo.block_q, geo.t_padded)
      q, do = q_ref[r, rows, :], do_ref[r, rows, :]
      mask = _mask(geo, i * geo.block_q, j * bk, q_seg_ref[:, cols], k_seg, transposed=True)
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


def _specs(geo: Geometry, q, k, v):
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


def _forward(q, k, v, q_seg, k_seg, lse_in, geo: Geometry, backend: str):
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
    in_specs=[spec["q"], spec["k"], spec["v"], spec["q_seg"], spec["k_seg"]] + ([spec["row"]] if reuse else []),
    out_specs=out_specs, **_launch(backend, "jaxshare_flash_forward", geo, _operands(q, k, v, out_shape[0].dtype)),
  )(q, k, v, q_seg, k_seg, *([lse_in] if reuse else []))
  return outs[0] if reuse else (outs[0], outs[1])


def _backward(q, k, v, q_seg, k_seg, lse, delta, do, geo: Geometry, backend: str):
  """``(dQ, dK, dV)`` in the input dtypes; ``lse``/``delta [B, H, Tp, 1]`` float32; segment ids as the forward's."""
  b, h, tp, e = q.shape
  g, sp = k.shape[1], k.shape[2]
  r, bk = h // g, geo.block_k
  spec = _specs(geo, q, k, v)
  ops = _operands(q, k, v, do.dtype)
  dq = pl.pallas_call(
    functools.partial(_dq_kernel, geo=geo), out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
    grid=(b, h, tp // geo.block_q),
    in_specs=[spec["q"], spec["k"], spec["v"], spec["q_seg"], spec["k_seg"], spec["row"], spec["row"],
              spec["o"]],
    out_specs=spec["q"], **_launch(backend, "jaxshare_flash_dq", geo, ops),
  )(q, k, v, q_seg, k_seg, lse, delta, do)
  # The dK/dV grid (B, G, S/bk): a K/V head's block against the whole query sequence of its H/G query heads; row
  # statistics and query segment ids as lane-dense rows, key segment ids as a column.
  heads = lambda *tail: pl.BlockSpec((None, r, *tail), lambda b_, g_, j: (b_, g_, 0, 0))  # noqa: E731
  keys = lambda width: pl.BlockSpec((None, None, bk, width), lambda b_, g_, j: (b_, g_, j, 0))  # noqa: E731
  dk, dv = pl.pallas_call(
    functools.partial(_dkv_kernel, geo=geo),
    out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
    grid=(b, g, sp // bk),
    in_specs=[heads(tp, e), keys(e), keys(v.shape[3]), pl.BlockSpec((None, 1, tp), lambda b_, g_, j: (b_, 0, 0)),
              pl.BlockSpec((None, bk, 1), lambda b_, g_, j: (b_, j, 0)), heads(1, tp), heads(1, tp),
              heads(tp, v.shape[3])],
    out_specs=[keys(e), keys(v.shape[3])], **_launch(backend, "jaxshare_flash_dkv", geo, ops),
  )(q, k, v, q_seg.reshape(b, 1, tp), k_seg.reshape(b, sp, 1), lse.reshape(b, h, 1, tp),
    delta.reshape(b, h, 1, tp), do)
  return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _flash(q, k, v, q_seg, k_seg, geo, backend):
  return _forward(q, k, v, q_seg, k_seg, None, geo, backend)


def _flash_fwd(q, k, v, q_seg, k_seg, geo, backend):
  out, lse = _forward(q, k, v, q_seg, k_seg, None, geo, backend)
  return (out, lse), (q, k, v, q_seg, k_seg, out, lse)


def _flash_bwd(geo, backend, res, cotangents):
  q, k, v, q_seg, k_seg, out, lse = res
  d_out, d_lse = cotangents
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True) - d_lse
  return (*_backward(q, k, v, q_seg, k_seg, lse, delta, d_out, geo, backend), None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _reuse(q, k, lse, v, q_seg, k_seg, geo, backend):
  return _forward(q, k, v, q_seg, k_seg, lse, geo, backend)


def _reuse_fwd(q, k, lse, v, q_seg, k_seg, geo, backend):
  out = _forward(q, k, v, q_seg, k_seg, lse, geo, backend)
  return out, (q, k, lse, v, q_seg, k_seg, out)


def _reuse_bwd(geo, backend, res, d_out):
  q, k, lse, v, q_seg, k_seg, out = res
  rowsum = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
  dq, dk, dv = _backward(q, k, v, q_seg, k_seg, lse, jnp.zeros_like(rowsum), d_out, geo, backend)
  return dq, dk, -rowsum, dv, None, None


_reuse.defvjp(_reuse_fwd, _reuse_bwd)


def _to_kernel_layout(x: jax.Array, length: int) -> jax.Array:
  """``[B, T, H, w]`` -> ``[B, H, length, w']``: heads-major, zero-padded to ``length`` and a power-of-two width."""
  x = x.transpose(0, 2, 1, 3)
  return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[2]), (0, _pow2(x.shape[3]) - x.shape[3])))


def _segments(q_segment_ids, kv_segment_ids, geo: Geometry):
  q_seg = jnp.pad(q_segment_ids.astype(jnp.int32), ((0, 0), (0, geo.t_padded - geo.t)))[:, :, None]
  k_seg = jnp.pad(kv_segment_ids.astype(jnp.int32), ((0, 0), (0, geo.s_padded - geo.s)))[:, None, :]
  return q_seg, k_seg


def _check(q, k, v):
  if q.shape[2] % k.shape[2] or k.shape[2] != v.shape[2]:
    raise ValueError(f"flash attention needs K/V heads that divide the query heads: q {q.shape}, k {k.shape}, "
                     f"v {v.shape} ([B, T, heads, width])")


def _operands(q, k, v, out_dtype) -> Operands:
  return Operands(_pow2(q.shape[3]), _pow2(v.shape[3]), *(jnp.dtype(x).itemsize for x in (q.dtype, k.dtype, v.dtype,
                                                                                          out_dtype)))


def _call_geometry(t: int, s: int, ops: Operands, causal: bool, window: int, scale: float, backend: str,
                   block_q: int | None, block_k: int | None) -> Geometry:
  """Given tiles serve both phases; by default each phase takes its backend's own (:func:`default_forward_blocks`),
  on Triton shrunk where the device's shared memory cannot hold them (:func:`_fit_tiles`)."""
  if block_q or block_k:
    bq, bk = block_q or default_block(backend), block_k or default_block(backend)
    return geometry(t, s, causal=causal, window=window, scale=scale, block_q=bq, block_k=bk)
  backward = (default_block(backend),) * 2
  forward = default_forward_blocks(backend, max(ops.e, ops.d))
  if backend == "triton":
    kind = device_kind()
    limit = shared_memory_limit(kind)
    if max(ops.e, ops.d) > 128 and any(key in kind for key in _BLACKWELL):
      forward, backward = (tuple(map(min, tiles, _BLACKWELL_WIDE_TILES)) for tiles in (forward, backward))
    forward = _fit_tiles(("jaxshare_flash_forward",), *forward, ops, limit)
    backward = _fit_tiles(("jaxshare_flash_dq", "jaxshare_flash_dkv"), *backward, ops, limit)
  return geometry(t, s, causal=causal, window=window, scale=scale, block_q=backward[0], block_k=backward[1],
                  forward_blocks=forward)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_segment_ids: jax.Array, kv_segment_ids: jax.Array,
              *, causal: bool = True, scale: float | None = None, window: int = 0, return_lse: bool = False,
              backend: str | None = None, block_q: int | None = None, block_k: int | None = None
              ) -> jax.Array | tuple[jax.Array, jax.Array]:
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

  Returns:
    ``[B, T, H, d]`` in q's dtype (and the LSE).

  Raises:
    ValueError: K/V heads that do not divide the query heads, or K and V head counts that differ.
  """
  _check(q, k, v)
  b, t, h, e = q.shape
  scale = e ** -0.5 if scale is None else scale
  backend = backend or default_backend()
  geo = _call_geometry(t, k.shape[1], _operands(q, k, v, q.dtype), causal, window, scale, backend, block_q, block_k)
  out, lse = _flash(_to_kernel_layout(q, geo.t_padded), _to_kernel_layout(k, geo.s_padded),
                    _to_kernel_layout(v, geo.s_padded), *_segments(q_segment_ids, kv_segment_ids, geo), geo, backend)
  out = out[:, :, :t, :v.shape[3]].transpose(0, 2, 1, 3)
  return (out, lse[:, :, :t, 0]) if return_lse else out


def attention_from_lse(q: jax.Array, k: jax.Array, lse: jax.Array, v: jax.Array, q_segment_ids: jax.Array,
                       kv_segment_ids: jax.Array, *, scale: float, causal: bool = True, window: int = 0,
                       backend: str | None = None, block_q: int | None = None, block_k: int | None = None
                       ) -> jax.Array:
  """Probability reuse as a kernel: ``exp(scale q kᵀ − lse) · v`` tile by tile, no softmax reduction; same contract
  as :func:`jaxshare.kernels.reference.attention_from_lse`.

  Args:
    q, k: the source layer's ``[B, T, H, e]`` / ``[B, S, Gk, e]``; lse: its ``[B, H, T]`` float32 log-sum-exp.
    v: the consumer's ``[B, S, Gv, d]`` values (Gk ≠ Gv are both repeated to their least common multiple).
    backend, block_q, block_k: as :func:`attention`.

  Returns:
    ``[B, T, H, d]`` in v's dtype; gradients reach q, k, lse and v.
  """
  b, t, h, _ = q.shape
  heads = math.lcm(k.shape[2], v.shape[2])
  k, v = (x if x.shape[2] == heads else jnp.repeat(x, heads // x.shape[2], axis=2) for x in (k, v))
  _check(q, k, v)
  backend = backend or default_backend()
  geo = _call_geometry(t, k.shape[1], _operands(q, k, v, v.dtype), causal, window, scale, backend, block_q, block_k)
  lse = jnp.pad(lse.astype(jnp.float32), ((0, 0), (0, 0), (0, geo.t_padded - t)))[..., None]
  out = _reuse(_to_kernel_layout(q, geo.t_padded), _to_kernel_layout(k, geo.s_padded), lse,
               _to_kernel_layout(v, geo.s_padded), *_segments(q_segment_ids, kv_segment_ids, geo), geo, backend)
  return out[:, :, :t, :v.shape[3]].transpose(0, 2, 1, 3)
