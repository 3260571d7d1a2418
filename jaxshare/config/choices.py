"""The closed vocabularies of the config and the compiled schedule, as ``StrEnum``s.

A member equals its string (``ScoreReuse.PROBS == "probs"``), so config values read from YAML compare with them
directly; the config's allowed values (``metadata["choices"]``) are these enums' members, so a new member is allowed
everywhere at once.
"""

from __future__ import annotations

import enum
from typing import TypeVar


class KVPreset(enum.StrEnum):
  """K/V-family presets of ``schedule.kind``: where each layer's K/V come from."""

  DENSE = "dense"
  GQA = "gqa"
  MQA = "mqa"
  CLA = "cla"
  MLKV = "mlkv"
  EXPLICIT = "explicit"


class ScorePreset(enum.StrEnum):
  """Score-family presets of ``schedule.kind``: which layers reuse another layer's attention scores."""

  SA = "sa"
  UNIATTN = "uniattn"
  LISA = "lisa"
  LISA_PLUS = "lisa_plus"
  DS = "ds"


class HeadPreset(enum.StrEnum):
  """Head-family presets of ``schedule.kind``: head-wise weight tying."""

  HEADWISE = "headwise"


LISA_PRESETS = (ScorePreset.LISA, ScorePreset.LISA_PLUS, ScorePreset.DS)


class ScoreReuse(enum.StrEnum):
  """What a layer reuses of an earlier layer's attention: nothing (its own scores), the post-softmax probabilities
  (SA, UniAttn) or the pre-softmax logits of the layer before it (LISA family). As ``feeds``: what later layers reuse
  of this layer's own scores."""

  NONE = ""
  PROBS = "probs"
  LOGITS = "logits"


class Integrator(enum.StrEnum):
  """How a LISA layer combines the previous layer's logits with its low-rank delta (LISA Eq. 3-4): the head aligner
  (``ffn``, LISA), a linear map (``linear``, LISA_SL), a sum (``add``, LISA_plus) or nothing (``none``, DS).
  ``NOT_LISA`` (``""``) marks the layers that reuse no logits; the config allows only the other four."""

  NOT_LISA = ""
  FFN = "ffn"
  LINEAR = "linear"
  ADD = "add"
  NONE = "none"


INTEGRATORS = (Integrator.FFN, Integrator.LINEAR, Integrator.ADD, Integrator.NONE)


class AttentionImpl(enum.StrEnum):
  """``attention.impl``: which kernels compute attention (docs/kernels.md)."""

  AUTO = "auto"
  XLA = "xla"
  REFERENCE = "reference"
  PALLAS = "pallas"
  PALLAS_INTERPRET = "pallas_interpret"
  SPLASH = "splash"
  SPLASH_INTERPRET = "splash_interpret"
  CUDNN = "cudnn"


class RematPolicy(enum.StrEnum):
  """``model.remat``: what each layer keeps for the backward pass and what it recomputes (MaxText's
  ``remat_policy`` names, :mod:`jaxshare.model.remat`)."""

  NONE = "none"
  FULL = "full"
  MINIMAL = "minimal"
  SAVE_QKV_PROJ = "save_qkv_proj"
  SAVE_DOT_EXCEPT_MLP = "save_dot_except_mlp"
  SAVE_OUT_PROJ = "save_out_proj"
  MINIMAL_OFFLOADED = "minimal_offloaded"
  QKV_PROJ_OFFLOADED = "qkv_proj_offloaded"


class ScoreSharing(enum.StrEnum):
  """``attention.score_sharing``: whether reusing layers recompute the shared scores or receive them whole."""

  RECOMPUTE = "recompute"
  MATERIALIZE = "materialize"


class ContextStrategy(enum.StrEnum):
  """``attention.context_strategy``: how attention reads the keys of a sequence split over the ``context`` axis."""

  ALL_GATHER = "all_gather"
  RING = "ring"


class LisaStart(enum.StrEnum):
  """``train.init_lisa``: how a converted LISA layer's low-rank Q/K start."""

  DS = "ds"
  FIT = "fit"
  CALIBRATED = "calibrated"


class KVPool(enum.StrEnum):
  """``train.init_kv_pool``: how a converted K/V producer's projections are built from the layers that read them."""

  AUTO = "auto"
  MEAN = "mean"
  RUNNING = "running"
  PRODUCER = "producer"


class MLPWiden(enum.StrEnum):
  """``train.init_mlp_widen``: how a widened MLP's new hidden units start."""

  ZERO = "zero"
  DUPLICATE = "duplicate"


class WcFit(enum.StrEnum):
  """``convert uptrain --wc-fit``: which least-squares problem fits UniAttn's W_c."""

  MEAN = "mean"
  TOKENS = "tokens"


E = TypeVar("E", bound=enum.StrEnum)


def parse(kind: type[E], value: str, field: str) -> E:
  """``value`` as a member of ``kind``, for functions called with a setting directly rather than through a validated
  config.

  Raises:
    ValueError: naming ``field``, the value and the allowed members.
  """
  try:
    return kind(value)
  except ValueError:
    allowed = ", ".join(m.value for m in kind if m.value)
    raise ValueError(f"{field}={value!r} is invalid: must be one of {allowed}") from None
