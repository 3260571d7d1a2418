"""What a schedule costs (KV-cache bytes, FLOPs and parameters per token, by the project's accounting) and the
budget a search holds its candidates to."""

from __future__ import annotations

import dataclasses
import re

from jaxshare.config import Config
from jaxshare.exit_codes import InputError
from jaxshare.plan import ModelPlan, plan_of


class SearchError(InputError, ValueError):
  """A search that cannot run as asked: a malformed flag, a budget no candidate meets (exit code 2)."""


@dataclasses.dataclass(frozen=True)
class Footprint:
  """A schedule's costs on its model.

  Attributes:
    kv_bytes: KV-cache bytes per token in bf16 (:func:`jaxshare.accounting.kv_cache_bytes_per_token`).
    flops: forward FLOPs per token, attention averaged over a causal sequence of ``data.seq_len`` tokens
      (:func:`jaxshare.accounting.forward_flops_per_token` at context ``(T + 1) / 2``).
    params: total parameters (:func:`jaxshare.accounting.param_count`).
  """

  kv_bytes: int
  flops: float
  params: int


def footprint(cfg: Config) -> tuple[ModelPlan, Footprint]:
  """``cfg``'s compiled plan and the :class:`Footprint` of its model and schedule (read from the config alone;
  nothing is built).

  Raises:
    ScheduleError: the schedule does not fit the model.
  """
  plan = plan_of(cfg)
  return plan, Footprint(plan.kv_cache_bytes_per_token(), plan.forward_flops_per_token((cfg.data.seq_len + 1) / 2),
                         plan.param_count().total)


# Units of an absolute budget, by name as written (matched without case), per budget kind.
_UNITS = {"kv": {"B": 1, "KiB": 2**10, "MiB": 2**20},
          "flops": {"FLOP": 1, "KFLOP": 1e3, "MFLOP": 1e6, "GFLOP": 1e9}}


@dataclasses.dataclass(frozen=True)
class Limit:
  """One budget: ``value`` is a fraction of the source's figure when ``relative``, else an absolute figure (bytes per
  token, FLOPs per token)."""

  value: float
  relative: bool

  def bound(self, source: float) -> float:
    """The limit in absolute units for a source whose figure is ``source``."""
    return self.value * source if self.relative else self.value


def parse_limit(text: str, kind: str, flag: str) -> Limit:
  """A budget flag's value: a fraction of the source's figure (``0.5``), or an absolute figure with a unit (KV:
  ``B``, ``KiB``, ``MiB`` per token; FLOPs: ``FLOP``, ``KFLOP``, ``MFLOP``, ``GFLOP`` per token).

  Raises:
    SearchError: unparsable, non-positive, a fraction above 1, or an unknown unit (naming the flag and the units).
  """
  m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
  units = {u.lower(): factor for u, factor in _UNITS[kind].items()}
  allowed = ", ".join(_UNITS[kind])
  if m is None or float(m.group(1)) <= 0:
    raise SearchError(f"{flag} {text!r} is invalid: give a fraction of the source's figure in (0, 1] (e.g. 0.5) or "
                      f"a positive figure with a unit ({allowed})")
  value, unit = float(m.group(1)), m.group(2).lower()
  if not unit:
    if value > 1:
      raise SearchError(f"{flag} {text!r} is invalid: a fraction of the source's figure must be in (0, 1]; give an "
                        f"absolute figure with a unit ({allowed})")
    return Limit(value, True)
  if unit not in units:
    raise SearchError(f"{flag} {text!r} has unit {m.group(2)!r}; allowed: {allowed}")
  return Limit(value * units[unit], False)


@dataclasses.dataclass(frozen=True)
class Budget:
  """What every candidate of a search must fit: KV bytes and FLOPs per token (None: free), and whether its total
  parameters are matched to the source's (``schedule.match_params``, MLKV Sec. 4's control)."""

  kv: Limit | None = None
  flops: Limit | None = None
  equal_params: bool = False

  def fits(self, cost: Footprint, source: Footprint) -> bool:
    """Whether ``cost`` is within the budget, relative to the source's ``source`` (a small tolerance absorbs the
    rounding of fractions)."""
    return ((self.kv is None or cost.kv_bytes <= self.kv.bound(source.kv_bytes) * (1 + 1e-9))
            and (self.flops is None or cost.flops <= self.flops.bound(source.flops) * (1 + 1e-9)))

  def describe(self, source: Footprint) -> str:
    parts = []
    if self.kv is not None:
      parts.append(f"KV <= {self.kv.bound(source.kv_bytes):,.0f} B/token"
                   + (f" ({self.kv.value:g} of the source's {source.kv_bytes:,})" if self.kv.relative else ""))
    if self.flops is not None:
      parts.append(f"FLOPs <= {self.flops.bound(source.flops) / 1e6:,.3f} MFLOP/token"
                   + (f" ({self.flops.value:g} of the source's {source.flops / 1e6:,.3f})" if self.flops.relative
                      else ""))
    parts.append("parameters matched to the source" if self.equal_params else "parameters free")
    return "; ".join(parts)
