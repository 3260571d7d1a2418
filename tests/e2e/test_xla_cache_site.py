"""The suite's XLA compilation cache (tests/xla_cache_site/sitecustomize.py), in this process and in the processes
tests start: it writes whole entries (without that, two processes compiling one program at once write one file
together), and it caches no executable of more than one device (read back, those aborted an 8-device run)."""

import os
import subprocess
import sys

import pytest
from jax._src import lru_cache

from conftest import REPO, XLA_CACHE, cpu_env


def test_this_process_and_its_children_use_whole_writes():
  assert lru_cache.LRUCache.put.__name__ == "put_whole"
  child = subprocess.run([sys.executable, "-c", "import jax._src.lru_cache as m; print(m.LRUCache.put.__name__)"],
                         cwd=REPO, env=cpu_env(1), capture_output=True, text=True, timeout=120)
  assert child.stdout.split() == ["put_whole"], child.stderr[-2000:]


@pytest.mark.skipif(not XLA_CACHE, reason="the cache is off: JAXSHARE_TEST_XLA_CACHE=off")
def test_the_suite_compiles_through_its_cache():
  import jax

  assert jax.config.jax_compilation_cache_dir == XLA_CACHE
  assert cpu_env(1)["JAX_COMPILATION_CACHE_DIR"] == XLA_CACHE


_COMPILE_ONE_AND_TWO_DEVICE_PROGRAMS = """
import jax, jax.numpy as jnp, numpy as np
def one_device(a):
  return a * 3.0 + 1.0
def two_devices(a):
  return jnp.sum(a * 5.0 - 2.0)
x = np.arange(8.0, dtype=np.float32)
jax.jit(one_device)(x).block_until_ready()
sharded = jax.device_put(x, jax.NamedSharding(jax.make_mesh((2,), ("data",)), jax.P("data")))
jax.jit(two_devices)(sharded).block_until_ready()
"""


def test_executables_of_one_device_are_cached_and_of_several_compiled_afresh(tmp_path):
  env = {**cpu_env(2), "JAX_COMPILATION_CACHE_DIR": str(tmp_path)}
  runs = []
  for _ in range(2):
    child = subprocess.run([sys.executable, "-c", _COMPILE_ONE_AND_TWO_DEVICE_PROGRAMS], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    runs.append(sorted(p.name.split("-")[0] for p in tmp_path.iterdir()))
  assert "jit_one_device" in runs[0] and "jit_two_devices" not in runs[0], runs[0]
  assert runs[1] == runs[0]  # the second run read the one-device program back and wrote nothing


def test_an_entry_appears_only_whole_and_the_first_stays(tmp_path, monkeypatch):
  cache = lru_cache.LRUCache(str(tmp_path), max_size=-1)
  value = os.urandom(1 << 20)
  seen = []
  replace = os.replace

  def spying_replace(src, dst):
    seen.append((os.path.exists(dst), open(src, "rb").read() == value))
    replace(src, dst)

  monkeypatch.setattr(os, "replace", spying_replace)
  cache.put("k", value)
  assert seen == [(False, True)]  # nothing under the entry's name until the whole value is written
  cache.put("k", b"another compile of the same program")
  assert cache.get("k") == value and len(seen) == 1
  assert [p.name for p in tmp_path.iterdir()] == ["k-cache"]


def test_a_failed_write_leaves_neither_an_entry_nor_a_temporary_file(tmp_path, monkeypatch):
  def full_disk(src, dst):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(os, "replace", full_disk)
  with pytest.raises(OSError, match="No space"):
    lru_cache.LRUCache(str(tmp_path), max_size=-1).put("k", b"value")
  assert list(tmp_path.iterdir()) == []
