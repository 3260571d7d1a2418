"""Whole-entry writes for XLA's persistent compilation cache in the test suite's processes.

conftest puts this directory first on PYTHONPATH, so Python runs this file at start-up in every pytest worker and
every process a test starts. Without a size limit, jax's ``LRUCache.put`` (jax 0.10) opens the entry's file,
truncates it and writes it in place. Two processes compiling one program at once therefore write one file together,
and their bytes differ (the compile time is part of the entry, and the object code need not be identical). zstd
frames carry no checksum here, so a file mixed from two entries can decompress to a corrupt executable, and
deserialising one is a segfault, not an error. Here each entry is written to a temporary file and renamed into place:
a reader sees one writer's whole entry or none.

The patch lands when jax imports ``jax._src.lru_cache`` (an import hook), so a process that never imports jax pays
nothing.
"""

import importlib.abc
import importlib.machinery
import os
import sys

_MODULE = "jax._src.lru_cache"


def atomic_put(self, key: str, value: bytes) -> None:
  """``LRUCache.put`` for a cache without eviction, through :func:`jaxshare.files.write_atomic`. The first entry
  stays (as jax's own put keeps it). Raises ValueError for an empty key, as jax's does."""
  from jaxshare.files import write_atomic

  if not key:
    raise ValueError("key cannot be empty")
  path = os.path.join(str(self.path), f"{key}{sys.modules[_MODULE]._CACHE_SUFFIX}")
  if not os.path.exists(path):
    write_atomic(path, value)


def patch(module) -> None:
  """Use :func:`atomic_put` for caches without eviction (the suite's); a size-limited cache keeps jax's put, which
  writes under its file lock."""
  original = module.LRUCache.put
  if getattr(original, "__name__", "") == "put_whole":
    return

  def put_whole(self, key: str, value: bytes) -> None:
    (original if self.eviction_enabled else atomic_put)(self, key, value)

  module.LRUCache.put = put_whole


class _PatchOnImport(importlib.abc.MetaPathFinder):
  """Finds ``jax._src.lru_cache`` as Python would, and patches it once it has run."""
  jaxshare_atomic_cache = True

  def find_spec(self, name, path, target=None):
    if name != _MODULE:
      return None
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    run = spec.loader.exec_module

    def exec_module(module):
      run(module)
      patch(module)

    spec.loader.exec_module = exec_module
    return spec


def install() -> None:
  """Patch now if jax's cache module is loaded, else when it is imported. Idempotent."""
  if _MODULE in sys.modules:
    patch(sys.modules[_MODULE])
  elif not any(getattr(f, "jaxshare_atomic_cache", False) for f in sys.meta_path):
    sys.meta_path.insert(0, _PatchOnImport())


install()
