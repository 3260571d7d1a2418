"""Multi-host runs on JAX's multi-controller runtime: every process runs the same program on its own devices, and
``jax.distributed.initialize`` joins them into one set of global devices.

:func:`initialize` starts the runtime from ``cfg.distributed``: JAX detects TPU VM pods (the TPU metadata server)
and Slurm job steps itself; other clusters (and processes on one machine, as the tests use) name a coordinator.
"""

from __future__ import annotations

import os

import jax

from jaxshare.config import ConfigError, DistributedConfig

# Environment that says this process is one of several: a Slurm job step's task count, and the TPU worker list GKE
# gives each pod of a multi-host TPU slice. A plain TPU VM's ssh session has neither (JAX asks the TPU metadata server
# instead, which distributed.initialize=on leaves to it).
_SLURM_TASKS = "SLURM_NTASKS"
_TPU_WORKERS = "TPU_WORKER_HOSTNAMES"


def cluster_detected(env: dict[str, str] | None = None) -> str | None:
  """The kind of multi-process cluster this process runs in (``"slurm"``, ``"gke_tpu"``), or None for one process."""
  env = os.environ if env is None else env
  if int(env.get(_SLURM_TASKS, "1") or "1") > 1 and "SLURM_STEP_ID" in env:
    return "slurm"
  if len([h for h in env.get(_TPU_WORKERS, "").split(",") if h]) > 1:
    return "gke_tpu"
  return None


def initialize(cfg: DistributedConfig) -> bool:
  """Start JAX's distributed runtime as ``cfg`` says (before any other JAX call); idempotent.

  Returns:
    Whether this process is part of a multi-process run.

  Raises:
    ConfigError: the runtime could not start (coordinator unreachable, processes missing after ``timeout_s``,
      no cluster detected with ``initialize=on``), naming the fields to check.
  """
  if jax.distributed.is_initialized():
    return jax.process_count() > 1
  explicit = bool(cfg.coordinator_address)
  if cfg.initialize == "off" or (cfg.initialize == "auto" and not explicit and cluster_detected() is None):
    return False
  kwargs = {"initialization_timeout": cfg.timeout_s}
  if explicit:
    kwargs.update(coordinator_address=cfg.coordinator_address, num_processes=cfg.num_processes,
                  process_id=cfg.process_id)
  if cfg.local_device_ids:
    kwargs["local_device_ids"] = [int(i) for i in cfg.local_device_ids]
  try:
    jax.distributed.initialize(**kwargs)
  except Exception as e:  # RuntimeError/ValueError/XlaRuntimeError, depending on what failed
    where = (f"coordinator {cfg.coordinator_address} with {cfg.num_processes} processes (this one "
             f"{cfg.process_id})" if explicit else f"auto-detected cluster ({cluster_detected() or 'none found'})")
    reason = str(e).splitlines()[0] if str(e) else type(e).__name__
    raise ConfigError(f"distributed.initialize={cfg.initialize}: the JAX distributed runtime did not start for the "
                      f"{where} within distributed.timeout_s={cfg.timeout_s}: {reason}. "
                      "Check distributed.coordinator_address (reachable from every process), num_processes and "
                      "process_id (one per process), or set distributed.initialize=off for one process.") from e
  return jax.process_count() > 1


def is_primary() -> bool:
  """Process 0: the one that writes logs, metrics, TensorBoard events and the run's config."""
  return jax.process_index() == 0


def to_host(tree):
  """``tree``'s arrays as NumPy on every process: ``jax.device_get`` where each array is fully addressable, else
  gathered from all processes (``process_allgather``; a parameter sharded over hosts)."""
  if all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(tree)):
    return jax.device_get(tree)
  from jax.experimental import multihost_utils

  return multihost_utils.process_allgather(tree, tiled=True)
