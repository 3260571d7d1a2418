"""Paths and files: a run's paths made absolute (local or ``gs://``), and writing a file whole or not at all, for
every file jaxshare rewrites in place (run configs, head-wise ties, data shards and manifests, a sweep's tables): a kill
mid-write, or a reader in another process or thread, never sees a torn one."""

from __future__ import annotations

import os
import threading

from etils import epath


def absolute(path: str | os.PathLike) -> epath.Path:
  """``path`` as an absolute ``epath.Path``: a local path resolved against the working directory, or a URL such as
  ``gs://bucket/run`` (run directories on a bucket: orbax, TensorStore and ``epath`` read and write them)."""
  p = epath.Path(path)
  return p if p.is_absolute() else p.absolute()


def write_atomic(path: epath.PathLike, data: bytes | memoryview | str) -> None:
  """Write ``data`` (``str``: as UTF-8) to ``path`` under a temporary name unique to this process and thread, then
  rename it over ``path``: a file that exists is whole, and concurrent writers leave one writer's whole file.

  Raises:
    OSError: the directory is missing or not writable (the temporary file is removed).
  """
  path = epath.Path(path)
  tmp = path.parent / f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"
  try:
    tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    tmp.replace(path)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise
