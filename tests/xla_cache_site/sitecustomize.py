"""Whole-entry writes for XLA's persistent compilation cache in the test suite's processes.

conftest puts this directory first on PYTHONPATH, so Python runs this file at start-up in every pytest worker and
every process a test starts. Without a size limit, jax's ``LRUCache.put`` (jax 0.10) opens the entry's file,
truncates it and writes it in place. Two processes compiling one program at once therefore write one file together,
and their bytes differ (the compile time is part of the entry, and the object code need not be identical). zstd
frames carry no checksum here, so a file mixed from two entries can decompress to a corrupt executable, and
deserialising one is a segfault, not an error. Here each entry is written to a temporary file and renamed into place:
a reader sees one writer's whole entry or none.

Executables of more than one device are compiled afresh, never read back: with them cached, an in-process run on the
8 fake devices after runs on device subsets aborted in XLA:CPU's collective rendezvous (see tests/conftest.py).

The patches land when jax imports ``jax._src.lru_cache`` and ``jax._src.compiler`` (an import hook), so a process
that never imports jax pays nothing.
"""

import importlib.abc
import importlib.machinery
import os
import sys

_MODULE = "jax._src.lru_cache"
_COMPILER = "jax._src.compiler"


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


def patch_compiler(module) -> None:
  """No cache key (compile, neither read nor write the cache) for an executable of more than one device."""
  original = module._get_cache_key
  if getattr(original, "__name__", "") == "single_device_cache_key":
    return

  def single_device_cache_key(options, backend, computation, devices, *args, **kwargs):
    if getattr(devices, "size", 1) > 1:
      return None
    return original(options, backend, computation, devices, *args, **kwargs)

  module._get_cache_key = single_device_cache_key


_PATCHES = {_MODULE: patch, _COMPILER: patch_compiler}


class _PatchOnImport(importlib.abc.MetaPathFinder):
  """Finds the patched jax modules as Python would, and patches each once it has run."""
  jaxshare_atomic_cache = True

  def find_spec(self, name, path, target=None):
    if name not in _PATCHES:
      return None
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    run = spec.loader.exec_module

    def exec_module(module):
      run(module)
      _PATCHES[name](module)

    spec.loader.exec_module = exec_module
    return spec


def install() -> None:
  """Patch the modules already loaded now, the others when they are imported. Idempotent."""
  for name, apply in _PATCHES.items():
    if name in sys.modules:
      apply(sys.modules[name])
  if not any(getattr(f, "jaxshare_atomic_cache", False) for f in sys.meta_path):
    sys.meta_path.insert(0, _PatchOnImport())


install()
