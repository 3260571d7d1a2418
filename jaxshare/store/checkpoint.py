"""Orbax checkpoints holding the train state, the grain iterator state and run metadata together (or, for a
converted model, its parameters alone)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import time
import traceback
import warnings
from typing import Any, Callable, TypeVar

import grain
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath

from jaxshare.store import integrity
from jaxshare.exit_codes import InputError
from jaxshare.files import (StorageUnavailable, absolute, by_deadline, is_remote, is_transient, move_tree,
                            quiet_transient_tracebacks)

T = TypeVar("T")
log = logging.getLogger(__name__)
CHECKSUMS = "checksums"  # meta key: integrity.checksums of the saved arrays
TMP_MARKER = ".orbax-checkpoint-tmp"  # in the name of a step directory whose write did not finish


# Keys of the state tree renamed since checkpoints were first written, {old: new}: a checkpoint that stores a key under
# its old name is read under that name and handed on under today's (the stacks were "segments" before issue 47).
RENAMED_KEYS = {"segments": "stacks"}


def rename_keys(tree: Any, names: dict[str, str]) -> Any:
  """``tree`` with every dict key in ``names`` renamed, at any depth (the optimizer state's moments mirror the
  parameters' keys); lists, tuples and named tuples are rebuilt, leaves kept."""
  if isinstance(tree, dict):
    return {names.get(k, k): rename_keys(v, names) for k, v in tree.items()}
  if isinstance(tree, tuple) and hasattr(tree, "_fields"):
    return type(tree)(*(rename_keys(v, names) for v in tree))
  if isinstance(tree, (list, tuple)):
    return type(tree)(rename_keys(v, names) for v in tree)
  return tree


class CheckpointError(InputError, RuntimeError):
  """A checkpoint that is corrupt or does not match the run's config."""


class UnsharedReadError(CheckpointError):
  """A multi-process run's restore failed in this process, maybe not in the others: orbax's collective restore
  leaves no point at which they could agree to try an older checkpoint, so the run stops (train.py ends the process
  at once; JAX's coordination service then stops the others)."""


_noise_muted = False


_TENSORSTORE_STATUS = re.compile(r"^(OUT_OF_RANGE|NOT_FOUND|DATA_LOSS|FAILED_PRECONDITION|INVALID_ARGUMENT|UNKNOWN|"
                                 r"INTERNAL|UNAVAILABLE|PERMISSION_DENIED|ABORTED|CANCELLED): ")


def _mute_library_noise() -> None:
  """Before any read, for the rest of the process, keep a failed read's library noise off the console: orbax's reads
  run as asyncio tasks and gathers whose failures TensorStore reports again, with multi-kilobyte specs, through the
  ``asyncio`` logger ("Task exception was never retrieved", "_GatheringFuture exception was never retrieved") and as
  "Exception ignored" messages whenever the abandoned coroutines are collected: during the call (sometimes before its
  exception reaches the caller, so muting only once it has is too late) or at exit, and, for a read orbax created but
  never started, as a "coroutine ... was never awaited" RuntimeWarning. The CheckpointError raised to the caller
  already says what failed. Only reports raised from orbax's frames (or, for "Exception ignored", asyncio's)
  (or TensorStore's own futures, with no frame and its status as the message) are dropped, and a read that
  succeeds leaves none; anything else still shows."""
  global _noise_muted
  if _noise_muted:
    return
  _noise_muted = True
  previous = sys.unraisablehook

  def files(tb) -> list[str]:
    return [f.filename for f in traceback.extract_tb(tb)] if tb is not None else []

  def hook(unraisable) -> None:
    code = getattr(unraisable.object, "cr_code", None)
    where = files(unraisable.exc_traceback) + ([code.co_filename] if code is not None else [])
    if not any("/orbax/" in f or "/asyncio/" in f for f in where):
      previous(unraisable)

  def keep(record: logging.LogRecord) -> bool:
    abandoned = record.exc_info is not None and "exception was never retrieved" in record.getMessage()
    if not abandoned:
      return True
    where = files(record.exc_info[2])
    # TensorStore's own futures fail with its status and no Python frame
    tensorstore = not where and _TENSORSTORE_STATUS.match(str(record.exc_info[1]))
    return not (tensorstore or any("/orbax/" in f for f in where))

  # Python hands an unawaited coroutine to its warning as ``source``, which only the warnings module's message hook
  # sees (``warnings.showwarning`` does not; Python 3.11)
  show = warnings._showwarnmsg

  def show_unless_orbax(message: warnings.WarningMessage) -> None:
    code = getattr(message.source, "cr_code", None)
    if code is None or "/orbax/" not in code.co_filename:
      show(message)

  sys.unraisablehook = hook
  logging.getLogger("asyncio").addFilter(keep)
  warnings._showwarnmsg = show_unless_orbax


def _root_cause(e: BaseException) -> str:
  """The innermost exception's first line, without TensorStore's spec dumps, at most 300 characters."""
  while e.__cause__ is not None or e.__context__ is not None:
    e = e.__cause__ or e.__context__
  text = (str(e).splitlines() or [""])[0]
  text = re.sub(r"\s*\[tensorstore_spec=.*|\s*See full TensorStore details.*", "", text)
  return f"{type(e).__name__}: {text[:300]}"


def finished_steps(directory: str | os.PathLike) -> list[int]:
  """The steps of the finished checkpoints in ``directory``, ascending (an unfinished write is not one: see
  :func:`unfinished_writes`); ``[]`` when it does not exist. Creates nothing."""
  directory = absolute(directory)
  if not directory.is_dir():
    return []
  return sorted(int(p.name) for p in directory.iterdir()
                if p.name.isdigit() and p.is_dir() and ocp.path.step.is_path_finalized(p))


def unfinished_writes(directory: epath.Path) -> list[str]:
  """The names of the step directories in ``directory`` whose write did not finish, sorted. Locally orbax writes a
  step under a temporary name (:data:`TMP_MARKER`) and renames it when done; on a bucket, which has no atomic rename,
  it writes the step in place and adds a commit marker (``commit_success.txt``) last, so there an unfinished write is
  a step directory without one."""
  return sorted(ocp.path.step.tmp_checkpoints(directory)) if directory.exists() else []


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
  meta = {**meta, PARAMS_ONLY: True, CHECKSUMS: integrity.checksums(state)}
  manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta)),
               force=True)
  manager.wait_until_finished()
  manager.close()


class Checkpointer:
  """``CheckpointManager`` over ``<run_dir>/checkpoints`` with items ``state``, ``data`` and ``meta``.

  Every save records checksums of the state's arrays in ``meta`` (:mod:`jaxshare.store.integrity`) and every restore
  checks them. Only finished checkpoints are listed (:func:`unfinished_writes`, locally and on a bucket); what an
  interrupted write left behind is deleted on opening (``cleaned`` names it).
  """

  def __init__(self, directory: str | os.PathLike, keep: int):
    self.directory = absolute(directory)
    if is_remote(self.directory):
      quiet_transient_tracebacks()  # an outage is reported once, as StorageUnavailable
    self.cleaned = unfinished_writes(self.directory)
    self.keep = keep
    self.manager = self._open()

  def _open(self) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
      self.directory, item_names=("state", "data", "meta"),
      options=ocp.CheckpointManagerOptions(max_to_keep=self.keep, create=True, cleanup_tmp_directories=True))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state: Any, data_iter: grain.DatasetIterator | None, meta: dict) -> None:
    """Save asynchronously (call :meth:`wait` before exiting); ``meta`` gains the arrays' checksums.

    Raises:
      StorageUnavailable: on a bucket, this or the previous asynchronous save failed (TensorStore's and gcsfs's
        retries spent): the committed checkpoints are whole, and the run resumes from the newest.
    """
    meta = {**meta, CHECKSUMS: integrity.checksums(state)}
    items = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
    if data_iter is not None:
      items["data"] = grain.checkpoint.CheckpointSave(data_iter)
    with self._bucket_failures(f"checkpoint {step}"):
      self._forget_a_cut_write()
      self.manager.save(step, args=ocp.args.Composite(**items), force=True)

  def _forget_a_cut_write(self) -> None:
    """Wait for the save before; if a bucket outage made it fail (a short one may outlive an upload's session, which
    no retry then finds), log it and reopen the manager, which forgets the failure (orbax raises it at every wait
    until then) and deletes what the write left: this save writes a newer step instead. Other failures raise."""
    if not is_remote(self.directory):
      return
    try:
      self.manager.wait_until_finished()
    except Exception as e:
      if not is_transient(e):
        raise
      log.warning("the last checkpoint was not written (%s); the next one is", _root_cause(e))
      self.manager = self._open()

  @contextlib.contextmanager
  def _bucket_failures(self, what: str):
    """A write to a bucket that failed, raised as StorageUnavailable (one line: the cause without TensorStore's
    specs); local failures pass unchanged."""
    try:
      yield
    except Exception as e:
      if not is_remote(self.directory):
        raise
      raise StorageUnavailable(f"{what} (or the one before it) could not be written to {self.directory}: "
                               f"{_root_cause(e)}") from None

  def restore(self, step: int, abstract_state: Any, data_iter: grain.DatasetIterator | None) -> tuple[Any, dict]:
    """Restore ``(state, meta)`` at ``step`` into ``abstract_state``'s shapes, dtypes and shardings, verified
    against the checksums saved with it.

    Raises:
      CheckpointError: files missing, unreadable or changed since they were written, or shapes that do not match
        the configured model.
    """
    old = self._old_names(step)
    items = {"state": ocp.args.StandardRestore(rename_keys(abstract_state, old)), "meta": ocp.args.JsonRestore()}
    if data_iter is not None:
      items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
    _mute_library_noise()
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # orbax/tensorstore raise many types for bad files
      raise self._unreadable(step, e) from None
    self._verify(step, restored["state"], restored["meta"])  # under the names its checksums were saved with
    return rename_keys(restored["state"], RENAMED_KEYS), restored["meta"]

  def restore_params(self, step: int, abstract_params: Any, meta: dict | None = None) -> Any:
    """Restore only ``state["params"]`` at ``step`` (orbax partial restore: the optimizer state is never read, so
    loading a model for evaluation or conversion costs one copy of its weights), verified against its checksums.

    Args:
      meta: the checkpoint's :meth:`read_meta`, where the caller has read it already (it holds the checksums).

    Raises:
      CheckpointError: files missing, unreadable or changed since they were written, or shapes that do not match
        the configured model.
    """
    target = {"params": rename_keys(abstract_params, self._old_names(step))}
    args = ocp.args.PyTreeRestore(target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                  partial_restore=True)
    meta = self.read_meta(step) if meta is None else meta
    _mute_library_noise()
    try:  # a standalone reader: the manager's "state" item stays bound to StandardSave/Restore
      with ocp.PyTreeCheckpointer() as reader:
        params = reader.restore(self.directory / str(step) / "state", args=args)["params"]
    except Exception as e:  # orbax/tensorstore raise many types for bad files
      raise self._unreadable(step, e) from None
    self._verify(step, {"params": params}, meta)
    return rename_keys(params, RENAMED_KEYS)

  def _old_names(self, step: int) -> dict[str, str]:
    """``{new: old}`` for the :data:`RENAMED_KEYS` the checkpoint at ``step`` stores under their old names (none when
    its metadata cannot be read: the restore then reports why)."""
    try:  # the item's tree metadata alone (a manager opened on an existing directory has no handler to read it)
      params = ocp.PyTreeCheckpointHandler().metadata(self.directory / str(step) / "state").tree.get("params", {})
    except Exception:  # orbax raises many types for missing or bad metadata
      return {}
    return {new: old for old, new in RENAMED_KEYS.items() if old in params}

  def _verify(self, step: int, state: Any, meta: dict) -> None:
    if CHECKSUMS not in meta:  # written before checksums were recorded: nothing to check against
      return
    bad = integrity.mismatches(state, meta[CHECKSUMS])
    if bad:
      raise CheckpointError(
        f"checkpoint {self.directory / str(step)} is corrupt: {len(bad)} of {len(jax.tree.leaves(state))} arrays "
        f"differ from the checksums saved with them ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}); its "
        "files were changed after it was written.")

  def _unreadable(self, step: int, e: Exception) -> CheckpointError:
    message = (f"checkpoint {self.directory / str(step)} could not be read: it is corrupt (files missing or "
               f"truncated) or was written by a run with a different model/schedule ({_root_cause(e)}).")
    if jax.process_count() == 1:
      return CheckpointError(message)
    return UnsharedReadError(
      f"{message} In a multi-process run this process cannot skip it alone: move {self.directory / str(step)} to "
      f"{self.directory.parent / 'corrupt_checkpoints'}/ and re-run to resume from the previous checkpoint.")

  def read_meta(self, step: int) -> dict:
    """The ``meta`` item (step, recipe stage, checksums) of a checkpoint, without restoring arrays.

    Raises:
      CheckpointError: missing or unreadable.
    """
    _mute_library_noise()
    try:
      return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:
      raise CheckpointError(f"checkpoint {self.directory / str(step)} has no readable metadata ({_root_cause(e)}).",
                            ) from None

  def restore_newest_valid(self, restore: Callable[[int], T]) -> tuple[int, T, list[str]] | None:
    """``restore(step)`` from the newest finished checkpoint down until one succeeds.

    The newer checkpoints that failed (``restore`` raised CheckpointError) are moved out of the way, to
    ``<run_dir>/corrupt_checkpoints/<step>``: kept for inspection, and no longer in the way of the steps the run
    saves again. Every process of a multi-process run takes the same decision, except after a read that failed in
    some processes only (UnsharedReadError, raised).

    Returns:
      ``(step, restore's result, one paragraph per failed checkpoint saying where it went)``; None without
      checkpoints.

    Raises:
      CheckpointError: every checkpoint failed (a paragraph for each); nothing is moved, since that is more likely
        a different model than a run whose every checkpoint is corrupt.
      UnsharedReadError: see the class.
    """
    failures: list[tuple[int, str]] = []
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:  # every process reaches the same verdict: checksums are compared on replicated sums, metadata is shared
        result = restore(step)
      except UnsharedReadError:
        raise
      except CheckpointError as e:
        failures.append((step, str(e)))
        continue
      return step, result, [f"{error} It was moved to {self._quarantine(bad)}." for bad, error in failures]
    if failures:
      raise CheckpointError(" ".join(error for _, error in failures)
                            + f" No checkpoint in {self.directory} could be restored; nothing was moved.")
    return None

  def _quarantine(self, step: int) -> epath.Path:
    target = self.directory.parent / "corrupt_checkpoints" / str(step)
    n = 1
    while target.exists():
      target, n = self.directory.parent / "corrupt_checkpoints" / f"{step}-{n}", n + 1
    if jax.process_index() == 0:
      move_tree(self.directory / str(step), target)
    if jax.process_count() > 1:  # the others wait for the move before listing the steps again
      from jax.experimental import multihost_utils

      multihost_utils.sync_global_devices(f"jaxshare:quarantine:{step}")
    self.manager.reload()
    return target

  def wait(self, patience_s: float | None = None) -> bool:
    """Block until the asynchronous save in flight is committed, or for at most ``patience_s`` seconds: a write to
    a bucket that went down mid-write outlasts TensorStore's retries (over 10 minutes measured), and a run stopping
    for the outage need not wait for it (what it would have written is not committed; the committed checkpoints
    are whole).

    Returns:
      Whether no save is in flight any more (False: still writing after ``patience_s``; it goes on in the
      background).

    Raises:
      StorageUnavailable: see :meth:`save`.
    """
    with self._bucket_failures("the last checkpoint"):
      if patience_s is None:
        self.manager.wait_until_finished()
        return True
      try:
        by_deadline(time.monotonic() + patience_s, self.manager.wait_until_finished)
      except TimeoutError:
        return False
    return True

  def close(self) -> None:
    self.manager.close()
