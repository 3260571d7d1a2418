"""The allocator restart: who gets the tunables, and that they stop the page-fault churn they exist for."""

import platform
import subprocess
import sys

import pytest

from jaxshare import allocator

_GLIBC = sys.platform == "linux" and platform.libc_ver()[0] == "glibc"

_CHURN = """
import ctypes, os, resource
from jaxshare import allocator
allocator.reexec_with_tuned_allocator()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def churn():  # what an XLA step does with its temporaries: allocate, write, free
  p = libc.malloc(1 << 27)
  ctypes.memset(p, 1, 1 << 27)
  libc.free(p)
churn()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
  churn()
print(os.environ.get("GLIBC_TUNABLES", "-"), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_cpu_glibc_process_gets_the_tunables():
  env = allocator.tuned_environment({"PATH": "/bin"}, glibc_linux=True, accelerator=False)
  assert env == {"PATH": "/bin", "GLIBC_TUNABLES": ":".join(allocator.TUNABLES)}


@pytest.mark.parametrize("environ,glibc_linux,accelerator", [
  ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}, True, False),  # the user's own tunables win
  ({"JAXSHARE_ALLOCATOR": "default"}, True, False),
  ({}, False, False),  # macOS, musl
  ({}, True, True),  # a GPU/TPU holds the working set
])
def test_environment_is_kept(environ, glibc_linux, accelerator):
  assert allocator.tuned_environment(environ, glibc_linux=glibc_linux, accelerator=accelerator) is None


def test_bad_opt_out_value_names_the_variable():
  with pytest.raises(ValueError, match="JAXSHARE_ALLOCATOR='off'.*'tuned'.*'default'"):
    allocator.tuned_environment({"JAXSHARE_ALLOCATOR": "off"}, glibc_linux=True, accelerator=False)


@pytest.mark.skipif(not _GLIBC, reason="glibc tunables")
def test_restart_sets_the_tunables_and_freed_memory_is_reused(tmp_path):
  def run(extra_env):
    env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", **extra_env}
    out = subprocess.run([sys.executable, "-c", _CHURN], env=env, capture_output=True, text=True, check=True,
                         cwd=tmp_path).stdout.split()
    return out[0], int(out[1])

  tunables, tuned_faults = run({"PYTHONPATH": str(_repo())})
  assert tunables == ":".join(allocator.TUNABLES)
  _, default_faults = run({"PYTHONPATH": str(_repo()), "JAXSHARE_ALLOCATOR": "default"})
  # glibc's defaults map each 128 MiB buffer afresh: ~32k faults (4 KiB pages) per buffer; tuned, the heap keeps it
  assert default_faults > 5 * 20_000
  assert tuned_faults < default_faults / 20


def _repo():
  from pathlib import Path
  return Path(__file__).resolve().parents[2]
