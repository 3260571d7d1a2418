"""TPU and GPU topologies by name, their chips' HBM, their devices and meshes, and the host setup for compiling for
them without the hardware (``jax.experimental.topologies``: libtpu describes a TPU topology; jax's CUDA plugin, kept
in ``.jaxcuda/``, a GPU cluster from a target description in ``gpu_targets/``).

Imports no JAX at module level: :func:`use_host_compiler` must run before JAX is first imported, so the functions that
need JAX import it themselves.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from jaxshare.config import Config, ConfigError, MeshConfig

if TYPE_CHECKING:
  import jax

LIBTPU = Path(__file__).resolve().parents[2] / ".libtpu"  # where `make .libtpu/.installed` puts libtpu (Makefile)
# jax's CUDA plugin (jax-cuda12-plugin and -pjrt of the installed jax's version), kept out of the venv as libtpu is:
# installed there, every jax start would probe CUDA.
JAXCUDA = Path(__file__).resolve().parents[2] / ".jaxcuda"
GPU_TARGETS = Path(__file__).resolve().parent / "gpu_targets"
# GPU topology names: <gpu>:<gpus per node> or <gpu>:<nodes>x<gpus per node>, the GPU one of these target files.
GPUS = {"h100": "h100_sxm", "h200": "h200", "a100": "a100_sxm_80gb", "b200": "b200"}
_GPU_TOPOLOGY = re.compile(r"^([a-z]\d+):(?:(\d+)x)?(\d+)$")

# HBM per chip in GiB, by substring of jax's device_kind, most specific first ("TPU v5 lite" is v5e, "TPU v5" v5p,
# "TPU v6 lite" v6e); v4 and v5p chips are one megacore device each. Google Cloud's TPU version pages.
HBM_GIB = (("v6 lite", 32), ("v6e", 32), ("v5 lite", 16), ("v5e", 16), ("v5p", 95), ("v5", 95), ("v4", 32))

# Accelerator types: generation -> (topology prefix, TensorCores counted per chip in the type's number, mesh rank).
# v4-N and v5p-N count TensorCores (2 per chip, 3D torus); v5e-N (v5litepod-N) and v6e-N count chips (2D).
_ACCELERATORS = {"v4": ("v4", 2, 3), "v5p": ("v5p", 2, 3), "v5e": ("v5e", 1, 2), "v5litepod": ("v5e", 1, 2),
                 "v6e": ("v6e", 1, 2)}
_TOPOLOGY = re.compile(r"^v[0-9][a-z]*:\d+(x\d+)+$")
_ACCELERATOR = re.compile(r"^(v[0-9][a-z]*)-(\d+)$")


_host_compiler = False  # use_host_compiler() has run in this process


def use_host_compiler() -> None:
  """Make JAX compile on this host's CPU with libtpu and jax's CUDA plugin only describing TPU topologies and GPU
  clusters: ``JAX_PLATFORMS=cpu`` (forced: no accelerator is touched, even on a TPU VM or a GPU node), several
  processes may load libtpu, and ``.libtpu/`` and ``.jaxcuda/`` (kept outside the venv, see the Makefile) on
  ``sys.path``. Idempotent.

  Raises:
    ConfigError: JAX is already imported (its platform is then fixed), unless this ran before it was.
  """
  global _host_compiler
  if _host_compiler:
    return
  if "jax" in sys.modules:
    raise ConfigError("--compile-only: JAX was imported before the host compiler was set up; "
                      "call topology.use_host_compiler() first")
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # no TPU to guard: compiles may share libtpu
  for path in (LIBTPU, JAXCUDA):
    if path.is_dir() and str(path) not in sys.path:
      sys.path.insert(0, str(path))
  _host_compiler = True


def gpu_topology(target: str) -> tuple[str, int, int] | None:
  """``(gpu, nodes, gpus per node)`` of a GPU topology name (``h100:8`` one node of 8, ``h100:4x8`` four nodes of
  8), None for a name of another form (a TPU one).

  Raises:
    ConfigError: a GPU-form name of an unknown GPU, or zero nodes or GPUs.
  """
  m = _GPU_TOPOLOGY.match(target)
  if not m or m.group(1).startswith("v"):
    return None
  gpu, nodes, per_node = m.group(1), int(m.group(2) or 1), int(m.group(3))
  if gpu not in GPUS or nodes < 1 or per_node < 1:
    raise ConfigError(f"--topology {target!r}: a GPU topology is <gpu>:<gpus per node> or <gpu>:<nodes>x<gpus per "
                      f"node> with gpu one of {', '.join(GPUS)} and sizes >= 1 (e.g. h100:8, h100:4x8)")
  return gpu, nodes, per_node


def gpu_target_config(gpu: str) -> str:
  """The ``GpuTargetConfigProto`` text of a GPU in :data:`GPUS` (what jax's CUDA plugin compiles for)."""
  return (GPU_TARGETS / f"{GPUS[gpu]}.txtpb").read_text()


def gpu_memory_bytes(device_kind: str) -> int | None:
  """Device memory (bytes) of a GPU of jax ``device_kind`` described in :data:`GPU_TARGETS` (None: not there)."""
  for gpu in GPUS:
    text = gpu_target_config(gpu)
    if re.search(rf'device_description_str: "{re.escape(device_kind)}"', text):
      return int(re.search(r"device_memory_size: (\d+)", text).group(1))
  return None


def gpu_memory_fraction() -> float:
  """The share of a GPU's memory jax's allocator takes (``XLA_PYTHON_CLIENT_MEM_FRACTION``, jax's default 0.75):
  what one program may use, read from this process's environment, as training would.

  Raises:
    ConfigError: the variable is not a number in (0, 1].
  """
  text = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")
  try:
    fraction = float(text)
  except ValueError:
    fraction = float("nan")
  if not 0 < fraction <= 1:
    raise ConfigError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={text!r} is invalid: must be a number in (0, 1]")
  return fraction


def _torus(chips: int, rank: int) -> list[int]:
  """Google's slice shape for ``chips`` (a power of two): as square/cubic as possible, ascending, 1s last
  (16 -> 4x4, 128 -> 8x16; 4 -> 2x2x1, 16 -> 2x2x4, 64 -> 4x4x4)."""
  e = int(math.log2(chips))
  dims = sorted(2 ** (e // rank + (i >= rank - e % rank)) for i in range(rank))
  return [d for d in dims if d > 1] + [d for d in dims if d == 1]


def topology_name(target: str) -> str:
  """The topology name of ``target``: a TPU topology (``v5e:16x16``, ``v5p:4x4x4``) or GPU one (``h100:8``,
  ``h100:4x8``; see :func:`gpu_topology`), returned as is, or a TPU accelerator type (``v5e-256`` -> ``v5e:16x16``,
  ``v5p-128`` -> ``v5p:4x4x4``, ``v4-8`` -> ``v4:2x2x1``, ``v6e-64`` -> ``v6e:8x8``).

  Raises:
    ConfigError: no such form, an unknown generation or GPU, or a size that is not a power of two chips.
  """
  if gpu_topology(target) or _TOPOLOGY.match(target):
    return target
  m = _ACCELERATOR.match(target)
  if not m or m.group(1) not in _ACCELERATORS:
    raise ConfigError(f"--topology {target!r}: name a GPU topology ({', '.join(f'{g}:8' for g in GPUS)}; "
                      "<nodes>x<gpus> for several nodes, e.g. h100:4x8), a TPU topology (v5e:16x16, v5p:4x4x4) or "
                      "an accelerator type "
                      f"({', '.join(f'{g}-N' for g in _ACCELERATORS)}; N counts TensorCores on v4/v5p, chips on "
                      "v5e/v6e)")
  prefix, cores, rank = _ACCELERATORS[m.group(1)]
  n = int(m.group(2))
  chips = n // cores
  if n % cores or chips < 1 or chips & (chips - 1):
    what = "a power of two (chips)" if cores == 1 else f"{cores} x a power of two (TensorCores, {cores} per chip)"
    raise ConfigError(f"--topology {target!r}: {m.group(1)}-N needs N = {what}, e.g. {m.group(1)}-{cores * 8}; "
                      f"got N={n}")
  return f"{prefix}:{'x'.join(map(str, _torus(chips, rank)))}"


def hbm_bytes(device_kind: str) -> int | None:
  """HBM capacity of one chip (bytes) for a jax ``device_kind`` such as ``TPU v5 lite`` or ``NVIDIA H100 80GB
  HBM3``; None when unknown."""
  kind = device_kind.lower()
  return next((gib * 2 ** 30 for key, gib in HBM_GIB if key in kind), None) or gpu_memory_bytes(device_kind)


def topology_devices(topology: str, num_slices: int = 1) -> list:
  """The devices of ``num_slices`` slices of a TPU topology such as ``v5e:2x2`` or ``v5p:2x2x1`` (one per chip: v4
  and v5p chips are one megacore device, as on the TPU VM, each with its ``slice_index``), or of a GPU topology such
  as ``h100:4x8`` (one per GPU, nodes as process indices; one slice).

  Raises:
    ConfigError: libtpu or the CUDA plugin is missing, the topology name is unknown, or slices of a GPU topology.
  """
  from jax.experimental import topologies

  gpu = gpu_topology(topology)
  if gpu:
    if num_slices != 1:
      raise ConfigError(f"--topology {topology!r}: GPU clusters have no slices (mesh.dcn_* / --num-slices "
                        f"{num_slices}); name the nodes instead, e.g. {gpu[0]}:{num_slices}x{gpu[2]}")
    try:
      devices = list(topologies.get_topology_desc(platform="cuda", topology=f"1x{gpu[1]}x{gpu[2]}",
                                                  target_config=gpu_target_config(gpu[0])).devices)
    except Exception as e:  # the plugin missing or refusing the target: generic runtime errors
      raise ConfigError(f"--topology {topology!r}: cannot describe this GPU cluster ({e}); the CUDA plugin must be "
                        f"importable (make .jaxcuda/.installed puts it in {JAXCUDA})") from e
    _cudnn_compiles_for(devices[0])
    return devices
  # v4's default description has a device per TensorCore; JAX on a v4 VM drives each chip as one megacore device
  megacore = {"chip_config_name": "megacore"} if topology.startswith("v4:") else {}
  try:
    return list(topologies.get_topology_desc(topology_name=topology, platform="tpu", num_slices=num_slices,
                                             **megacore).devices)
  except Exception as e:  # libtpu missing or unknown name: both surface as generic runtime errors
    raise ConfigError(f"--topology {topology!r}: cannot describe this TPU topology ({e}); name one like v5e:2x2, "
                      "v5p:2x2x1 or v6e:2x2, with libtpu importable (make .libtpu/.installed)") from e


def _cudnn_compiles_for(device) -> None:
  """Make jax's cuDNN attention lower for ``device``, a compile-only GPU. Before lowering it asks the *local* GPU for
  its compute capability (packed documents and head widths above 128 need Hopper), and a host with none answers as an
  old GPU would, refusing what the target runs. jax has no public switch for this (0.10.2), so its two private
  checks are answered for the target: a compile here then holds what the real GPU compiles."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

  target = _capability(device.compute_capability)
  cudnn_attention.check_compute_capability = lambda c: target >= _capability(c)
  cudnn_attention.is_cuda_compute_capability_equal = lambda c: target == _capability(c)


def _capability(text: str) -> tuple[int, ...]:
  return tuple(int(x) for x in text.split("."))


def topology_mesh(topology: str, mesh_cfg: MeshConfig) -> jax.sharding.Mesh:
  """A ``(data, fsdp, context, tensor)`` mesh over the devices of a TPU topology such as ``v5e:2x2`` or ``v5p:2x2x1``
  (``mesh_cfg.num_slices`` slices of it).

  Raises:
    ConfigError: libtpu is missing or the topology name is unknown; the mesh does not fill the topology.
  """
  from jaxshare import parallel

  return parallel.make_mesh(mesh_cfg, topology_devices(topology, mesh_cfg.num_slices))


def with_slices(cfg: Config, num_slices: int | None) -> Config:
  """``cfg`` for ``num_slices`` TPU slices: the config's own ``mesh.dcn_*`` when None or equal; else, from a
  one-slice config, data parallel across the slices (``mesh.dcn_data = num_slices``).

  Raises:
    ConfigError: num_slices < 1, or it contradicts the config's dcn sizes.
  """
  if num_slices is None or num_slices == cfg.mesh.num_slices:
    return cfg
  if num_slices < 1 or cfg.mesh.num_slices != 1:
    raise ConfigError(f"--num-slices {num_slices}: must be >= 1 and match mesh.dcn_data x dcn_fsdp x dcn_context x "
                      f"dcn_tensor = "
                      f"{cfg.mesh.num_slices} (or leave the dcn_* sizes at 1: the slices then split the data axis)")
  return dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, dcn_data=num_slices))
