"""Host memory allocator settings for XLA's CPU runtime.

XLA's CPU executables allocate their temporaries and outputs with ``malloc`` on every call. glibc serves large
requests with fresh ``mmap`` s and hands freed memory back to the kernel, so each training step faults every page of
its working set in again: ~51,000 page faults and ~120 ms of kernel time per step at the default experiment (a
~370 ms step on 2 cores). The tunables below keep freed memory in the process and back the heap with transparent
huge pages; the default experiment then runs 1.13-1.17x faster (``scripts/bench_train.py --variant
env:JAXSHARE_ALLOCATOR=default`` races it against glibc's defaults). PyTorch's CPU allocator does not churn this
way; its step did not change under the same tunables.

glibc reads tunables only at process start, so :func:`reexec_with_tuned_allocator` restarts the entry point (same
interpreter, same arguments) with them set. Nothing happens when the process already has ``GLIBC_TUNABLES`` (the
user's choice wins), when ``JAXSHARE_ALLOCATOR=default``, off glibc/Linux, or when a GPU or TPU JAX plugin is
installed (the accelerator then holds the working set and the host allocator is not on the step's path).
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
from collections.abc import Mapping

# mmap_max=0: every request comes from the heap, never from a fresh mapping. trim_threshold (16 GiB): freed heap
# memory is kept, not returned. arena_max=1: XLA's thread-pool workers free what other threads allocated; one arena
# keeps those blocks reusable by every thread. hugetlb=1: madvise(MADV_HUGEPAGE) on the heap (glibc >= 2.35; older
# glibc ignores it), 2 MiB pages for the first touch and fewer TLB misses in the matmuls.
TUNABLES = ("glibc.malloc.mmap_max=0", "glibc.malloc.trim_threshold=17179869184", "glibc.malloc.arena_max=1",
            "glibc.malloc.hugetlb=1")
OPT_OUT_ENV = "JAXSHARE_ALLOCATOR"
_ACCELERATOR_PLUGINS = ("libtpu", "jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin")


def _accelerator_installed(environ: Mapping[str, str]) -> bool:
  if environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
    return False
  return any(importlib.util.find_spec(name) is not None for name in _ACCELERATOR_PLUGINS)


def tuned_environment(environ: Mapping[str, str], *, glibc_linux: bool, accelerator: bool) -> dict[str, str] | None:
  """The environment to restart with, or None when the current one should be kept.

  Args:
    environ: the current environment.
    glibc_linux: the process runs on Linux with glibc (the tunables mean nothing elsewhere).
    accelerator: JAX will run on a GPU or TPU.

  Raises:
    ValueError: ``JAXSHARE_ALLOCATOR`` is set to something other than ``tuned`` or ``default``.
  """
  choice = environ.get(OPT_OUT_ENV, "tuned")
  if choice not in ("tuned", "default"):
    raise ValueError(f"{OPT_OUT_ENV}={choice!r} is invalid: must be 'tuned' (glibc tunables for XLA's CPU "
                     f"runtime) or 'default' (glibc's own settings)")
  if choice == "default" or "GLIBC_TUNABLES" in environ or not glibc_linux or accelerator:
    return None
  return {**environ, "GLIBC_TUNABLES": ":".join(TUNABLES)}


def reexec_with_tuned_allocator() -> None:
  """Restart this process with :data:`TUNABLES` when :func:`tuned_environment` asks for it; return otherwise.

  Call it first thing in a script's ``__main__`` block (never from library code: it replaces the process).
  """
  env = tuned_environment(os.environ, glibc_linux=sys.platform == "linux" and platform.libc_ver()[0] == "glibc",
                          accelerator=_accelerator_installed(os.environ))
  if env is not None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
