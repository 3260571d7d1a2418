"""Reading fields of an HF ``config.json`` across transformers versions (v5's ``rope_parameters`` and the older
``rope_theta`` / ``rope_scaling`` / ``rotary_pct`` keys that hub checkpoints still carry)."""

from __future__ import annotations

from typing import Any

from jaxshare.convert.mapping import UnsupportedModelError


def field(config: dict, name: str, default: Any = None, *, required: bool = False) -> Any:
  """``config[name]``; a missing required field is an :class:`UnsupportedModelError` naming it."""
  if name in config and config[name] is not None:
    return config[name]
  if required:
    raise UnsupportedModelError(f"config.json has no {name!r}, which jaxshare needs to build the model")
  return default


def rope(config: dict, *, theta_keys: tuple[str, ...] = ("rope_theta",),
         partial_keys: tuple[str, ...] = ()) -> tuple[float, str, float, dict]:
  """``(theta, rope_type, partial rotary factor, scaling parameters)`` from either config layout."""
  params = config.get("rope_parameters") or {}
  scaling = config.get("rope_scaling") or {}
  theta = params.get("rope_theta")
  for key in theta_keys:
    theta = theta if theta is not None else config.get(key)
  rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
  partial = params.get("partial_rotary_factor")
  for key in partial_keys:
    partial = partial if partial is not None else config.get(key)
  return float(theta if theta is not None else 10000.0), rope_type, float(1.0 if partial is None else partial), \
    {**scaling, **params}


def require(config: dict, name: str, value: Any, allowed: tuple, why: str) -> None:
  """Refuse a config value jaxshare cannot represent exactly, naming field, value and what is supported."""
  if value not in allowed:
    raise UnsupportedModelError(f"config.json {name}={value!r} is not supported: {why}; supported: "
                                f"{', '.join(map(repr, allowed))}")
