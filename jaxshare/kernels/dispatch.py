"""``attention.impl`` dispatch: picks the attention implementation for the platform."""

from __future__ import annotations

from typing import Callable

from jaxshare.kernels import reference, xla

# xla: FlashAttention-style backward (O(T) residuals); reference: plain autodiff, the numerical source of truth.
IMPLEMENTATIONS: dict[str, Callable] = {"xla": xla.attention, "reference": reference.attention}


def get_attention(impl: str) -> Callable:
  """The attention function for ``impl`` (``auto`` resolves to the best available: ``xla`` until Pallas kernels land).

  Raises:
    ValueError: unknown implementation name.
  """
  if impl == "auto":
    return IMPLEMENTATIONS["xla"]
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f"attention.impl={impl!r} is invalid: must be auto or one of {sorted(IMPLEMENTATIONS)}")
  return IMPLEMENTATIONS[impl]
