"""The model plan: everything a model's construction, accounting, initialisation, conversion and decoding read,
compiled once from the config's ``model``, ``schedule`` and ``attention`` groups.

A :class:`ModelPlan` is a frozen value: the compiled :class:`~jaxshare.schedule.Schedule` (every layer's role,
grouped into superblocks, runs and stacks), the MLP width (widened or narrowed by ``schedule.match_params``), and the
attention implementation settings. Code below the entry points takes a plan, never the raw config groups, so the
schedule is compiled and the width matched in one place (:func:`compile_plan`, cached).
"""

from __future__ import annotations

import dataclasses

from jaxshare import accounting
from jaxshare.config import AttentionConfig, Config, HeadwiseConfig, ModelConfig, ScheduleConfig
from jaxshare.schedule import Schedule, compile_schedule


@dataclasses.dataclass(frozen=True)
class ModelPlan:
  """A compiled model: its dimensions, its sharing schedule, its MLP width and its attention settings.

  Attributes:
    model: the model dimensions and flavour (``mlp_dim`` there is the width before matching).
    schedule: the compiled sharing schedule.
    mlp_dim: every MLP's hidden width F (``schedule.match_params`` applied; units: neurons).
    match: the parameter matching the width came from, or None.
    attention: ``attention.impl``, ``score_sharing`` and ``chain_dtype``.
    schedule_config: the ``schedule`` group the schedule was compiled from.
  """

  model: ModelConfig
  schedule: Schedule
  mlp_dim: int
  match: accounting.ParamMatch | None
  attention: AttentionConfig
  schedule_config: ScheduleConfig

  @property
  def tied_heads(self) -> int:
    return self.schedule.tied_heads

  def dense_counterpart(self) -> ModelPlan:
    """The same model with a plain dense schedule (what head-wise sharing is selected on and converted from)."""
    return compile_plan(self.model, dataclasses.replace(self.schedule_config, kind="dense", headwise=HeadwiseConfig()),
                        self.attention)

  def param_count(self) -> accounting.ParamCount:
    """The model's parameters by part (:func:`jaxshare.accounting.param_count`)."""
    return accounting.param_count(self.model, self.schedule, self.match)

  def train_flops_per_token(self, seq_len: int) -> float:
    """Training FLOPs per token at ``seq_len`` (:func:`jaxshare.accounting.train_flops_per_token`)."""
    return accounting.train_flops_per_token(self.model, self.schedule, seq_len, self.match)

  def forward_flops_per_token(self, context_len: float) -> float:
    """Forward FLOPs per token over ``context_len`` keys (:func:`jaxshare.accounting.forward_flops_per_token`)."""
    return accounting.forward_flops_per_token(self.model, self.schedule, context_len, self.match)

  def kv_cache_bytes_per_token(self, bytes_per_element: int = 2) -> int:
    """KV-cache bytes per token (:func:`jaxshare.accounting.kv_cache_bytes_per_token`)."""
    return accounting.kv_cache_bytes_per_token(self.model, self.schedule, bytes_per_element)


# Plans by the reprs of their config groups (which name every field; the groups' list fields make them unhashable).
_PLANS: dict[tuple[str, str, str], ModelPlan] = {}


def compile_plan(model: ModelConfig, schedule: ScheduleConfig,
                 attention: AttentionConfig = AttentionConfig()) -> ModelPlan:
  """The :class:`ModelPlan` of these config groups, compiled once per distinct value (cached by value).

  Raises:
    ScheduleError: the schedule does not fit the model (:func:`~jaxshare.schedule.compile_schedule`).
    ValueError: ``schedule.match_params`` asks for a width below one neuron (:func:`~jaxshare.accounting.mlp_dim`).
  """
  key = (repr(model), repr(schedule), repr(attention))
  if key not in _PLANS:
    compiled = compile_schedule(model, schedule)
    match = accounting.param_match(schedule)
    _PLANS[key] = ModelPlan(model, compiled, accounting.mlp_dim(model, compiled, match), match, attention, schedule)
  return _PLANS[key]


def plan_of(cfg: Config) -> ModelPlan:
  """``cfg``'s :class:`ModelPlan` (:func:`compile_plan` of its model, schedule and attention groups)."""
  return compile_plan(cfg.model, cfg.schedule, cfg.attention)
