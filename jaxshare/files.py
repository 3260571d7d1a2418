"""Writing a file whole or not at all, for every file jaxshare rewrites in place (run configs, head-wise ties, data
shards and manifests, a sweep's tables): a kill mid-write, or a reader in another process or thread, never sees a torn
one."""

from __future__ import annotations

import os
import threading

from etils import epath


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
