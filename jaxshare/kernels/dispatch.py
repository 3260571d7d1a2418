"""``attention.impl`` dispatch: the attention computations of a layer, by implementation and platform."""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable

import jax

from jaxshare.config import ConfigError
from jaxshare.kernels import decode, flash, flash_decode, pallas, reference, xla

log = logging.getLogger(__name__)

IMPLEMENTATIONS = ("auto", "xla", "reference", "pallas", "pallas_interpret")


@dataclasses.dataclass(frozen=True)
class AttentionOps:
  """The attention computations a layer may run.

  Attributes:
    attention: softmax attention, the contract of :func:`jaxshare.kernels.reference.attention`.
    attention_from_lse: probability reuse, the contract of :func:`jaxshare.kernels.reference.attention_from_lse`.
    decode_attention: a decode step's attention over the cache and the new rows, the contract of
      :func:`jaxshare.kernels.decode.attention` (the Pallas decode kernel for decode steps under ``pallas*``, and
      under ``auto`` on GPU/TPU; a prefill runs in XLA).
  """

  attention: Callable
  attention_from_lse: Callable
  decode_attention: Callable = decode.attention


def _checkpointed_reuse(q, k, lse, v, q_segment_ids, kv_segment_ids, **kwargs):
  """XLA probability reuse under ``jax.checkpoint``: nothing ``[B, H, T, S]`` is kept for the backward pass."""
  return jax.checkpoint(lambda q, k, lse, v: reference.attention_from_lse(
    q, k, lse, v, q_segment_ids, kv_segment_ids, **kwargs))(q, k, lse, v)


_XLA = AttentionOps(xla.attention, _checkpointed_reuse)
_REFERENCE = AttentionOps(reference.attention, _checkpointed_reuse)
_warned: set[str] = set()
# Why a kernel cannot run a contract's arguments on a backend (None: it can).
_QKV = lambda args, backend: flash.unsupported(*args[:3], backend=backend)  # noqa: E731
_REUSE_QKV = lambda args, backend: flash.unsupported(args[0], args[1], args[3], backend=backend)  # noqa: E731
_DECODE_QKV = lambda args, backend: flash_decode.unsupported(args[0], args[1][0], args[2][0],  # noqa: E731
                                                             backend=backend)
_NO_ACCELERATOR = "no GPU or TPU"


def get_attention(impl: str) -> AttentionOps:
  """The attention computations for ``impl``.

  ``xla``: FlashAttention-style backward in XLA; ``reference``: plain autodiff (the numerical source of truth);
  ``pallas``: the fused kernels for the platform being compiled for (Mosaic on TPU, Triton on GPU; inside
  ``shard_map`` under a mesh); ``pallas_interpret``: the same kernels in Pallas interpret mode (any platform, for
  tests on CPU); ``auto``: ``pallas`` on GPU/TPU for the shapes it supports (else ``xla`` with one warning naming
  the reason), ``xla`` on CPU. The platform is resolved when the model is traced, so a TPU topology mesh on a CPU
  host compiles the Mosaic kernels.

  Raises:
    ValueError: unknown implementation name.
  """
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f"attention.impl={impl!r} is invalid: must be one of {list(IMPLEMENTATIONS)}")
  if impl == "xla":
    return _XLA
  if impl == "reference":
    return _REFERENCE
  if impl == "pallas_interpret":
    return AttentionOps(functools.partial(pallas.attention, backend="interpret"),
                        functools.partial(pallas.attention_from_lse, backend="interpret"),
                        functools.partial(pallas.decode_attention, backend="interpret"))
  if impl == "pallas":
    return AttentionOps(_require_accelerator(pallas.attention, _QKV),
                        _require_accelerator(pallas.attention_from_lse, _REUSE_QKV),
                        _require_accelerator(pallas.decode_attention, _DECODE_QKV))
  return AttentionOps(_auto(pallas.attention, xla.attention, _QKV),
                      _auto(pallas.attention_from_lse, _checkpointed_reuse, _REUSE_QKV),
                      _auto(pallas.decode_attention, decode.attention, _DECODE_QKV))


def _reason_not_to_run(args: tuple, check: Callable) -> str | None:
  """Why the kernels cannot run these arguments here: no accelerator, or what ``check`` (one of ``_QKV``,
  ``_REUSE_QKV``, ``_DECODE_QKV``) refuses."""
  backend = flash.default_backend()
  if backend == "interpret":
    return _NO_ACCELERATOR
  return check(args, backend)


def _require_accelerator(kernel: Callable, check: Callable) -> Callable:
  @functools.wraps(kernel)
  def call(*args, **kwargs):
    if reason := _reason_not_to_run(args, check):
      # a ConfigError (a ValueError): the config is valid, but not for this host or these shapes
      raise ConfigError(f"attention.impl=pallas cannot run here: {reason}. Use pallas_interpret to run the kernels "
                       "in interpret mode, or auto to fall back to xla")
    return kernel(*args, **kwargs)
  return call


def _auto(kernel: Callable, fallback: Callable, check: Callable) -> Callable:
  """``kernel`` on GPU/TPU for the shapes it supports; else ``fallback`` (one warning per reason on GPU/TPU)."""
  @functools.wraps(kernel)
  def call(*args, **kwargs):
    reason = _reason_not_to_run(args, check)
    if reason is None:
      return kernel(*args, **kwargs)
    if reason != _NO_ACCELERATOR and reason not in _warned:
      _warned.add(reason)
      log.warning("attention.impl=auto: Pallas kernel not used (%s); falling back to xla", reason)
    return fallback(*args, **kwargs)
  return call
