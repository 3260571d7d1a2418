"""A model's starting parameters: fresh from a seed, or converted from a source model's by the rules of
:mod:`jaxshare.init` (the uptraining conversion ``train.py train.init_from=...`` and ``python -m jaxshare.convert
uptrain`` share)."""

from __future__ import annotations

from flax import nnx

from jaxshare.config import ConfigError, ModelConfig
from jaxshare.data.errors import DataError
from jaxshare.data.tokenizers import tokenizer_fingerprint
from jaxshare.init.headwise import tied_params_from_dense
from jaxshare.init.kv import convert_kv
from jaxshare.init.lisa import init_low_rank
from jaxshare.init.mlp import widen_mlp
from jaxshare.init.rules import InitRules
from jaxshare.init.shared import copy_shared_weights
from jaxshare.model import build_model
from jaxshare.model.ties import HeadTies
from jaxshare.plan import ModelPlan
from jaxshare.schedule import Schedule


# The model fields a parameter's shape or presence depends on: a run started from another run must share them (the
# schedule may change: that is what uptraining converts).
_WEIGHT_FIELDS = ("flavor", "vocab_size", "num_layers", "d_model", "num_heads", "resolved_head_dim", "mlp_dim",
                  "tie_embeddings", "qkv_bias")


def check_loadable(src: ModelConfig, model: ModelConfig, source: str, *, src_tokenizer: str, tokenizer: str) -> None:
  """Refuse a model that cannot start from the weights of the run ``source``, whose model is ``src``: a field of
  :data:`_WEIGHT_FIELDS` that differs, or another tokenizer (``data.tokenizer``: its ids index the source's
  embedding).

  Raises:
    ConfigError: one line naming every such field, its value here and in the source.
  """
  differ = [f for f in _WEIGHT_FIELDS if getattr(model, f) != getattr(src, f)]
  if "d_model" in differ or "num_heads" in differ:  # the head width follows from them unless set: name what was set
    differ = [f for f in differ if f != "resolved_head_dim" or model.head_dim]
  diffs = [f"model.{f.replace('resolved_', '')}={getattr(model, f)!r} (the source has {getattr(src, f)!r})"
           for f in differ]
  if not same_tokenizer(tokenizer, src_tokenizer):
    diffs.append(f"data.tokenizer={tokenizer!r} (the source has {src_tokenizer!r})")
  if diffs:
    raise ConfigError(f"train.init_from={source!r} cannot load that run's weights into this model: "
                      + "; ".join(diffs) + ". Leave these fields out (a run started from another takes its model, "
                      "schedule and tokenizer unless told otherwise) or give the source's values")


def same_tokenizer(a: str, b: str) -> bool:
  """Whether two ``data.tokenizer`` values name the same tokenizer (the same name, or directories of the same files)."""
  if a == b:
    return True
  try:
    return tokenizer_fingerprint(a) == tokenizer_fingerprint(b)
  except DataError:  # one of them is gone
    return False


def initial_params(plan: ModelPlan, ties: HeadTies | None, seed: int) -> dict:
  """Fresh parameters (pure dict) of the model of ``plan``, drawn from ``seed``; a head-wise model starts as
  DirectShare applied to the dense model of the same seed. Traceable (run it under ``jax.jit`` to place it)."""
  params = nnx.to_pure_dict(nnx.state(build_model(plan, seed, ties), nnx.Param))
  if ties is None:
    return params
  dense = plan.dense_counterpart()
  dense_params = nnx.to_pure_dict(nnx.state(build_model(dense, seed), nnx.Param))
  return tied_params_from_dense(dense_params, params, ties, dense.schedule)


def params_from_source(plan: ModelPlan, rules: InitRules, ties: HeadTies | None, params: dict, src: dict,
                       src_schedule: Schedule) -> dict:
  """``params`` (fresh, of the model of ``plan``) started from a source model's ``src`` by ``rules``: every shared
  tensor copied (:mod:`~jaxshare.init.shared`), K/V pooled (:mod:`~jaxshare.init.kv`, ``rules.kv_pool``), MLPs
  resized (:mod:`~jaxshare.init.mlp`, ``rules.mlp_widen``), LISA's factors started (:mod:`~jaxshare.init.lisa`,
  ``rules.lisa``); a head-wise target takes a head-wise source's weights and head table as they are, or
  DirectShare's conversion of a dense source (:mod:`~jaxshare.init.headwise`). Traceable.

  Raises:
    ValueError / ConfigError: the models differ in depth, or a rule's setting is invalid for them.
  """
  schedule = plan.schedule
  if ties is None:
    params = copy_shared_weights(src, src_schedule, params, schedule)
    params = convert_kv(src, src_schedule, params, schedule, kv_pool=rules.kv_pool)
    params = widen_mlp(src, src_schedule, params, schedule, rule=rules.mlp_widen)
    return init_low_rank(src, src_schedule, params, schedule, rules.lisa)
  if "head_table" in src:  # a head-wise source with these ties: its weights as they are
    return {**copy_shared_weights(src, src_schedule, params, schedule), "head_table": src["head_table"]}
  return tied_params_from_dense(src, params, ties, src_schedule)
