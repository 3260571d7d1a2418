"""The memory and cost report of one ahead-of-time compile (:func:`check`): the run's real train step compiled for a
named TPU topology or GPU cluster on this host (no accelerator), its HBM per chip against the chip's capacity, its
FLOPs and the bounds they set, printed by :func:`format_report`, and when it does not fit, what to change
(:func:`advice`).

**GPU.** XLA's GPU compiler reports a peak but refuses nothing for size, so a step fits a GPU when that peak is
within the memory jax's allocator takes (``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the device's, 0.75 by default: set it
as the training job will). Triton kernels are counted like Mosaic ones.

**HBM per chip** is the TPU compiler's own figure, ``memory_analysis().peak_memory_in_bytes``: the most bytes live at
once during the step (arguments, outputs and temporaries; the donated state's buffers, which the new state is written
into, counted once). The compiler refuses a program whose peak exceeds the HBM it may use (``RESOURCE_EXHAUSTED``: a
no-fit, reported with its figures), so a train step fits when it compiles. That usable HBM is asked of the compiler
itself (:func:`~jaxshare.aot.compile.usable_hbm`: v5e 15.75 GiB of 16, v5p 95.74 of the published 95, v6e 31.25 of
32, v4 30.75 of 32 with libtpu 0.0.42). The sum ``arguments + outputs - aliased + temporaries`` (MaxText's formula:
the aliased bytes, ``alias_size_in_bytes``, are the donated state, counted in both arguments and outputs, so
subtracted once) equals that peak on simple programs (checked: x * 2 with and without donation, a matmul chain) but
overstates a train step, whose ``temp_size_in_bytes`` exceeds what is live at the peak (a 2-layer step at batch 320
on v5e:2x2: temporaries 18.2 GiB, peak 14.8 GiB, and the compiler accepted it for 15.75 GiB). The sum is printed
beside as an upper bound, and used where jaxlib reports no peak. Generated code (tens of MB) is in neither.

**FLOPs.** XLA's ``cost_analysis()`` of a sharded program is per device (checked: a [4096, 1024] x [1024, 1024]
matmul sharded 4 ways reports a quarter of 2·M·N·K), but it counts a while loop's body once: an 8-layer step with
``model.scan_layers`` reported 9.4e10 FLOPs per chip, the same step unrolled 5.5e11. So the check counts the matmul
FLOPs of the traced step itself ("executed FLOPs": every ``dot_general``, times scan lengths, rematerialisation
included; global), and adds, when the step holds Pallas kernels (Mosaic custom calls, invisible to both counts), the
model's causal attention FLOPs, a lower estimate of the kernels' work (their backward recomputes QKᵀ).
``cost_analysis()`` is kept in the raw figures.

**MFU bound** = model FLOPs per step (:func:`jaxshare.accounting.train_flops_per_token` x tokens: 6N-style, causal
attention, recomputation not counted) / executed FLOPs. MFU is model FLOPs / (step time x chips x peak), and a step
takes at least executed FLOPs / (chips x peak) (every chip at its dense bf16 peak, the work split evenly: the
printed step-time bound), so MFU <= model / executed. It is what rematerialisation and XLA attention's masked half
cost before any communication, memory-bound or idle time; a real step's MFU is lower.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import numpy as np

from jaxshare.aot import topology
from jaxshare.aot.collectives import KINDS, Traffic
from jaxshare.aot.compile import compile_traced, compiler_oom, trace_train_step, usable_hbm
from jaxshare.aot.units import GIB, gib
from jaxshare.config import Config, ConfigError



@dataclasses.dataclass(frozen=True)
class Fit:
  """One compile of the train step for a topology. Bytes are per chip, FLOPs per step over all chips.

  Attributes:
    topology, device_kind: what was compiled for (``v5e:16x16``, ``TPU v5 lite``). chips: devices in the mesh.
    slices: TPU slices. mesh: mesh axis sizes. batch, seq_len: global batch (sequences) and tokens per sequence.
    batch_unit: what the global batch must be a multiple of (batch shards x grad_accum_steps).
    capacity: the chip's published HBM (None: not in the table). state_bytes: the train state's shard (parameters
      and optimizer moments).
    hbm: bytes needed: the compiler's peak (or the sum where jaxlib has no peak; its figure when it refused; None if
      it gave none).
    usable: HBM the compiler may use (None: it would not say). memory: ``memory_analysis()`` fields (None: refused).
    compiler_error: the compiler's refusal ("" when compiled). model_flops, executed_flops: see the module doc.
    kernel_calls: Pallas kernel calls in the traced step. xla_flops_per_chip: raw ``cost_analysis()`` flops.
    peak_flops: the chip's dense bf16 peak FLOP/s (None: unknown). compile_s: seconds to trace and compile.
    usable_note: where ``usable`` comes from (the TPU compiler, or jax's share of a GPU).
    kernels: the compiled step's kernel calls by family (``splash x6, pallas decode x0``; "" when refused).
    traffic: the bytes the step's collectives move per chip (None when refused;
      :func:`jaxshare.aot.collectives.traffic`).
  """

  topology: str
  device_kind: str
  chips: int
  slices: int
  mesh: dict
  batch: int
  seq_len: int
  batch_unit: int
  capacity: int | None
  state_bytes: int
  hbm: int | None
  usable: int | None
  memory: dict | None
  compiler_error: str
  model_flops: float
  executed_flops: float
  kernel_calls: int
  xla_flops_per_chip: float | None
  peak_flops: float | None
  compile_s: float
  usable_note: str = "the compiler's limit"
  kernels: str = ""
  traffic: Traffic | None = None

  @property
  def limit(self) -> int:
    """Bytes per chip the step must fit in: the compiler's usable HBM, else the published capacity."""
    return self.usable or self.capacity

  @property
  def fits(self) -> bool:
    return not self.compiler_error and self.hbm is not None and self.hbm <= self.limit

  @property
  def mfu_bound(self) -> float:
    return self.model_flops / self.executed_flops if self.executed_flops else float("nan")

  @property
  def step_time_bound(self) -> float | None:
    """Seconds: executed FLOPs over every chip at peak."""
    return self.executed_flops / (self.chips * self.peak_flops) if self.peak_flops else None


def matmul_flops(jaxpr) -> tuple[float, int]:
  """``(FLOPs, pallas_calls)`` of a (closed) jaxpr: 2·M·N·K for every ``dot_general`` over the logical (global)
  shapes, scan bodies times their length, ``shard_map`` bodies (per-shard shapes) times their manual devices, the
  costliest ``cond`` branch, while bodies once; Pallas kernels are counted, not entered. A closed jaxpr (a whole
  traced step) is first cleared of dead code, as XLA clears it: a ``custom_vjp`` backward pass that recomputes its
  forward with ``jax.vjp`` (:func:`jaxshare.kernels.recompute.recomputed`) traces the forward's output too."""
  from jax._src.interpreters import partial_eval  # no public API clears a jaxpr's dead code (jax 0.10)
  from jax.extend.core import jaxprs_in_params

  if hasattr(jaxpr, "jaxpr"):
    jaxpr = partial_eval.dce_jaxpr(jaxpr.jaxpr, [True] * len(jaxpr.jaxpr.outvars))[0]
  flops, kernels = 0.0, 0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "dot_general":
      (contract, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      flops += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in contract)
      continue
    if name == "pallas_call":
      kernels += 1
      continue
    inner = [matmul_flops(j) for j in jaxprs_in_params(eqn.params)]
    if not inner:
      continue
    if name == "cond":
      f, k = max(inner)
    else:
      f, k = sum(i[0] for i in inner), sum(i[1] for i in inner)
    times = eqn.params.get("length", 1) if name == "scan" else 1
    if name == "shard_map":
      mesh = eqn.params["mesh"]
      manual = eqn.params.get("newly_manual_axes", eqn.params.get("manual_axes", mesh.axis_names))  # jax 0.10 / older
      times = math.prod(mesh.shape[a] for a in manual)
    flops += times * f
    kernels += k  # calls in the program, not executions
  return flops, kernels


def _state_bytes(state) -> int:
  """Bytes of one device's shard of an abstract state (logical shard shapes: before TPU tile padding)."""
  return sum(math.prod(s.sharding.shard_shape(s.shape)) * np.dtype(s.dtype).itemsize
             for s in jax.tree.leaves(state))


def _sum_bytes(memory: dict) -> int:
  """arguments + outputs - aliased (donated) + temporaries: see the module doc."""
  return (memory["argument_size_in_bytes"] + memory["output_size_in_bytes"] - memory.get("alias_size_in_bytes", 0)
          + memory["temp_size_in_bytes"])


def batch_unit(cfg: Config, mesh: jax.sharding.Mesh) -> int:
  """The global batch must be a multiple of this: the batch shards (mesh ``data`` x ``fsdp``, slices included) x
  ``train.grad_accum_steps`` (every micro-batch split evenly)."""
  return mesh.shape["data"] * mesh.shape["fsdp"] * cfg.train.grad_accum_steps


def _peak_flops(device_kind: str) -> float | None:
  from jaxshare.train.metrics import vendor_peak_tflops  # the table MFU uses in training

  tflops = vendor_peak_tflops(device_kind)
  return None if tflops is None else tflops * 1e12


def check(cfg: Config, target: str, num_slices: int | None = None) -> Fit:
  """Compile ``cfg``'s train step for ``target`` (a topology or an accelerator type, see
  :func:`jaxshare.aot.topology.topology_name`) and the config's mesh over its devices (``mesh.fsdp=-1`` fills).

  Raises:
    ConfigError: unknown topology, libtpu missing, the mesh does not fit the topology, or the batch is not a
      multiple of :func:`batch_unit`.
  """
  start = time.perf_counter()
  cfg = topology.with_slices(cfg, num_slices)
  name = topology.topology_name(target)
  mesh = topology.topology_mesh(name, cfg.mesh)
  unit = batch_unit(cfg, mesh)
  if cfg.train.batch_size % unit:
    raise ConfigError(f"train.batch_size={cfg.train.batch_size}: must be a multiple of {unit} on this mesh (batch "
                      f"shards data x fsdp = {mesh.shape['data'] * mesh.shape['fsdp']}, x train.grad_accum_steps "
                      f"{cfg.train.grad_accum_steps}), e.g. {max(unit, cfg.train.batch_size // unit * unit)}")
  device = mesh.devices.flat[0]
  kind = device.device_kind
  capacity, usable = topology.hbm_bytes(kind), usable_hbm(device)
  note = ("the compiler's limit" if device.platform == "tpu" else
          f"jax's share: XLA_PYTHON_CLIENT_MEM_FRACTION={topology.gpu_memory_fraction():g}")
  if capacity is None and usable is None:
    raise ConfigError(f"--topology {target!r}: the HBM of device kind {kind!r} is unknown (the compiler would not "
                      f"say; the table knows {', '.join(k for k, _ in topology.HBM_GIB)})")
  step = trace_train_step(cfg, mesh)
  tokens = cfg.train.batch_size * cfg.data.seq_len
  plan = step.setup.plan
  model_flops = plan.train_flops_per_token(cfg.data.seq_len) * tokens
  executed, kernels = matmul_flops(step.traced.jaxpr)
  if kernels:  # the kernels' attention, which no count sees: the model's causal attention matmuls, forward x 3
    ctx = (cfg.data.seq_len + 1) / 2
    executed += 3 * tokens * (plan.forward_flops_per_token(ctx) - plan.forward_flops_per_token(0))
  memory, error, xla_flops, kernel_families, moved = None, "", None, "", None
  try:
    compiled = compile_traced(step, f"train_step[{cfg.schedule.kind}]")
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    error = str(e).strip().splitlines()[0]
    hbm, said = compiler_oom(str(e))
    usable = said or usable
  else:
    memory, xla_flops, kernel_families, moved = (compiled.memory, compiled.flops, compiled.kernel_summary(),
                                                 compiled.traffic)
    hbm = memory.get("peak_memory_in_bytes") or _sum_bytes(memory)
  return Fit(name, kind, mesh.devices.size, cfg.mesh.num_slices, dict(mesh.shape), cfg.train.batch_size,
             cfg.data.seq_len, unit, capacity, _state_bytes(step.state), hbm, usable, memory, error, model_flops,
             executed, kernels, xla_flops, _peak_flops(kind), time.perf_counter() - start, note, kernel_families,
             moved)


def traffic_summary(traffic: Traffic) -> str:
  """``all-gather 31.82 GiB, reduce-scatter 15.96 GiB; attention K/V 42.00 GiB (87%)``: bytes moved per chip."""
  kinds = ", ".join(f"{kind} {gib(int(traffic.by_kind[kind]))}" for kind in KINDS if kind in traffic.by_kind) or "none"
  share = f" ({traffic.kv / traffic.total:.0%})" if traffic.total else ""
  return f"{kinds}; attention K/V {gib(int(traffic.kv))}{share}"


def _capacity(fit: Fit) -> str:
  if fit.usable is None:
    return f"{gib(fit.capacity)} HBM"
  published = f"; {fit.capacity / GIB:.4g} GiB HBM" if fit.capacity else ""
  return f"{gib(fit.usable)} usable ({fit.usable_note}{published})"


def format_report(fit: Fit, target: str) -> str:
  """The fit report: topology and mesh, HBM per chip with its terms, FLOPs, the MFU and step-time bounds, verdict."""
  named = f" ({target})" if target != fit.topology else ""
  slices = f", {fit.slices} slices" if fit.slices > 1 else ""
  lines = [f"AOT fit check: train step compiled for {fit.topology}{named}: {fit.chips} x {fit.device_kind}{slices} "
           f"in {fit.compile_s:.0f} s",
           f"  mesh {' '.join(f'{k}={v}' for k, v in fit.mesh.items())}; global batch {fit.batch} x {fit.seq_len} "
           f"tokens ({fit.batch // fit.batch_unit} per unit of {fit.batch_unit})"]
  m = fit.memory
  if m is not None:
    what = "compiler's peak" if m.get("peak_memory_in_bytes") else "arguments + outputs - aliased + temporaries"
    lines.append(f"  HBM per chip: {gib(fit.hbm)} ({what}) of {_capacity(fit)}: {fit.hbm / fit.limit:.1%}")
    lines.append(f"    upper bound: arguments {gib(m['argument_size_in_bytes'])} + outputs "
                 f"{gib(m['output_size_in_bytes'])} - aliased (donated state) {gib(m.get('alias_size_in_bytes', 0))}"
                 f" + temporaries {gib(m['temp_size_in_bytes'])} = {gib(_sum_bytes(m))}")
  else:
    lines.append(f"  HBM per chip: the compiler needs {gib(fit.hbm)} of {_capacity(fit)}: {fit.compiler_error}")
  padding = ", before TPU tile padding" if fit.device_kind.startswith("TPU") else ""
  if fit.kernels:
    lines.append(f"  attention kernels in the compiled step: {fit.kernels}")
  lines.append(f"  train state per chip: {gib(fit.state_bytes)} (parameters and optimizer moments{padding})")
  if fit.traffic is not None and fit.chips > 1:
    lines.append(f"  collectives per chip per step: {traffic_summary(fit.traffic)}")
  per_chip = fit.executed_flops / fit.chips
  kernels = f"; {fit.kernel_calls} Pallas kernel calls, counted as the model's attention" if fit.kernel_calls else ""
  lines.append(f"  FLOPs per step: model {fit.model_flops:.3e}, executed {fit.executed_flops:.3e} "
               f"({per_chip:.3e} per chip{kernels})")
  if fit.step_time_bound is not None:
    lines.append(f"  bounds: step time >= {fit.step_time_bound * 1e3:.1f} ms at {fit.peak_flops / 1e12:g} TFLOP/s "
                 f"per chip; MFU <= {fit.mfu_bound:.1%} (model / executed FLOPs)")
  else:
    lines.append(f"  bound: MFU <= {fit.mfu_bound:.1%} (model / executed FLOPs)")
  if fit.fits:
    lines.append(f"  fits: yes ({gib(fit.limit - fit.hbm)} free per chip)")
  else:
    lines.append("  fits: NO")
  return "\n".join(lines)


def advice(fit: Fit, cfg: Config) -> str:
  """Why ``fit`` does not fit and what to change, with numbers."""
  need = (f"needs {gib(fit.hbm)} per chip, {gib(fit.limit)} available" if fit.hbm is not None
          else "the compiler ran out of HBM")
  if fit.hbm is not None:
    need += f" (over by {gib(fit.hbm - fit.limit)})"
  t, shards = cfg.train, fit.mesh["data"] * fit.mesh["fsdp"]
  lines = [f"the train step does not fit in HBM on {fit.topology} ({fit.device_kind}): {need}. Change one of:"]
  # Linear estimates: the state and its gradients stay, the rest grows with the sequences per batch shard.
  fixed = 2 * fit.state_bytes
  per_row = (fit.hbm - fixed) / (fit.batch // shards) if fit.hbm is not None and fit.hbm > fixed else None
  if fit.batch > fit.batch_unit:
    guess = ""
    if per_row:
      rows = int((fit.limit - fixed) // per_row) * shards // fit.batch_unit * fit.batch_unit
      guess = f"; about {rows} would fit by linear scaling" if rows >= fit.batch_unit else ""
    lines.append(f"  - train.batch_size: lower it (now {fit.batch} = {fit.batch // fit.batch_unit} x "
                 f"{fit.batch_unit}{guess}); add --max-batch to find the largest that fits")
  if cfg.model.remat == "none":
    lines.append("  - model.remat=full (now none): keep only each superblock's input for the backward pass and "
                 "recompute the rest (about a third more FLOPs); or a named policy between the two (docs/scale-out.md, "
                 "\"Long context\")")
  logits = cfg.data.seq_len * cfg.model.vocab_size * 4 * (fit.batch // shards)  # float32 [B, T, V] per chip
  if t.num_vocab_tiling == 1 and logits >= GIB:
    lines.append(f"  - train.num_vocab_tiling=8 (now 1): the whole float32 logits take {gib(logits)} per chip, and "
                 "their gradient as much; over 8 vocabulary tiles an eighth of that at a time")
  if fit.batch == fit.batch_unit and fit.chips > 1 and cfg.mesh.context == 1:
    lines.append(f"  - mesh.context: split each sequence over the chips of a slice (e.g. mesh.context={fit.chips} "
                 "mesh.fsdp=1): activations per chip shrink by the axis size, K/V gathered once per producer layer")
  def splits(k: int) -> bool:  # k micro-batches, each a whole number of rows per batch shard
    return fit.batch % k == 0 and fit.batch // k % shards == 0

  k = 2 * t.grad_accum_steps  # doubled until the estimate fits
  while per_row and splits(2 * k) and fixed + per_row * fit.batch / k / shards > fit.limit:
    k *= 2
  if splits(k):
    guess = f", about {gib(int(fixed + per_row * fit.batch / k / shards))} per chip" if per_row else ""
    lines.append(f"  - train.grad_accum_steps={k} (now {t.grad_accum_steps}): the same global batch in "
                 f"micro-batches of {fit.batch // k}{guess}")
  if fit.mesh["data"] > 1:
    lines.append(f"  - mesh.fsdp: shard the state over the data axis too (mesh.data=1 mesh.fsdp=-1): its "
                 f"{gib(fit.state_bytes)} per chip becomes about {gib(fit.state_bytes // fit.mesh['data'])}")
  else:
    lines.append(f"  - mesh.fsdp: the state ({gib(fit.state_bytes)} per chip) is already sharded over all "
                 f"{fit.mesh['fsdp'] * fit.mesh['tensor']} chips of a slice; only a larger topology shards it further")
  return "\n".join(lines)
