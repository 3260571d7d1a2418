"""Orbax checkpoints holding the train state, the grain iterator state and run metadata together (or, for a
converted model, its parameters alone)."""

from __future__ import annotations

import os
from typing import Any

import grain
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath


def absolute(path: str | os.PathLike) -> epath.Path:
  """``path`` as an absolute ``epath.Path``: a local path resolved against the working directory, or a URL such as
  ``gs://bucket/run`` (run directories on a bucket: orbax, TensorStore and ``epath`` read and write them)."""
  p = epath.Path(path)
  return p if p.is_absolute() else p.absolute()


class CheckpointError(RuntimeError):
  """A checkpoint that is corrupt or does not match the run's config."""


PARAMS_ONLY = "params_only"  # meta key of a checkpoint holding only the parameters (a converted model at step 0)


def save_params(directory: str | os.PathLike, step: int, params: Any, meta: dict) -> None:
  """Write a parameters-only checkpoint (``meta`` gains ``PARAMS_ONLY``) that :class:`Checkpointer` reads with
  :meth:`~Checkpointer.restore_params` and :meth:`~Checkpointer.read_meta`, holding little more than one copy of
  the model in memory: NumPy leaves become JAX arrays (on CPU these alias the NumPy buffers, e.g. disk-backed
  memory maps), written uncompressed with at most 1 GB in flight. Orbax's defaults (compression, 96 GB in flight)
  hold about two more copies while writing; that matters for converting a checkpoint near the machine's RAM."""
  handler = ocp.PyTreeCheckpointHandler(use_compression=False, save_concurrent_gb=1)
  manager = ocp.CheckpointManager(absolute(directory),
                                  item_handlers={"state": handler, "meta": ocp.JsonCheckpointHandler()},
                                  options=ocp.CheckpointManagerOptions(create=True))
  state = {"params": jax.tree.map(jnp.asarray, params)}
  manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state),
                                             meta=ocp.args.JsonSave({**meta, PARAMS_ONLY: True})), force=True)
  manager.wait_until_finished()
  manager.close()


class Checkpointer:
  """``CheckpointManager`` over ``<run_dir>/checkpoints`` with items ``state``, ``data`` and ``meta``."""

  def __init__(self, directory: str | os.PathLike, keep: int):
    self.directory = absolute(directory)
    self.manager = ocp.CheckpointManager(
      self.directory, item_names=("state", "data", "meta"),
      options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state: Any, data_iter: grain.DatasetIterator | None, meta: dict) -> None:
    """Save asynchronously (call :meth:`wait` before exiting)."""
    items = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
    if data_iter is not None:
      items["data"] = grain.checkpoint.CheckpointSave(data_iter)
    self.manager.save(step, args=ocp.args.Composite(**items), force=True)

  def restore(self, step: int, abstract_state: Any, data_iter: grain.DatasetIterator | None) -> tuple[Any, dict]:
    """Restore ``(state, meta)`` at ``step`` into ``abstract_state``'s shapes, dtypes and shardings.

    Raises:
      CheckpointError: files missing or corrupt, or shapes that do not match the configured model.
    """
    items = {"state": ocp.args.StandardRestore(abstract_state), "meta": ocp.args.JsonRestore()}
    if data_iter is not None:
      items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # orbax/tensorstore raise many types for bad files
      raise self._unreadable(step, e) from e
    return restored["state"], restored["meta"]

  def restore_params(self, step: int, abstract_params: Any) -> Any:
    """Restore only ``state["params"]`` at ``step`` (orbax partial restore: the optimizer state is never read, so
    loading a model for evaluation or conversion costs one copy of its weights).

    Raises:
      CheckpointError: files missing or corrupt, or shapes that do not match the configured model.
    """
    target = {"params": abstract_params}
    args = ocp.args.PyTreeRestore(target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                  partial_restore=True)
    try:  # a standalone reader: the manager's "state" item stays bound to StandardSave/Restore
      with ocp.PyTreeCheckpointer() as reader:
        return reader.restore(self.directory / str(step) / "state", args=args)["params"]
    except Exception as e:  # orbax/tensorstore raise many types for bad files
      raise self._unreadable(step, e) from e

  def _unreadable(self, step: int, e: Exception) -> CheckpointError:
    return CheckpointError(
      f"checkpoint {self.directory / str(step)} could not be restored: it is corrupt or was written by a run with "
      f"a different model/schedule ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")

  def read_meta(self, step: int) -> dict:
    """The ``meta`` item (step, recipe stage) of a checkpoint, without restoring arrays.

    Raises:
      CheckpointError: missing or unreadable.
    """
    try:
      return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:
      raise CheckpointError(f"checkpoint {self.directory / str(step)} has no readable metadata: {e}") from e

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()
