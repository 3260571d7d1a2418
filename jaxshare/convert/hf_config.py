"""Reading fields of an HF ``config.json`` across transformers versions (v5's ``rope_parameters`` and the older
``rope_theta`` / ``rope_scaling`` / ``rotary_pct`` keys that hub checkpoints still carry)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jaxshare.convert.mapping import UnsupportedModelError

REQUIRED = object()  # a Row default: the field must be in config.json


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


def rope_overrides(config: dict, rope_type: str, params: dict) -> list[str]:
  """jaxshare ``model.rope_*`` overrides for HF's ``rope_type`` and its parameters.

  Raises:
    UnsupportedModelError: a rope_type other than default, linear and llama3 (dynamic, yarn, longrope, ... change
      the attention too and are not modelled).
  """
  require(config, "rope_type", rope_type, ("default", "linear", "llama3"), "other RoPE scalings are not modelled")
  if rope_type == "default":
    return []
  out = ["model.rope_scaling=" + rope_type, f"model.rope_scaling_factor={float(params['factor'])}"]
  if rope_type == "llama3":
    out += [f"model.rope_low_freq_factor={float(params['low_freq_factor'])}",
            f"model.rope_high_freq_factor={float(params['high_freq_factor'])}",
            f"model.rope_original_max_positions={int(params['original_max_position_embeddings'])}"]
  return out


def max_positions(seq_len: int) -> int:
  """``max_position_embeddings`` of an exported model trained on ``seq_len`` tokens: at least 2048, what HF
  generation defaults assume."""
  return max(seq_len, 2048)


def rope_parameters(model) -> dict:
  """HF ``rope_parameters`` (v5) of a jaxshare model config: type, theta and the scaling's parameters."""
  out = {"rope_type": "default" if model.rope_scaling == "none" else model.rope_scaling, "rope_theta": model.rope_theta}
  if model.rope_scaling != "none":
    out["factor"] = model.rope_scaling_factor
  if model.rope_scaling == "llama3":
    out.update(low_freq_factor=model.rope_low_freq_factor, high_freq_factor=model.rope_high_freq_factor,
               original_max_position_embeddings=model.rope_original_max_positions)
  return out


def kv_heads(plan) -> int:
  """The K/V heads of every layer of a model an HF architecture can hold (one count for all layers): the compiled
  schedule's (``plan``: a :class:`~jaxshare.plan.ModelPlan`), since ``schedule.kv_heads`` is 0 for both MHA and
  MQA."""
  return plan.schedule.layers[0].num_kv_heads


@dataclasses.dataclass(frozen=True)
class Row:
  """One HF config field that is one jaxshare ``model`` field, read on import and written on export.

  Attributes:
    hf: the key in ``config.json``.
    model: the :class:`~jaxshare.config.ModelConfig` field.
    default: the value when ``config.json`` lacks the key: :data:`REQUIRED` (refused), a value, or a function of the
      config (e.g. GPT-NeoX's ``intermediate_size`` = 4 x ``hidden_size``).
  """

  hf: str
  model: str
  default: Any = REQUIRED


# The fields every decoder-only architecture jaxshare reads names alike.
COMMON_ROWS = (Row("vocab_size", "vocab_size"), Row("num_hidden_layers", "num_layers"), Row("hidden_size", "d_model"),
               Row("num_attention_heads", "num_heads"), Row("tie_word_embeddings", "tie_embeddings", False))


def _override(name: str, value: Any) -> str:
  return f"model.{name}={str(value).lower() if isinstance(value, bool) else value}"


def row_overrides(config: dict, rows: tuple[Row, ...]) -> list[str]:
  """``model.*`` overrides of ``rows`` read from ``config``.

  Raises:
    UnsupportedModelError: a required field is missing.
  """
  out = []
  for row in rows:
    default = row.default(config) if isinstance(row.default, Callable) else row.default
    value = field(config, row.hf, None if default is REQUIRED else default, required=default is REQUIRED)
    out.append(_override(row.model, bool(value) if isinstance(default, bool) else value))
  return out


def row_fields(model, rows: tuple[Row, ...]) -> dict:
  """The ``config.json`` fields of ``rows`` for a jaxshare model config (export)."""
  return {row.hf: getattr(model, row.model) for row in rows}
