"""Where jaxshare's Pallas kernels run and how they are launched: the platform and device being compiled for, the
Pallas backend that follows, tile sizes, Triton's warps and pipeline stages, and the on-chip memory limits tiles
are fitted to. Measured on the GPUs of docs/gpu.md (``scripts/tune_attention.py`` sweeps them); the kernels
themselves are in :mod:`jaxshare.kernels.flash` and :mod:`jaxshare.kernels.flash_decode`."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

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


VMEM_LIMIT = 64 * 2 ** 20  # on-chip memory a Mosaic kernel may use (v5e/v6e have 128 MiB per core, v5p 95 MiB)
TRITON_MAX_WIDTH = 256


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
  sm_90 and sm_100 by tests/integration/aot/test_aot.py): the tiles loaded once, plus ``stages`` pipelined copies of
  the tiles loaded in the loop. Forward: Q once, K and V per key block; dQ: Q and dO once, K and V per key block;
  dK/dV: K and V once, Q and dO per query block. (The forward at f32 width 256 with bf16 values, 128 x 64 tiles and 3
  stages: 376,832 estimated, 377,344 asked of an H100.)"""
  queries, keys = ops.e * ops.q, ops.e * ops.k + ops.d * ops.v
  if name == "jaxshare_flash_forward":
    return block_q * queries + stages * block_k * keys
  if name == "jaxshare_flash_dq":
    return block_q * (queries + ops.d * ops.o) + stages * block_k * keys
  if name == "jaxshare_flash_dkv":
    return block_k * keys + stages * block_q * (queries + ops.d * ops.o)
  raise ValueError(f"no shared-memory estimate for Triton kernel {name!r}")


def fit_stages(name: str, block_q: int, block_k: int, ops: Operands, limit: int) -> int:
  """The tuned pipeline depth of ``name``, lowered until its tiles fit in ``limit`` bytes (at least 1)."""
  stages = triton_launch(name, max(ops.e, ops.d), block_q)[1]
  while stages > 1 and triton_shared_memory(name, block_q, block_k, ops, stages) > limit:
    stages -= 1
  return stages


def fit_tiles(names: tuple[str, ...], block_q: int, block_k: int, ops: Operands, limit: int) -> tuple[int, int]:
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


def pallas_params(backend: str, name: str, width: int, block_q: int = 64) -> dict:
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
                                                   vmem_limit_bytes=VMEM_LIMIT), "name": name}
  raise ValueError(f"Pallas backend {backend!r} is invalid: must be one of {BACKENDS}")


def unsupported(q, k, v, *, backend: str) -> str | None:
  """Why the kernels cannot run ``q [B,T,H,e]``, ``k [B,S,Gk,e]``, ``v [B,S,Gv,d]`` (arrays or shape structs) on
  ``backend``, or None. Mosaic keeps whole key (forward, dQ) or query (dK/dV, all query heads of a K/V head)
  sequences in VMEM, double buffered. The estimate is conservative (the dK/dV kernel at T = 16k, 4 query heads per K/V
  head, width 128 bf16 is refused here yet compiles for v5e; at T = 64k with one it does not)."""
  e, d, s = pow2(q.shape[3]), pow2(v.shape[3]), k.shape[1]
  if backend == "triton" and max(e, d) > TRITON_MAX_WIDTH:
    return f"head width {max(q.shape[3], v.shape[3])} pads to {max(e, d)} > {TRITON_MAX_WIDTH} on Triton"
  if backend != "mosaic_tpu":
    return None
  geo = geometry(q.shape[1], s, causal=True, window=0, scale=1.0)
  item, heads = jnp.dtype(q.dtype).itemsize, q.shape[2] // math.gcd(k.shape[2], v.shape[2])
  column = 128 * 4  # a float32 or int32 [.., 1] column takes a 128-lane row per position; a [1, T] row 8 sublanes
  forward = geo.s_padded * ((e + d) * item + 8 * 4) + geo.block_q * ((e + 2 * d) * item + 3 * column)
  dkv = (heads * geo.t_padded * ((e + d) * item + 2 * 8 * 4) + geo.t_padded * 8 * 4
         + geo.block_k * (4 * (e + d) * item + column))
  need = 2 * max(forward, dkv)
  if need > VMEM_LIMIT:
    return (f"T={q.shape[1]}, S={s}, {heads} query heads per K/V head, widths {e}/{d} need ~{need / 2 ** 20:.0f} MiB "
            f"of VMEM > {VMEM_LIMIT // 2 ** 20} MiB")
  return None


def launch_params(backend: str, name: str, geo: Geometry, ops: Operands) -> dict:
  """:func:`pallas_params` of a flash kernel tiled by ``geo``; on Triton its pipeline as deep as the device's shared
  memory holds (:func:`fit_stages`)."""
  params = pallas_params(backend, name, max(ops.e, ops.d), geo.block_q)
  if backend == "triton" and name not in TRITON_LAUNCH:
    from jax.experimental.pallas import triton as pltriton
    stages = fit_stages(name, geo.block_q, geo.block_k, ops, shared_memory_limit(device_kind()))
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
  offset: bool = False  # the kernels take the queries' offset in the keys' sequence as their first operand

  @property
  def t_padded(self) -> int:
    return -(-self.t // self.pad_q) * self.pad_q

  @property
  def s_padded(self) -> int:
    return -(-self.s // self.pad_k) * self.pad_k

  def forward(self) -> Geometry:
    """The geometry the forward kernel tiles by (the same padded lengths)."""
    return dataclasses.replace(self, block_q=self.forward_block_q, block_k=self.forward_block_k)


def pow2(n: int, least: int = 16) -> int:
  return max(least, 1 << (n - 1).bit_length())


def geometry(t: int, s: int, *, causal: bool, window: int, scale: float, block_q: int = 128,
             block_k: int = 128, forward_blocks: tuple[int, int] | None = None) -> Geometry:
  """Blocks no longer than the (power-of-two-rounded) sequence, so a short sequence is one block. ``forward_blocks``:
  the forward's ``(block_q, block_k)`` when they differ from the backward's (powers of two, as the others)."""
  bq, bk = min(block_q, pow2(t)), min(block_k, pow2(s))
  fq, fk = (min(forward_blocks[0], pow2(t)), min(forward_blocks[1], pow2(s))) if forward_blocks else (bq, bk)
  return Geometry(t, s, bq, bk, causal, window, scale, fq, fk, max(bq, fq), max(bk, fk))


def operands(q, k, v, out_dtype) -> Operands:
  return Operands(pow2(q.shape[3]), pow2(v.shape[3]), *(jnp.dtype(x).itemsize for x in (q.dtype, k.dtype, v.dtype,
                                                                                          out_dtype)))


def call_geometry(t: int, s: int, ops: Operands, causal: bool, window: int, scale: float, backend: str,
                   block_q: int | None, block_k: int | None, offset: bool = False) -> Geometry:
  """Given tiles serve both phases; by default each phase takes its backend's own (:func:`default_forward_blocks`),
  on Triton shrunk where the device's shared memory cannot hold them (:func:`fit_tiles`). ``offset``: the kernels
  take the queries' offset in the keys' sequence (:attr:`Geometry.offset`)."""
  return dataclasses.replace(_call_geometry(t, s, ops, causal, window, scale, backend, block_q, block_k),
                             offset=offset)


def _call_geometry(t: int, s: int, ops: Operands, causal: bool, window: int, scale: float, backend: str,
                   block_q: int | None, block_k: int | None) -> Geometry:
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
    forward = fit_tiles(("jaxshare_flash_forward",), *forward, ops, limit)
    backward = fit_tiles(("jaxshare_flash_dq", "jaxshare_flash_dkv"), *backward, ops, limit)
  return geometry(t, s, causal=causal, window=window, scale=scale, block_q=backward[0], block_k=backward[1],
                  forward_blocks=forward)
