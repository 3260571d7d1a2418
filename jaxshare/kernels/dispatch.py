"""``attention.impl`` dispatch: picks the attention implementation for the platform."""

from __future__ import annotations

from typing import Callable

from jaxshare.kernels import reference

IMPLEMENTATIONS: dict[str, Callable] = {"xla": reference.attention}


def get_attention(impl: str) -> Callable:
  """The attention function for ``impl`` (``auto`` resolves to the best available; XLA until kernels land).

  Raises:
    ValueError: unknown implementation name.
  """
  if impl == "auto":
    return IMPLEMENTATIONS["xla"]
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f"attention.impl={impl!r} is invalid: must be auto or one of {sorted(IMPLEMENTATIONS)}")
  return IMPLEMENTATIONS[impl]
