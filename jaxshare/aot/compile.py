"""Compiling without the hardware: the Pallas kernels and the run's train step compiled for a TPU topology's devices
(Mosaic) or a GPU cluster's (Triton; :mod:`jaxshare.aot.topology`) on a CPU host, and the memory a program may use
there (what the TPU compiler says, or jax's share of a GPU). ``scripts/aot_compile.py`` is the command line.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxshare import parallel
from jaxshare.aot.collectives import Traffic, traffic
from jaxshare.config import Config
from jaxshare.data.batch import Batch
from jaxshare.kernels import pallas

MOSAIC_CALL = "tpu_custom_call"
TRITON_CALL = "__gpu$xla.gpu.triton"
KERNEL_CALL = {"tpu": MOSAIC_CALL, "gpu": TRITON_CALL}  # a Pallas kernel's custom call in a compiled program, by platform
# Kernel operands by rank: segment ids [B, T], log-sum-exp [B, H, T], activations [B, T, heads, width].
_ACTIVATION_AXES = {2: ("activation_batch", None), 3: ("activation_batch", "activation_heads", None),
                    4: ("activation_batch", None, "activation_heads", None)}
# The decode program's operands: queries [B, 1, H, e], cache and new-row blocks [B, G, S, e], mask [B, 1, S + 1].
_DECODE_AXES = (_ACTIVATION_AXES[4], *[("activation_batch", "activation_kv_heads", None, None)] * 4,
                ("activation_batch", None, None))
DECODE_CACHE = 4096  # slots of the decode program's cache (8 key splits of 512)
_UNITS = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}  # XLA prints binary sizes
_NUM = r"([\d.]+)([KMGT]?)i?B?"
# The TPU compiler's refusals: "... HLO temporaries (26.96G) exceeds available HBM (15.75G)" and "Used 17.50G of
# 15.48G hbm"
_OOM = (re.compile(rf"\({_NUM}\) exceeds available HBM \({_NUM}\)"), re.compile(rf"Used {_NUM} of {_NUM} hbm"))


@dataclasses.dataclass(frozen=True)
class Compiled:
  """One program compiled (or lowered) for a target.

  Attributes:
    name: what was compiled. custom_calls: kernel custom calls in the program (:data:`KERNEL_CALL`). memory:
    ``memory_analysis()`` (bytes per device). flops: ``cost_analysis()`` FLOPs (None where XLA gives none: GPU).
    kernels: the custom calls by kernel family (:func:`kernel_families`). traffic: the bytes its collectives move
    per device (:func:`jaxshare.aot.collectives.traffic`).
  """

  name: str
  custom_calls: int
  memory: dict | None = None
  flops: float | None = None
  kernels: dict[str, int] = dataclasses.field(default_factory=dict)
  traffic: Traffic | None = None

  def kernel_summary(self) -> str:
    """``splash x6, pallas x3``: the kernel custom calls by family (:func:`kernel_families`)."""
    return ", ".join(f"{family} x{n}" for family, n in sorted(self.kernels.items())) or "none"


MEMORY_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
                 "generated_code_size_in_bytes", "peak_memory_in_bytes")


# A Pallas kernel call is named after its kernel: on TPU the instruction (``%splash_mha_dq_segmented_no_residuals.1 =
# ... custom-call``), on GPU its backend config (``jaxshare_flash_dq``); jaxshare's own kernels are
# ``jaxshare_flash_*``, the decode kernel has its function's name. cuDNN's attention calls target ``__cudnn$fmha*``.
_CALL = re.compile(r"%([A-Za-z_][\w.-]*?)(?:\.\d+)? = .*custom-call\(.*custom_call_target=\"([^\"]+)\"")
_FAMILIES = (("splash", "splash"), ("jaxshare_flash", "pallas"))
CUDNN_CALL = "__cudnn$fmha"


def kernel_families(text: str) -> dict[str, int]:
  """Attention kernel calls in a compiled program's ``text``, by family: ``splash`` (jax's splash attention),
  ``cudnn`` (cuDNN's fused attention, forward and backward), ``pallas`` (jaxshare's flash kernels), ``pallas
  decode`` (any other Pallas kernel: the decode kernel)."""
  counts: dict[str, int] = {}
  for line in text.splitlines():
    if not (m := _CALL.search(line)):
      continue
    name, target = m.groups()
    if target.startswith(CUDNN_CALL):
      family = "cudnn"
    elif target in (MOSAIC_CALL, TRITON_CALL):  # named by the instruction (Mosaic) or in its config (Triton)
      config = line[m.start(2):]
      family = next((f for prefix, f in _FAMILIES if name.startswith(prefix) or prefix in config), "pallas decode")
    else:
      continue
    counts[family] = counts.get(family, 0) + 1
  return counts


def summarize(name: str, compiled, text: str, marker: str) -> Compiled:
  """A :class:`Compiled` of ``compiled`` (a ``jax.stages.Compiled``), counting ``marker`` custom calls in ``text``."""
  mem = compiled.memory_analysis()
  # alias/peak are missing from older jaxlibs' stats
  memory = {f: getattr(mem, f) for f in MEMORY_FIELDS if hasattr(mem, f)} if mem is not None else None
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return Compiled(name, text.count(marker) if marker else 0, memory, (cost or {}).get("flops"), kernel_families(text),
                  traffic(text))


def kernel_programs(batch: int = 2, length: int = 512, heads: int = 8, kv_heads: int = 2, width: int = 128,
                    dtype=jnp.bfloat16, backend: str | None = None) -> dict[str, tuple[Callable, tuple]]:
  """Forward+backward programs of every kernel role: flash attention (GQA, causal, packed), a K/V consumer reading
  a producer's K/V, probability reuse, and LISA_plus's concatenated-feature attention (width not a power of two);
  and the decode step's attention (forward only: one new token per row against a cache of ``DECODE_CACHE`` slots).
  Each maps to ``(function, ShapeDtypeStructs, logical axes of each)``; the functions call
  :mod:`jaxshare.kernels.pallas` with ``backend`` (None: the platform being compiled for)."""
  attention = functools.partial(pallas.attention, backend=backend)
  q = jax.ShapeDtypeStruct((batch, length, heads, width), dtype)
  kv = jax.ShapeDtypeStruct((batch, length, kv_heads, width), dtype)
  seg = jax.ShapeDtypeStruct((batch, length), jnp.int32)
  lse = jax.ShapeDtypeStruct((batch, heads, length), jnp.float32)
  # LISA_plus: float32 features [q/sqrt(d), three rank-16 slots] (width + 48: padded to a power of two)
  features = jax.ShapeDtypeStruct((batch, length, heads, width + 3 * 16), jnp.float32)
  grad = functools.partial(jax.grad, argnums=(0, 1, 2))

  def flash_attention(q, k, v, seg):
    out, lse = attention(q, k, v, seg, seg, return_lse=True)
    return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)

  def kv_consumer(q, k, v, seg):  # CLA: two layers' queries on one producer's K/V
    return sum(jnp.sum(attention(x, k, v, seg, seg).astype(jnp.float32)) for x in (q, q * 2))

  def probability_reuse(q, k, lse, v, seg):
    return jnp.sum(pallas.attention_from_lse(q, k, lse, v, seg, seg, scale=width ** -0.5, backend=backend).astype(jnp.float32))

  def lisa_plus(qf, kf, v, seg):
    return jnp.sum(attention(qf, kf, v, seg, seg, scale=1.0).astype(jnp.float32))

  def decode(q, k_cache, k_new, v_cache, v_new, mask):
    return pallas.decode_attention(q, (k_cache, k_new), (v_cache, v_new), mask, scale=width ** -0.5, dtype=dtype,
                                   backend=backend)

  vh = jax.ShapeDtypeStruct((batch, length, heads, width), dtype)
  programs = {
    "flash_attention": (grad(flash_attention), (q, kv, kv, seg)),
    "kv_consumer": (grad(kv_consumer), (q, kv, kv, seg)),
    "probability_reuse": (jax.grad(probability_reuse, argnums=(0, 1, 2, 3)), (q, kv, lse, kv, seg)),
    "lisa_plus_features": (grad(lisa_plus), (features, features, vh, seg)),
  }
  programs = {name: (fn, args, [_ACTIVATION_AXES[a.ndim] for a in args]) for name, (fn, args) in programs.items()}
  cache = jax.ShapeDtypeStruct((batch, kv_heads, DECODE_CACHE, width), dtype)
  new = jax.ShapeDtypeStruct((batch, kv_heads, 1, width), dtype)
  programs["decode"] = (decode, (jax.ShapeDtypeStruct((batch, 1, heads, width), dtype), cache, new, cache, new,
                                 jax.ShapeDtypeStruct((batch, 1, DECODE_CACHE + 1), jnp.bool_)), _DECODE_AXES)
  return programs


def compile_kernels(mesh: jax.sharding.Mesh, **shapes) -> list[Compiled]:
  """Every kernel program compiled for the mesh's devices (TPU: Mosaic; GPU: Triton, tiles fitted to the GPU's
  shared memory), its batch split over ``data``/``fsdp`` and heads over ``tensor`` (by the logical rules, inside
  ``shard_map``). Raises the compiler's error (e.g. RESOURCE_EXHAUSTED: a kernel asks for more on-chip memory than
  the device has)."""
  out = []
  for name, (fn, args, axes) in kernel_programs(**shapes).items():
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(
      mesh, parallel.logical_to_spec(names, a.shape, mesh))) for a, names in zip(args, axes)]
    with jax.set_mesh(mesh):
      compiled = jax.jit(fn).trace(*args).lower().compile()
    out.append(summarize(name, compiled, compiled.as_text(), KERNEL_CALL[mesh.devices.flat[0].platform]))
  return out


@dataclasses.dataclass(frozen=True)
class TracedStep:
  """The run's train step traced for a mesh (nothing compiled). ``setup``: the run's ``TrainSetup``; ``state``: the
  abstract train state (ShapeDtypeStructs with shardings); ``traced``: a ``jax.stages.Traced`` (``.jaxpr``,
  ``.lower()``)."""

  setup: object
  state: object
  traced: object


def trace_train_step(cfg: Config, mesh: jax.sharding.Mesh) -> TracedStep:
  """The run's real train step (state and batch sharded as in training, state donated) traced for ``mesh`` with a
  global batch of ``train.batch_size`` x ``data.seq_len`` tokens."""
  from jaxshare.train.loop import jit_train_step
  from jaxshare.train.state import abstract_state, setup_training
  from jaxshare.train.step import Objective

  setup = setup_training(cfg, mesh=mesh)
  state = abstract_state(setup)
  batch = Batch.spec(cfg.train.batch_size, cfg.data.seq_len, setup.batch_sharding)
  with jax.set_mesh(mesh):
    objective = Objective(vocab_tiles=cfg.train.num_vocab_tiling)
    return TracedStep(setup, state, jit_train_step(setup, objective, None).trace(state, batch, None))


def compile_traced(step: TracedStep, name: str) -> Compiled:
  """Compile a traced train step for its mesh's devices (raises the compiler's error, e.g. RESOURCE_EXHAUSTED when
  it does not fit in TPU HBM)."""
  with jax.set_mesh(step.setup.mesh):
    compiled = step.traced.lower().compile()
  return summarize(name, compiled, compiled.as_text(), KERNEL_CALL.get(step.setup.mesh.devices.flat[0].platform, ""))


def compile_train_step(cfg: Config, mesh: jax.sharding.Mesh) -> Compiled:
  """The run's real train step (state and batch sharded as in training, state donated) compiled for ``mesh``."""
  return compile_traced(trace_train_step(cfg, mesh), f"train_step[{cfg.schedule.kind}]")


def compiler_oom(error: str) -> tuple[int | None, int | None]:
  """``(needed, usable)`` bytes from the TPU compiler's RESOURCE_EXHAUSTED message (None where it says neither)."""
  for pattern in _OOM:
    m = pattern.search(error)
    if m:
      return (round(float(m.group(1)) * _UNITS[m.group(2)]), round(float(m.group(3)) * _UNITS[m.group(4)]))
  return None, None


_usable: dict[str, int | None] = {}


def usable_hbm(device) -> int | None:
  """Bytes of HBM one program may use on ``device``'s kind (None if unknown). TPU: what the compiler lets it use,
  read from its refusal of a 512 GiB program (well under a second; once per device kind). GPU: jax's allocator's
  share of the device memory (:func:`~jaxshare.aot.topology.gpu_memory_fraction`; XLA's GPU compiler checks none)."""
  from jaxshare.aot import topology

  kind = device.device_kind
  if device.platform == "gpu":
    memory = topology.gpu_memory_bytes(kind)
    return None if memory is None else int(memory * topology.gpu_memory_fraction())
  if kind not in _usable:
    huge = jax.ShapeDtypeStruct((2 ** 39,), np.int8, sharding=jax.sharding.SingleDeviceSharding(device))
    try:
      jax.jit(lambda x: x + 1).lower(huge).compile()
      _usable[kind] = None
    except jax.errors.JaxRuntimeError as e:
      _usable[kind] = compiler_oom(str(e))[1]
  return _usable[kind]
