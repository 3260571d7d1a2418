"""Local parallelism: the host's devices split into one group per concurrent run, and how a process is confined to
its group (CUDA_VISIBLE_DEVICES, libtpu's sub-slice variables, taskset)."""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import shutil
import subprocess

from jaxshare.sweep.spec import SweepError

# Chips of one process on a TPU host -> TPU_CHIPS_PER_PROCESS_BOUNDS: the sub-slices libtpu accepts on one host
# (v4: 2x2 chips, v5e/v6e: 2x4).
TPU_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}
TPU_BASE_PORT = 8476


def detect_platform() -> str:
  """gpu if nvidia-smi lists a GPU, tpu if the host has TPU device files, else cpu (JAX is not imported here: on a
  TPU host that would take the chips from the runs)."""
  if shutil.which("nvidia-smi"):
    with contextlib.suppress(OSError, subprocess.SubprocessError):
      out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
      if any(line.startswith("GPU ") for line in out.splitlines()):
        return "gpu"
  if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
    return "tpu"
  return "cpu"


def available_devices(platform: str) -> list[str]:
  """Device ids to split when --devices is not given: GPUs (CUDA_VISIBLE_DEVICES if set), TPU chips, CPU cores."""
  if platform == "gpu":
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
      return os.environ["CUDA_VISIBLE_DEVICES"].split(",")
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    return [str(i) for i, _ in enumerate(ln for ln in out.splitlines() if ln.startswith("GPU "))]
  if platform == "tpu":
    chips = glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")
    return [str(i) for i in range(len(chips))]
  return [str(c) for c in sorted(os.sched_getaffinity(0))]


@dataclasses.dataclass(frozen=True)
class DeviceGroup:
  """What one concurrent run sees: environment variables and a command prefix."""

  env: tuple[tuple[str, str], ...] = ()
  prefix: tuple[str, ...] = ()
  label: str = ""


def split_devices(devices: list[str], parallel: int, platform: str) -> list[list[str]]:
  """``devices`` in ``parallel`` contiguous groups: equal sizes on accelerators (runs stay comparable, and TPU
  sub-slices need fixed shapes), as even as possible on CPU cores.

  Raises:
    SweepError: fewer devices than groups, or accelerators that do not divide evenly.
  """
  if parallel < 1:
    raise SweepError(f"--parallel={parallel} is invalid: must be >= 1")
  if len(devices) < parallel:
    raise SweepError(f"--parallel={parallel} needs at least {parallel} devices; {platform} has {len(devices)} "
                     f"({','.join(devices)})")
  if platform != "cpu" and len(devices) % parallel:
    raise SweepError(f"--parallel={parallel} must divide the {len(devices)} {platform} devices "
                     f"({','.join(devices)}) into equal groups")
  size, extra = divmod(len(devices), parallel)
  groups, start = [], 0
  for i in range(parallel):
    end = start + size + (1 if i < extra else 0)
    groups.append(devices[start:end])
    start = end
  return groups


def group_env(platform: str, devices: list[str], index: int) -> DeviceGroup:
  """How a process is confined to ``devices``.

  gpu: CUDA_VISIBLE_DEVICES. tpu: libtpu's single-host sub-slice variables (TPU_VISIBLE_CHIPS and its older name
  TPU_VISIBLE_DEVICES, TPU_CHIPS_PER_PROCESS_BOUNDS for the group's shape, TPU_PROCESS_BOUNDS=1,1,1 for one process
  per slice, and a port of its own per group so that concurrent runtimes do not collide). cpu: ``taskset -c`` (XLA
  sizes its CPU thread pools by the cores a process may run on).

  Raises:
    SweepError: a TPU group of a size libtpu has no single-host shape for, or no taskset on CPU.
  """
  ids = ",".join(devices)
  if platform == "gpu":
    return DeviceGroup(env=(("CUDA_VISIBLE_DEVICES", ids),), label=f"GPU {ids}")
  if platform == "tpu":
    if len(devices) not in TPU_BOUNDS:
      raise SweepError(f"a TPU group of {len(devices)} chips is invalid: must be one of "
                       f"{', '.join(map(str, TPU_BOUNDS))} chips")
    port = str(TPU_BASE_PORT + index)
    env = (("TPU_VISIBLE_CHIPS", ids), ("TPU_VISIBLE_DEVICES", ids),
           ("TPU_CHIPS_PER_PROCESS_BOUNDS", TPU_BOUNDS[len(devices)]), ("TPU_PROCESS_BOUNDS", "1,1,1"),
           ("TPU_PROCESS_PORT", port), ("TPU_PROCESS_ADDRESSES", f"localhost:{port}"),
           ("TPU_MESH_CONTROLLER_ADDRESS", f"localhost:{port}"), ("TPU_MESH_CONTROLLER_PORT", port),
           ("CLOUD_TPU_TASK_ID", "0"))
    return DeviceGroup(env=env, label=f"TPU chips {ids}")
  if not shutil.which("taskset"):
    raise SweepError("confining CPU runs to cores needs taskset (util-linux); install it or leave out --devices")
  return DeviceGroup(prefix=("taskset", "-c", ids), label=f"cores {ids}")


def device_groups(parallel: int, devices: str | None, platform: str) -> list[DeviceGroup]:
  """One group per concurrent run. With one run at a time and no --devices, runs see everything (no variables)."""
  if platform == "auto":
    platform = detect_platform()
  if parallel == 1 and not devices:
    return [DeviceGroup()]
  ids = [d.strip() for d in devices.split(",") if d.strip()] if devices else available_devices(platform)
  if platform == "cpu" and not devices and (len(ids) < parallel or not shutil.which("taskset")):
    return [DeviceGroup() for _ in range(parallel)]  # more runs than cores: N unconfined processes share them
  return [group_env(platform, g, i) for i, g in enumerate(split_devices(ids, parallel, platform))]
