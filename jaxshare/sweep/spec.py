"""The sweep file: named variants and a crossed grid, each run at every seed, each run's config checked as train.py
checks it."""

from __future__ import annotations

import dataclasses
import itertools
import re
import sys
from pathlib import Path
from typing import Any

import yaml
from etils import epath

from jaxshare import smoke
from jaxshare.config import REPO_ROOT, Config, load_config
from jaxshare.exit_codes import InputError
from jaxshare.files import is_remote
from jaxshare.plan import ModelPlan, plan_of

SPEC_KEYS = ("experiment", "run_root", "base", "seeds", "variants", "grid", "series")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=,+-]*$")


class SweepError(InputError, ValueError):
  """A malformed sweep file or an invalid flag (exit code 2)."""


def rel(path: Path) -> str:
  """A path as the sweep prints and records it: relative to the repository when inside it."""
  try:
    return str(path.relative_to(REPO_ROOT))
  except ValueError:
    return str(path)


@dataclasses.dataclass(frozen=True)
class Trial:
  """A trial of the sweep: one train.py + eval.py invocation, a variant at a seed (its own run directory)."""

  variant: str
  seed: int | None  # None: the sweep has no seeds, the experiment's own train.seed
  overrides: tuple[str, ...]  # base, then the variant's, then train.seed (never train.run_dir)
  run_dir: Path
  series: str = ""  # plot colour group
  eval_flags: tuple[str, ...] = ()  # eval.py's flags beyond the defaults, e.g. which validation batches it reads

  @property
  def seed_key(self) -> str:
    return "" if self.seed is None else str(self.seed)

  @property
  def label(self) -> str:
    return self.variant if self.seed is None else f"{self.variant}/seed{self.seed}"

  def train_overrides(self) -> list[str]:
    # run_dir last, so that no override can move a run out of the layout the sweep reads back
    return [*self.overrides, f"train.run_dir={self.run_dir}"]

  def train_command(self, experiment: str) -> list[str]:
    """``train.py`` of this trial on the experiment config ``experiment`` (without the evaluation summary)."""
    return [sys.executable, "train.py", "--config", experiment, "--no-eval", *self.train_overrides()]

  def eval_command(self) -> list[str]:
    """``eval.py`` of this trial's latest checkpoint, as JSON."""
    return [sys.executable, "eval.py", str(self.run_dir), "--json", "--sample-tokens", "0", *self.eval_flags]


@dataclasses.dataclass
class Sweep:
  """A parsed sweep file; ``variants`` holds the named variants, then the grid's points, as override lists."""

  path: Path
  experiment: str
  run_root: Path  # an epath.Path for a bucket (gs://)
  base: list[str]
  seeds: list[int] | None
  variants: dict[str, list[str]]
  series: dict[str, str]

  def runs(self, only: list[str] | None = None) -> list[Trial]:
    """Every run (variants in file order, seeds inner), or those of the variants named in ``only``; under
    ``JAXSHARE_SMOKE`` the first seed of the first (:mod:`jaxshare.smoke`).

    Raises:
      SweepError: a name in ``only`` that is not a variant of the sweep (listing the known ones).
    """
    if only:
      unknown = [n for n in only if n not in self.variants]
      if unknown:
        raise SweepError(f"--only {' '.join(unknown)}: no such variant in {self.path}; known: "
                         f"{', '.join(self.variants)}")
    runs = []
    for name in smoke.first([name for name in self.variants if not only or name in only]):
      overrides = self.variants[name]
      for seed in smoke.first(self.seeds or [None], 1):
        seed_ov = [] if seed is None else [f"train.seed={seed}"]
        run_dir = self.run_root / name if seed is None else self.run_root / name / f"seed{seed}"
        runs.append(Trial(name, seed, tuple(self.base + overrides + seed_ov), run_dir, self.series.get(name, "")))
    return runs


def _override_value(value: Any) -> str:
  """A YAML value as train.py's dotted-override syntax reads it back."""
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, list):
    return "[" + ",".join(_override_value(v) for v in value) + "]"
  return str(value)


def _name_value(value: Any) -> str:
  """A grid value as it appears in a variant name (a directory name: no brackets, slashes or spaces)."""
  if isinstance(value, list):
    return "-".join(_name_value(v) for v in value)
  return re.sub(r"[^A-Za-z0-9._+-]", "_", _override_value(value))


def grid_variants(grid: dict[str, list]) -> dict[str, list[str]]:
  """The cross product of ``{key: [values]}`` as ``{name: overrides}``, the last key varying fastest.

  Names are ``short=value`` joined by commas, ``short`` being the key's last dotted part (the whole key where two
  keys share it): ``{"schedule.kv_heads": [1, 2], "schedule.factor": [2]}`` gives ``kv_heads=1,factor=2`` and
  ``kv_heads=2,factor=2``.
  """
  if not grid:
    return {}
  keys = list(grid)
  tails = [k.rsplit(".", 1)[-1] for k in keys]
  short = [t if tails.count(t) == 1 else k for k, t in zip(keys, tails)]
  variants = {}
  for values in itertools.product(*(grid[k] for k in keys)):
    name = ",".join(f"{s}={_name_value(v)}" for s, v in zip(short, values))
    variants[name] = [f"{k}={_override_value(v)}" for k, v in zip(keys, values)]
  return variants


def _overrides(value: Any, where: str, path: Path) -> list[str]:
  if value is None:
    return []
  if not isinstance(value, list) or not all(isinstance(o, str) and "=" in o for o in value):
    raise SweepError(f"{path}: {where} must be a list of key=value overrides (e.g. [schedule.kind=cla]), got "
                     f"{value!r}")
  return list(value)


def load_sweep(path: str | Path) -> Sweep:
  """Parse and check a sweep file.

  Raises:
    SweepError: unreadable or non-YAML file, unknown or missing keys, wrongly typed values, bad or repeated names.
  """
  path = Path(path)
  try:
    spec = yaml.safe_load(path.read_text())
  except OSError as e:
    raise SweepError(f"cannot read sweep file {path}: {e.strerror}") from None
  except yaml.YAMLError as e:
    raise SweepError(f"{path} is not valid YAML: {e}") from None
  if not isinstance(spec, dict):
    raise SweepError(f"{path}: a sweep file is a YAML mapping with keys {', '.join(SPEC_KEYS)}; got "
                     f"{type(spec).__name__}")
  unknown = [k for k in spec if k not in SPEC_KEYS]
  if unknown:
    raise SweepError(f"{path}: unknown key(s) {', '.join(map(str, unknown))}; allowed: {', '.join(SPEC_KEYS)}")
  for key in ("experiment", "run_root"):
    if not isinstance(spec.get(key), str) or not spec[key]:
      raise SweepError(f"{path}: '{key}' is missing or not a string (got {spec.get(key)!r})")
  if not (REPO_ROOT / spec["experiment"]).is_file():
    raise SweepError(f"{path}: experiment={spec['experiment']!r} is not a file (relative to {REPO_ROOT})")
  if not spec.get("variants") and not spec.get("grid"):
    raise SweepError(f"{path}: needs 'variants' (name: [overrides]) and/or 'grid' (key: [values])")
  variants: dict[str, list[str]] = {}
  series: dict[str, str] = {}
  named = spec.get("variants") or {}
  if not isinstance(named, dict):
    raise SweepError(f"{path}: 'variants' must be a mapping name -> [overrides], got {type(named).__name__}")
  for name, ovs in named.items():
    variants[str(name)] = _overrides(ovs, f"variants.{name}", path)
  grid = spec.get("grid") or {}
  if not isinstance(grid, dict):
    raise SweepError(f"{path}: 'grid' must be a mapping key -> [values], got {type(grid).__name__}")
  for key, values in grid.items():
    if not isinstance(key, str) or "=" in key or not isinstance(values, list) or not values:
      raise SweepError(f"{path}: grid.{key} must map a dotted config key to a non-empty list of values, got "
                       f"{values!r}")
  for name, ovs in grid_variants(grid).items():
    if name in variants:
      raise SweepError(f"{path}: grid point {name!r} has the name of a variant")
    variants[name] = ovs
    if len(grid) > 1:  # colour the plots by the first grid key
      series[name] = name.split(",", 1)[0]
  for name in variants:
    if not NAME_RE.match(name):
      raise SweepError(f"{path}: variant name {name!r} is invalid: it names a directory, so it must start with a "
                       "letter or digit and hold only letters, digits and . _ = , + -")
  groups = spec.get("series") or {}
  if not isinstance(groups, dict) or not all(isinstance(v, list) for v in groups.values()):
    raise SweepError(f"{path}: 'series' must map a plot label to a list of variant names, got {groups!r}")
  for label, names in groups.items():
    for name in names:
      if str(name) not in variants:
        raise SweepError(f"{path}: series.{label} names {name!r}, which is not a variant; known: "
                         f"{', '.join(variants)}")
      series[str(name)] = str(label)
  seeds = spec.get("seeds")
  if seeds is not None:
    if (not isinstance(seeds, list) or not seeds or not all(type(s) is int for s in seeds)
        or len(set(seeds)) != len(seeds)):
      raise SweepError(f"{path}: 'seeds' must be a non-empty list of distinct integers, got {seeds!r}")
  root = epath.Path(spec["run_root"]) if is_remote(spec["run_root"]) else REPO_ROOT / spec["run_root"]
  return Sweep(path, spec["experiment"], root, _overrides(spec.get("base"), "base", path),
               seeds, variants, series)


def check_config(sweep: Sweep, run: Trial) -> tuple[Config, ModelPlan]:
  """The run's validated config and its compiled plan, without JAX (what train.py checks before compiling).

  Raises:
    ConfigError / ScheduleError: naming the field, value and what is allowed.
  """
  cfg = load_config(REPO_ROOT / sweep.experiment, run.train_overrides())
  return cfg, plan_of(cfg)
