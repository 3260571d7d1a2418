"""Paths and files: a run's paths made absolute (local or ``gs://``), a directory checked writable before any work
(a bucket that does not exist is refused at once), and writing a file whole or not at all, for every file jaxshare
rewrites in place (run configs, head-wise ties, data shards and manifests, a sweep's tables): a kill mid-write, or a
reader in another process or thread, never sees a torn one.

On a bucket (GCS) there is no atomic rename (gcsfs renames by copying, then deleting) and none is needed: an object
upload is atomic, readers see the old object or the new one, never part of one. Local files are written under a
temporary name and renamed."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from typing import Callable, TypeVar

from etils import epath

from jaxshare.exit_codes import InputError

T = TypeVar("T")


class StorageUnavailable(RuntimeError):
  """A bucket that stayed unreachable, or kept failing, for longer than a run's patience
  (``train.storage_patience_s``): the run stops with one line and, run again, resumes from its last committed
  checkpoint."""


def absolute(path: str | os.PathLike) -> epath.Path:
  """``path`` as an absolute ``epath.Path``: a local path resolved against the working directory, or a URL such as
  ``gs://bucket/run`` (run directories on a bucket: orbax, TensorStore and ``epath`` read and write them)."""
  p = epath.Path(path)
  return p if p.is_absolute() else p.absolute()


def is_remote(path: str | os.PathLike) -> bool:
  """Whether ``path`` is a URL (``gs://...``: an object store, no appends or atomic renames) rather than local."""
  return "://" in str(path)


def writable_dir(path: str | os.PathLike, field: str) -> epath.Path:
  """``path`` (absolute) once it is known that files can be written there: a bucket path is probed by writing and
  deleting one small object (a bucket that does not exist, or that these credentials cannot write, fails here, before
  any data is read or program compiled). A local directory is checked by its nearest existing ancestor's permissions;
  nothing is created.

  Args:
    field: the config field or flag that named ``path``, for the error.

  Raises:
    InputError: ``path`` cannot be written, naming ``field``, the path and the server's or system's reason.
  """
  directory = absolute(path)
  if is_remote(directory):
    probe = directory / f".jaxshare-write-probe.{os.getpid()}.{threading.get_ident()}"
    try:
      probe.write_bytes(b"")
      probe.unlink()
    except Exception as e:  # gcsfs raises FileNotFoundError (no bucket), HttpError or OSError (refused, unreachable)
      reason = "the bucket does not exist" if isinstance(e, FileNotFoundError) else f"{type(e).__name__}: {e}"
      raise InputError(f"{field}={path}: cannot write there ({reason}).") from None
    return directory
  existing = next(p for p in (directory, *directory.parents) if p.exists())
  if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
    raise InputError(f"{field}={path}: cannot write there ({existing} is not a writable directory).")
  return directory


def _transient_errors() -> tuple[type[BaseException], ...]:
  """What a bucket's clients raise once their own retries are spent on an outage: refused or reset connections and
  timeouts (``OSError``: aiohttp's, requests'), gcsfs's HTTP errors, google-cloud-storage's (TensorBoard events)."""
  errors: list[type[BaseException]] = [OSError]
  try:
    from gcsfs.retry import HttpError

    errors.append(HttpError)
  except ImportError:  # no gcsfs: no gs:// paths either
    pass
  try:
    from google.api_core import exceptions as google

    errors += [google.RetryError, google.ServerError, google.TooManyRequests]
  except ImportError:
    pass
  return tuple(errors)


def is_transient(e: BaseException | None) -> bool:
  """Whether ``e``, or an error it was raised from, is a bucket's transient error (:func:`_transient_errors`)."""
  transient = _transient_errors()
  while e is not None:
    if isinstance(e, transient):
      return True
    e = e.__cause__ or e.__context__
  return False


_quieted = False


def quiet_transient_tracebacks() -> None:
  """For the rest of the process, keep the tracebacks of a bucket's transient errors off the console: gcsfs logs one
  at each spent retry budget ("out of retries on exception"), orbax one per failed background commit and a line per
  failed read of a step's metadata (through absl), several screens for one outage. The same error is raised to the
  caller, which retries it (:func:`with_retries`) or stops the run with one line; records of other errors still show."""
  global _quieted
  if _quieted:
    return
  _quieted = True

  def keep(record: logging.LogRecord) -> bool:
    # orbax also logs some failed reads with the error as a format argument, not as exc_info (a step's metadata)
    args = record.args.values() if isinstance(record.args, dict) else record.args or ()
    errors = [record.exc_info[1] if record.exc_info else None] + [a for a in args if isinstance(a, BaseException)]
    return not any(is_transient(e) for e in errors)

  for name in ("gcsfs", "absl"):
    logging.getLogger(name).addFilter(keep)


def with_retries(path: epath.PathLike, write: Callable[[], T], what: str, patience_s: float) -> T:
  """``write()``, called again after a transient error (a refused or reset connection, a timeout, a server error:
  raised once the client's own few retries are spent) while ``path`` is on a bucket, waiting 1, 2, 4 ... 30 s between
  tries, for up to ``patience_s`` seconds in all, a try that has not returned by then counting as failed. A local
  path is never retried: a full or read-only disk does not heal by waiting.

  Args:
    what: what is written, for the error (e.g. ``"metrics.jsonl"``).

  Raises:
    StorageUnavailable: the bucket still failed after ``patience_s`` seconds (naming ``path`` and the last error).
    OSError: from a local ``path``.
  """
  if not is_remote(path):
    return write()
  quiet_transient_tracebacks()
  deadline, wait, transient = time.monotonic() + patience_s, 1.0, _transient_errors()
  while True:
    try:
      return by_deadline(deadline, write)
    except transient as e:
      if time.monotonic() + wait > deadline:
        raise StorageUnavailable(f"{what} could not be written to {path} for {patience_s:.0f} s "
                                 f"(train.storage_patience_s): {type(e).__name__}: {str(e)[:200]}") from None
      time.sleep(wait)
      wait = min(2 * wait, 30.0)


def by_deadline(deadline: float, write: Callable[[], T]) -> T:
  """``write()``, or TimeoutError once ``time.monotonic()`` passes ``deadline``, the write left running in the
  background: a client's own retries may outlast the patience many times (google-cloud-storage's, under
  TensorBoard's event writer, retry for 120 s), and a run stopping for the outage then exits without it."""
  done: list = []

  def attempt() -> None:
    try:
      done.append((True, write()))
    except BaseException as e:  # re-raised in the caller's thread
      done.append((False, e))

  worker = threading.Thread(target=attempt, name="jaxshare-bucket-write", daemon=True)
  worker.start()
  worker.join(max(deadline - time.monotonic(), 0.0))
  if not done:
    raise TimeoutError("no answer from the bucket")
  ok, value = done[0]
  if not ok:
    raise value
  return value


def move_tree(src: epath.Path, dst: epath.Path) -> None:
  """Move directory ``src`` to ``dst`` (whose parent may not exist yet): a rename locally; on a bucket, where a
  directory is only a prefix of object names, each object is copied on the server, then the originals are deleted
  (a kill mid-move leaves whole objects, some in both places)."""
  if not is_remote(src):
    dst.parent.mkdir(parents=True, exist_ok=True)
    src.rename(dst)
    return
  from etils.epath import backend

  fs = backend.fsspec_backend.fs(src)  # the gcsfs instance epath (and orbax, through epath) lists with
  fs.mv(str(src), str(dst), recursive=True)
  fs.invalidate_cache()  # its cached listings still hold src


def copy_files(src: epath.PathLike, dst: epath.PathLike, last: tuple[str, ...] = ()) -> int:
  """Copy the files directly in directory ``src`` into directory ``dst`` (either local or on a bucket), each streamed
  in 64 MiB reads, the names in ``last`` after the others (a reader that sees those sees the rest). Subdirectories
  are not copied (HF and tokenizer directories are flat). Returns the number of files copied."""
  files = sorted((f for f in epath.Path(src).iterdir() if f.is_file()), key=lambda f: (f.name in last, f.name))
  for f in files:
    with f.open("rb") as r, (epath.Path(dst) / f.name).open("wb") as w:
      shutil.copyfileobj(r, w, 64 << 20)
  return len(files)


def write_atomic(path: epath.PathLike, data: bytes | memoryview | str) -> None:
  """Write ``data`` (``str``: as UTF-8) to ``path`` whole or not at all: locally under a temporary name unique to this
  process and thread, then renamed over ``path``; on a bucket as one upload (atomic there). A file that exists is
  whole, and concurrent writers leave one writer's whole file.

  Raises:
    OSError: the directory is missing or not writable (the temporary file is removed).
  """
  path = epath.Path(path)
  payload = data.encode() if isinstance(data, str) else data
  if is_remote(path):
    path.write_bytes(payload)
    return
  tmp = path.parent / f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"
  try:
    tmp.write_bytes(payload)
    tmp.replace(path)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise
