#!/usr/bin/env python
"""Run a sweep of config variants (and seeds) through train.py and eval.py, and tabulate and plot the results.

Usage:
  python scripts/sweep.py configs/sweeps/mlkv_ladder.yaml                # train + evaluate every run, table, plots
  python scripts/sweep.py SWEEP --only gqa_8 mqa_4 --parallel 2         # two runs at a time, each on its own devices
  python scripts/sweep.py SWEEP --check                                  # validate every run's config, train nothing
  python scripts/sweep.py SWEEP --dry-run                                # print the commands, run nothing
  python scripts/sweep.py SWEEP --launch slurm --launcher-args "--nodes 1 --gpus-per-node 8"
  python scripts/sweep.py SWEEP --collect                                # evaluate launched runs that have finished

Sweep file (YAML):
  experiment: configs/experiments/sharing_base.yaml   # train.py --config
  run_root: runs/mlkv_ladder                           # runs: <run_root>/<variant>/seed<S> (<variant> without seeds)
  base: [train.steps=400]                              # optional: overrides of every run (first)
  seeds: [0, 1]                                        # optional: one run per seed, train.seed=S (init only; the
                                                       #   data order, data.shuffle_seed, is the same for all)
  variants: {gqa_8: [schedule.kind=gqa, schedule.kv_heads=2], ...}   # named override lists
  grid: {schedule.kv_heads: [1, 2], schedule.factor: [1, 2]}         # crossed; names like kv_heads=1,factor=2
  series: {within layers: [mha_16, gqa_8]}             # optional: plot colours (default: a grid's first key)

Runs are the named variants followed by the grid's points, each for every seed. A run whose latest checkpoint is at
train.steps and whose evaluation is cached in <run_dir>/eval.json is skipped; an interrupted run resumes (train.py
resumes from its run directory). Each run's train.py/eval.py output goes to <run_dir>/sweep.log. A failing run is
recorded with status `failed` and the sweep goes on; the exit code is 1 if any run failed, 2 for a bad sweep file
or flag. Results merge by (variant, seed) into <run_root>/results.csv (rows of other variants are kept), and
results.md (mean ± sample std over seeds), loss_vs_kv.png and loss_vs_params.png are rewritten from it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import csv
import dataclasses
import fcntl
import glob
import io
import itertools
import json
import math
import os
import queue
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere: jaxshare is importable without an install
  sys.path.insert(0, str(REPO))

SPEC_KEYS = ("experiment", "run_root", "base", "seeds", "variants", "grid", "series")
FIELDS = ("variant", "seed", "status", "val_loss", "bits_per_byte", "perplexity", "kv_bytes_per_token_bf16",
          "kv_bytes_per_token", "num_params", "step", "schedule", "run_dir", "error")
LAUNCHERS = {"slurm": "scripts/launch_slurm.sh", "tpu": "scripts/launch_tpu_pod.sh"}
# Chips of one process on a TPU host -> TPU_CHIPS_PER_PROCESS_BOUNDS: the sub-slices libtpu accepts on one host
# (v4: 2x2 chips, v5e/v6e: 2x4).
TPU_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}
TPU_BASE_PORT = 8476
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=,+-]*$")
_PRINT = threading.Lock()


def _say(*lines: str, file=None) -> None:
  """Print whole lines: concurrent runs report from threads, and print() may interleave text and newline."""
  with _PRINT:
    out = file or sys.stdout
    out.write("".join(f"{ln}\n" for ln in lines))
    out.flush()


class SweepError(ValueError):
  """A malformed sweep file or an invalid flag (exit code 2)."""


# ---------------------------------------------------------------------------------------------------- sweep file


@dataclasses.dataclass(frozen=True)
class Run:
  """One train.py + eval.py invocation: a variant at a seed."""

  variant: str
  seed: int | None  # None: the sweep has no seeds, the experiment's own train.seed
  overrides: tuple[str, ...]  # base, then the variant's, then train.seed (never train.run_dir)
  run_dir: Path
  series: str = ""  # plot colour group

  @property
  def seed_key(self) -> str:
    return "" if self.seed is None else str(self.seed)

  @property
  def label(self) -> str:
    return self.variant if self.seed is None else f"{self.variant}/seed{self.seed}"

  def train_overrides(self) -> list[str]:
    # run_dir last, so that no override can move a run out of the layout the sweep reads back
    return [*self.overrides, f"train.run_dir={self.run_dir}"]


@dataclasses.dataclass
class Sweep:
  """A parsed sweep file; ``variants`` holds the named variants, then the grid's points, as override lists."""

  path: Path
  experiment: str
  run_root: Path
  base: list[str]
  seeds: list[int] | None
  variants: dict[str, list[str]]
  series: dict[str, str]

  def runs(self, only: list[str] | None = None) -> list[Run]:
    """Every run (variants in file order, seeds inner), or those of the variants named in ``only``.

    Raises:
      SweepError: a name in ``only`` that is not a variant of the sweep (listing the known ones).
    """
    if only:
      unknown = [n for n in only if n not in self.variants]
      if unknown:
        raise SweepError(f"--only {' '.join(unknown)}: no such variant in {self.path}; known: "
                         f"{', '.join(self.variants)}")
    runs = []
    for name, overrides in self.variants.items():
      if only and name not in only:
        continue
      for seed in self.seeds or [None]:
        seed_ov = [] if seed is None else [f"train.seed={seed}"]
        run_dir = self.run_root / name if seed is None else self.run_root / name / f"seed{seed}"
        runs.append(Run(name, seed, tuple(self.base + overrides + seed_ov), run_dir, self.series.get(name, "")))
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
  import yaml

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
  if not (REPO / spec["experiment"]).is_file():
    raise SweepError(f"{path}: experiment={spec['experiment']!r} is not a file (relative to {REPO})")
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
  return Sweep(path, spec["experiment"], REPO / spec["run_root"], _overrides(spec.get("base"), "base", path),
               seeds, variants, series)


def check_config(sweep: Sweep, run: Run) -> tuple[Any, Any]:
  """The run's validated config and compiled schedule, without JAX (what train.py checks before compiling).

  Raises:
    ConfigError / ScheduleError: naming the field, value and what is allowed.
  """
  from jaxshare.config import load_config
  from jaxshare.schedule import compile_schedule

  cfg = load_config(REPO / sweep.experiment, run.train_overrides())
  return cfg, compile_schedule(cfg.model, cfg.schedule)


# ----------------------------------------------------------------------------------------------------- run state


def latest_step(run_dir: Path) -> int | None:
  """The run's newest finished checkpoint (orbax writes ``checkpoints/<step>``; unfinished ones have a suffix)."""
  steps = [int(p.name) for p in (run_dir / "checkpoints").glob("*") if p.name.isdigit() and p.is_dir()]
  return max(steps) if steps else None


def cached_eval(run_dir: Path, steps: int) -> dict | None:
  """``<run_dir>/eval.json`` if it evaluates the checkpoint at ``steps``."""
  try:
    report = json.loads((run_dir / "eval.json").read_text())
  except (OSError, ValueError):
    return None
  return report if report.get("step") == steps and latest_step(run_dir) == steps else None


def _write_atomic(path: Path, text: str) -> None:
  """Write a file whole or not at all: readers never see a half-written table."""
  tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
  tmp.write_text(text)
  os.replace(tmp, path)


def _tail(path: Path, lines: int) -> list[str]:
  try:
    text = path.read_text(errors="replace")
  except OSError:
    return []
  return [ln for ln in text.splitlines() if ln.strip()][-lines:]


def _row(run: Run, status: str, report: dict | None = None, error: str = "") -> dict:
  row = {"variant": run.variant, "seed": run.seed_key, "status": status, "run_dir": _rel(run.run_dir), "error": error}
  for key in FIELDS:
    if report and key in report and key not in ("run_dir",):
      row[key] = report[key]
  return row


def _rel(path: Path) -> str:
  try:
    return str(path.relative_to(REPO))
  except ValueError:
    return str(path)


# -------------------------------------------------------------------------------------------------- device groups


def detect_platform() -> str:
  """gpu if nvidia-smi lists a GPU, tpu if the host has TPU device files, else cpu (JAX is not imported here: on a
  TPU host that would take the chips from the runs)."""
  if shutil.which("nvidia-smi"):
    with contextlib.suppress(OSError, subprocess.SubprocessError):
      out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
      if any(line.startswith("GPU ") for line in out.splitlines()):
        return "gpu"
  if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
    return "tpu"
  return "cpu"


def available_devices(platform: str) -> list[str]:
  """Device ids to split when --devices is not given: GPUs (CUDA_VISIBLE_DEVICES if set), TPU chips, CPU cores."""
  if platform == "gpu":
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
      return os.environ["CUDA_VISIBLE_DEVICES"].split(",")
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    return [str(i) for i, _ in enumerate(ln for ln in out.splitlines() if ln.startswith("GPU "))]
  if platform == "tpu":
    chips = glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")
    return [str(i) for i in range(len(chips))]
  return [str(c) for c in sorted(os.sched_getaffinity(0))]


@dataclasses.dataclass(frozen=True)
class DeviceGroup:
  """What one concurrent run sees: environment variables and a command prefix."""

  env: tuple[tuple[str, str], ...] = ()
  prefix: tuple[str, ...] = ()
  label: str = ""


def split_devices(devices: list[str], parallel: int, platform: str) -> list[list[str]]:
  """``devices`` in ``parallel`` contiguous groups: equal sizes on accelerators (runs stay comparable, and TPU
  sub-slices need fixed shapes), as even as possible on CPU cores.

  Raises:
    SweepError: fewer devices than groups, or accelerators that do not divide evenly.
  """
  if parallel < 1:
    raise SweepError(f"--parallel={parallel} is invalid: must be >= 1")
  if len(devices) < parallel:
    raise SweepError(f"--parallel={parallel} needs at least {parallel} devices; {platform} has {len(devices)} "
                     f"({','.join(devices)})")
  if platform != "cpu" and len(devices) % parallel:
    raise SweepError(f"--parallel={parallel} must divide the {len(devices)} {platform} devices "
                     f"({','.join(devices)}) into equal groups")
  size, extra = divmod(len(devices), parallel)
  groups, start = [], 0
  for i in range(parallel):
    end = start + size + (1 if i < extra else 0)
    groups.append(devices[start:end])
    start = end
  return groups


def group_env(platform: str, devices: list[str], index: int) -> DeviceGroup:
  """How a process is confined to ``devices``.

  gpu: CUDA_VISIBLE_DEVICES. tpu: libtpu's single-host sub-slice variables (TPU_VISIBLE_CHIPS and its older name
  TPU_VISIBLE_DEVICES, TPU_CHIPS_PER_PROCESS_BOUNDS for the group's shape, TPU_PROCESS_BOUNDS=1,1,1 for one process
  per slice, and a port of its own per group so that concurrent runtimes do not collide). cpu: ``taskset -c`` (XLA
  sizes its CPU thread pools by the cores a process may run on).

  Raises:
    SweepError: a TPU group of a size libtpu has no single-host shape for, or no taskset on CPU.
  """
  ids = ",".join(devices)
  if platform == "gpu":
    return DeviceGroup(env=(("CUDA_VISIBLE_DEVICES", ids),), label=f"GPU {ids}")
  if platform == "tpu":
    if len(devices) not in TPU_BOUNDS:
      raise SweepError(f"a TPU group of {len(devices)} chips is invalid: must be one of "
                       f"{', '.join(map(str, TPU_BOUNDS))} chips")
    port = str(TPU_BASE_PORT + index)
    env = (("TPU_VISIBLE_CHIPS", ids), ("TPU_VISIBLE_DEVICES", ids),
           ("TPU_CHIPS_PER_PROCESS_BOUNDS", TPU_BOUNDS[len(devices)]), ("TPU_PROCESS_BOUNDS", "1,1,1"),
           ("TPU_PROCESS_PORT", port), ("TPU_PROCESS_ADDRESSES", f"localhost:{port}"),
           ("TPU_MESH_CONTROLLER_ADDRESS", f"localhost:{port}"), ("TPU_MESH_CONTROLLER_PORT", port),
           ("CLOUD_TPU_TASK_ID", "0"))
    return DeviceGroup(env=env, label=f"TPU chips {ids}")
  if not shutil.which("taskset"):
    raise SweepError("confining CPU runs to cores needs taskset (util-linux); install it or leave out --devices")
  return DeviceGroup(prefix=("taskset", "-c", ids), label=f"cores {ids}")


def device_groups(parallel: int, devices: str | None, platform: str) -> list[DeviceGroup]:
  """One group per concurrent run. With one run at a time and no --devices, runs see everything (no variables)."""
  if platform == "auto":
    platform = detect_platform()
  if parallel == 1 and not devices:
    return [DeviceGroup()]
  ids = [d.strip() for d in devices.split(",") if d.strip()] if devices else available_devices(platform)
  if platform == "cpu" and not devices and (len(ids) < parallel or not shutil.which("taskset")):
    return [DeviceGroup() for _ in range(parallel)]  # more runs than cores: N unconfined processes share them
  return [group_env(platform, g, i) for i, g in enumerate(split_devices(ids, parallel, platform))]


# ---------------------------------------------------------------------------------------------------- executing


def _command(group: DeviceGroup, args: list[str]) -> str:
  env = [f"{k}={shlex.quote(v)}" for k, v in group.env]
  return " ".join(env + [shlex.join([*group.prefix, *args])])


def train_args(sweep: Sweep, run: Run) -> list[str]:
  return [sys.executable, "train.py", "--config", sweep.experiment, "--no-eval", *run.train_overrides()]


def eval_args(run: Run) -> list[str]:
  return [sys.executable, "eval.py", str(run.run_dir), "--json", "--sample-tokens", "0"]


def _call(group: DeviceGroup, args: list[str], log: Path, capture: bool = False) -> tuple[int, str]:
  """Run a command with the group's devices, appending its output to ``log`` as it comes (``tail -f`` follows a
  run); with ``capture`` stdout is returned instead and appended at the end. ``(exit code, stdout)``."""
  env = {**os.environ, **dict(group.env), "PYTHONUNBUFFERED": "1"}
  with log.open("a") as f:
    f.write(f"\n== {time.strftime('%Y-%m-%d %H:%M:%S')} {_command(group, args)}\n")
    f.flush()
    proc = subprocess.run([*group.prefix, *args], cwd=REPO, env=env, stdout=subprocess.PIPE if capture else f,
                          stderr=f, text=True)
    if capture:
      f.write(proc.stdout)
  return proc.returncode, proc.stdout or ""


def execute(sweep: Sweep, run: Run, steps: int, group: DeviceGroup, evaluate_only: bool = False) -> dict:
  """Train (or resume) and evaluate one run; a result row with status ok or failed (never raises for the run's
  own errors: their output is in <run_dir>/sweep.log)."""
  run.run_dir.mkdir(parents=True, exist_ok=True)
  log = run.run_dir / "sweep.log"

  def failed(what: str) -> dict:
    tail = _tail(log, 1)
    return _row(run, "failed", error=f"{what}: {tail[-1] if tail else 'no output'}"[:300])

  if not evaluate_only:
    code, _ = _call(group, train_args(sweep, run), log)
    if code != 0:
      return failed(f"train.py exit {code}")
    reached = latest_step(run.run_dir)
    if reached != steps:
      return _row(run, "failed", error=f"training stopped at step {reached} of {steps}")
  code, out = _call(group, eval_args(run), log, capture=True)
  lines = [ln for ln in out.splitlines() if ln.startswith("{")]
  if code != 0 or not lines:
    return failed(f"eval.py exit {code}")
  report = json.loads(lines[-1])
  _write_atomic(run.run_dir / "eval.json", json.dumps(report, indent=1) + "\n")
  return _row(run, "ok", report)


# ------------------------------------------------------------------------------------------------------ results


def mean_std(values: list[float], digits: int = 4) -> str:
  """``mean ± sample std`` (n - 1 in the denominator); the value alone for one seed, ``—`` for none."""
  if not values:
    return "—"
  mean = sum(values) / len(values)
  if len(values) == 1:
    return f"{mean:.{digits}f}"
  std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
  return f"{mean:.{digits}f} ± {std:.{digits}f}"


def _stats(values: list[float]) -> tuple[float, float]:
  mean = sum(values) / len(values)
  std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
  return mean, std


def read_results(path: Path) -> tuple[list[dict], list[str]]:
  """Rows and column names of an existing results.csv (none if absent)."""
  if not path.exists():
    return [], []
  with path.open(newline="") as f:
    reader = csv.DictReader(f)
    rows, columns = list(reader), list(reader.fieldnames or [])
  if "variant" not in columns and "name" in columns:  # the table of the sweep script before seeds: one run each
    rows = [{"variant": r["name"], "seed": "", "status": "ok", **{k: v for k, v in r.items() if k != "name"}}
            for r in rows]
    columns = [c for c in columns if c != "name"]
  return rows, columns


def merge_rows(existing: list[dict], new: list[dict], order: list[str] | None = None) -> list[dict]:
  """``existing`` with rows of the same (variant, seed) replaced by ``new``'s, new keys appended; with ``order``
  (the sweep's variants) those variants' rows come first in that order, by seed, the others after as they were."""
  fresh = {(r["variant"], str(r["seed"])): r for r in new}
  merged = [fresh.pop((r["variant"], str(r["seed"])), r) for r in existing] + list(fresh.values())
  if order:
    rank = {name: i for i, name in enumerate(order)}

    def key(r):
      seed = str(r["seed"])
      return rank.get(r["variant"], len(rank)), int(seed) if seed.lstrip("-").isdigit() else 0

    merged.sort(key=key)  # stable: rows of other variants keep their order
  return merged


def summarize(rows: list[dict], order: list[str]) -> list[dict]:
  """One entry per variant (sweep order first, then others in table order): ok seeds, loss mean/std, KV, params."""
  names = list(dict.fromkeys([n for n in order if any(r["variant"] == n for r in rows)] +
                             [r["variant"] for r in rows]))
  out = []
  for name in names:
    mine = [r for r in rows if r["variant"] == name]
    ok = [r for r in mine if r["status"] == "ok"]
    entry = {"name": name, "runs": len(mine), "ok": len(ok), "statuses": sorted({r["status"] for r in mine}),
             "losses": [float(r["val_loss"]) for r in ok], "bpb": [float(r["bits_per_byte"]) for r in ok]}
    if ok:
      entry["val_loss"], entry["val_loss_std"] = _stats(entry["losses"])
      entry["kv_bytes_per_token_bf16"] = int(float(ok[0]["kv_bytes_per_token_bf16"]))
      entry["num_params"] = int(float(ok[0]["num_params"]))
    out.append(entry)
  return out


def markdown_table(summary: list[dict]) -> str:
  lines = ["| variant | seeds ok | val loss (nats/token) | bits/byte | KV bytes/token (bf16) | params |",
           "|---|---|---|---|---|---|"]
  for s in summary:
    seeds = f"{s['ok']}/{s['runs']}"
    if s["ok"] < s["runs"]:
      seeds += " (" + ", ".join(st for st in s["statuses"] if st != "ok") + ")"
    kv = f"{s['kv_bytes_per_token_bf16']:,}" if s["ok"] else "—"
    params = f"{s['num_params']:,}" if s["ok"] else "—"
    lines.append(f"| {s['name']} | {seeds} | {mean_std(s['losses'])} | {mean_std(s['bpb'])} | {kv} | {params} |")
  return "\n".join(lines) + "\n"


def plot(summary: list[dict], sweep: Sweep, root: Path) -> list[Path]:
  """Loss against KV bytes and against parameters, one point per variant, error bars = std over seeds."""
  from jaxshare.analysis.plots import loss_vs_kv, loss_vs_params

  points = [{**s, "series": sweep.series.get(s["name"], "")} for s in summary if s["ok"]]
  if not points:
    return []
  paths = [root / "loss_vs_kv.png", root / "loss_vs_params.png"]
  label = "validation loss (nats/token)"
  title = f"{sweep.path.stem}" + (f", mean ± std over {len(sweep.seeds)} seeds" if sweep.seeds else "")
  kv = [p["kv_bytes_per_token_bf16"] for p in points]
  loss_vs_kv(points, paths[0], kv_key="kv_bytes_per_token_bf16", kv_label="KV cache, bytes per token (bf16)",
             loss_label=label, err_key="val_loss_std", title=title, log_x=min(kv) > 0 and max(kv) >= 8 * min(kv))
  loss_vs_params(points, paths[1], loss_label=label, err_key="val_loss_std", title=title)
  return paths


class Results:
  """The sweep's table: rows merged into <run_root>/results.csv under a file lock (two sweeps over one run_root
  never drop each other's rows), written atomically, and results.md regenerated from the merged table."""

  def __init__(self, sweep: Sweep):
    self.sweep, self.root = sweep, sweep.run_root
    self.lock = threading.Lock()

  def add(self, rows: list[dict]) -> list[dict]:
    """Merge ``rows`` in; returns the whole merged table."""
    self.root.mkdir(parents=True, exist_ok=True)
    with self.lock, (self.root / ".results.lock").open("w") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)
      existing, columns = read_results(self.root / "results.csv")
      merged = merge_rows(existing, rows, list(self.sweep.variants))
      fields = list(FIELDS) + [c for c in columns if c not in FIELDS]
      buf = io.StringIO()
      writer = csv.DictWriter(buf, fieldnames=fields, restval="", extrasaction="ignore", lineterminator="\n")
      writer.writeheader()
      writer.writerows(merged)
      _write_atomic(self.root / "results.csv", buf.getvalue())
      _write_atomic(self.root / "results.md", markdown_table(summarize(merged, list(self.sweep.variants))))
      return merged


# ------------------------------------------------------------------------------------------------------ launching


# Launcher flags the sweep sets itself (the run's name, place and experiment) or that would break a sweep: --detach
# would start every run at once on the same TPU VM (without it each launch returns when its run ends, so the runs
# go through the pod one after another), and the launchers' own --dry-run is the sweep's --dry-run.
RESERVED_LAUNCHER_FLAGS = {
  "--run-name": "the sweep names each run", "--run-root": "the sweep places each run",
  "--config": "the sweep file's experiment is passed", "--dry-run": "use the sweep's own --dry-run",
  "--detach": "it would start every run at once on the same TPU VM",
}


def job_name(sweep: Sweep, run: Run) -> str:
  """The launcher's --run-name: ``<sweep>-<variant>-s<seed>`` in the characters the launchers take (letters,
  digits, '.', '_', '-'); it names the Slurm job, and on TPU the run's directory in the bucket."""
  name = f"{sweep.path.stem}-{run.variant}" + ("" if run.seed is None else f"-s{run.seed}")
  return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._-")


def launcher_command(kind: str, sweep: Sweep, run: Run, launcher_args: list[str]) -> list[str]:
  """The launcher invocation that trains ``run`` remotely (scripts/launch_slurm.sh, scripts/launch_tpu_pod.sh).

  slurm: the run directory stays at the sweep's layout on the cluster's shared filesystem: overrides after ``--``
  win over the launcher's own, so ``train.run_dir`` sets it (``--run-root`` is the sweep's run_root for the
  launcher's default). tpu: the run directory is ``<bucket>/<job name>`` (every worker must write to it); copy it
  back into the layout to --collect it.
  """
  script = str(REPO / LAUNCHERS[kind])
  name = job_name(sweep, run)
  if kind == "slurm":
    return [script, "--run-name", name, "--run-root", str(sweep.run_root), *launcher_args,
            "--config", sweep.experiment, "--", *run.train_overrides()]
  return [script, "--run-name", name, *launcher_args, "--config", sweep.experiment, "--", *run.overrides]


def check_launcher_args(launcher_args: list[str]) -> None:
  """Raises SweepError for a flag in RESERVED_LAUNCHER_FLAGS."""
  for a in launcher_args:
    flag = a.split("=", 1)[0]
    if flag in RESERVED_LAUNCHER_FLAGS:
      raise SweepError(f"--launcher-args: {flag} is not allowed ({RESERVED_LAUNCHER_FLAGS[flag]}); refused: "
                       f"{', '.join(RESERVED_LAUNCHER_FLAGS)}")


def _bucket(launcher_args: list[str]) -> str | None:
  for i, a in enumerate(launcher_args):
    if a == "--bucket" and i + 1 < len(launcher_args):
      return launcher_args[i + 1]
    if a.startswith("--bucket="):
      return a.split("=", 1)[1]
  return None


# ------------------------------------------------------------------------------------------------------------ main


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("sweep", help="sweep YAML (see above)")
  parser.add_argument("--only", nargs="+", default=None, metavar="NAME", help="run only these variants (all seeds)")
  parser.add_argument("--check", action="store_true",
                      help="validate every run's config and schedule (no JAX), print KV bytes and params, exit")
  parser.add_argument("--dry-run", action="store_true", help="print the commands of the pending runs, run nothing")
  parser.add_argument("--parallel", type=int, default=1, metavar="N",
                      help="local runs at once, each on its own group of --devices")
  parser.add_argument("--devices", default=None, metavar="IDS",
                      help="comma-separated device ids to split into --parallel groups: GPU indices, TPU chips or "
                      "CPU cores (default: all GPUs/chips; on CPU all cores when --parallel > 1)")
  parser.add_argument("--platform", default="auto", choices=("auto", "cpu", "gpu", "tpu"),
                      help="how to confine a run to its devices (auto: nvidia-smi, /dev/accel*, else cpu)")
  parser.add_argument("--launch", choices=tuple(LAUNCHERS), default=None,
                      help="submit each pending run through scripts/launch_{slurm,tpu_pod}.sh instead of training here")
  parser.add_argument("--launcher-args", default="", metavar="ARGS",
                      help="extra launcher flags, one string, e.g. \"--nodes 1 --gpus-per-node 8\" or "
                      "\"--bucket gs://B/runs --tpu NAME --zone Z\"")
  parser.add_argument("--collect", action="store_true",
                      help="train nothing: evaluate runs that finished (e.g. launched ones) and tabulate")
  return parser


def _check(sweep: Sweep, runs: list[Run]) -> int:
  from jaxshare import accounting

  bad = 0
  for run in {r.variant: r for r in runs}.values():  # a seed changes no shape
    try:
      cfg, schedule = check_config(sweep, run)
    except ValueError as e:  # ConfigError and ScheduleError
      print(f"INVALID {run.variant}: {e}")
      bad += 1
      continue
    kv = accounting.kv_cache_bytes_per_token(cfg.model, schedule, 2)
    params = accounting.param_count(cfg.model, schedule, cfg.schedule.match_params).total
    print(f"ok {run.variant}: {kv:,} KV bytes/token (bf16), {params:,} params | {schedule.describe()}")
  print(f"{len(runs)} runs of {len({r.variant for r in runs})} variants; {bad} invalid")
  return 2 if bad else 0


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  try:
    sweep = load_sweep(args.sweep)
    runs = sweep.runs(args.only)
    if args.check:
      return _check(sweep, runs)
    launcher_args = shlex.split(args.launcher_args)
    check_launcher_args(launcher_args)
    groups = [] if args.launch or args.collect else device_groups(args.parallel, args.devices, args.platform)
    if args.launch and not args.dry_run and not (REPO / LAUNCHERS[args.launch]).is_file():
      raise SweepError(f"--launch {args.launch}: {LAUNCHERS[args.launch]} is not there")
  except SweepError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2

  from jaxshare.config import ConfigError
  from jaxshare.schedule import ScheduleError

  results = Results(sweep)
  done: list[dict] = []  # rows of this invocation
  pending: list[tuple[Run, int | None, str]] = []  # run, target steps, config error
  for run in runs:
    try:
      cfg, _ = check_config(sweep, run)
      steps, error = cfg.train.steps, ""
    except (ConfigError, ScheduleError) as e:
      steps, error = None, str(e)
    report = cached_eval(run.run_dir, steps) if steps else None
    if report is not None:
      print(f"{run.label}: skipped (finished at step {steps}, evaluation cached in eval.json)", flush=True)
      done.append(_row(run, "ok", report))
    else:
      pending.append((run, steps, error))

  if args.dry_run:
    for i, (run, _, error) in enumerate(pending):
      if error:
        print(f"# {run.label}: invalid config: {error}")
      elif args.launch:
        print(shlex.join(launcher_command(args.launch, sweep, run, launcher_args)))
      elif args.collect:
        print(_command(DeviceGroup(), eval_args(run)))
      else:  # the group each run would get if runs took equally long
        group = groups[i % len(groups)]
        print(_command(group, train_args(sweep, run)) + " && " + _command(group, eval_args(run)))
    return 0

  failures = 0
  for run, _, error in pending:
    if error:  # recorded without starting a process: train.py would refuse the same config
      run.run_dir.mkdir(parents=True, exist_ok=True)
      with (run.run_dir / "sweep.log").open("a") as f:
        f.write(f"\n== {time.strftime('%Y-%m-%d %H:%M:%S')} invalid config: {error}\n")
      print(f"{run.label}: FAILED, invalid config: {error}", flush=True)
      done.append(_row(run, "failed", error=f"invalid config: {error}"[:300]))
      failures += 1
  todo = [(run, steps) for run, steps, error in pending if not error]

  if args.launch:
    failures += _launch(args.launch, args.sweep, sweep, [run for run, _ in todo], launcher_args)
    if done:
      results.add(done)
    return 1 if failures else 0

  if args.collect:
    group = DeviceGroup()
    for run, steps in todo:
      reached = latest_step(run.run_dir)
      if reached == steps:
        print(f"{run.label}: evaluating (step {steps})", flush=True)
        row = execute(sweep, run, steps, group, evaluate_only=True)
      else:
        print(f"{run.label}: not finished (step {reached} of {steps})", flush=True)
        row = _row(run, "incomplete", {"step": reached if reached is not None else ""})
      failures += row["status"] != "ok"
      done.append(row)
  else:
    try:
      failures += _train_all(sweep, todo, groups, results, done)
    except KeyboardInterrupt:
      _say("interrupted: finished runs are in results.csv; run the same command again to resume the others",
           file=sys.stderr)
      return 130

  merged = results.add(done)
  summary = summarize(merged, list(sweep.variants))
  paths = plot(summary, sweep, sweep.run_root)
  print(markdown_table(summary), end="")
  print(f"results: {_rel(sweep.run_root / 'results.csv')}, results.md" + "".join(f", {p.name}" for p in paths))
  if failures:
    print(f"{failures} run(s) failed or unfinished; see each run's sweep.log", file=sys.stderr)
  return 1 if failures else 0


def _launch(kind: str, sweep_file: str, sweep: Sweep, runs: list[Run], launcher_args: list[str]) -> int:
  """Submit ``runs`` one launcher call each; returns the number of calls that failed."""
  failed = 0
  for run in runs:
    cmd = launcher_command(kind, sweep, run, launcher_args)
    _say(shlex.join(cmd))
    if subprocess.run(cmd, cwd=REPO).returncode != 0:
      _say(f"{run.label}: FAILED to submit")
      failed += 1
  if runs:
    _say(f"launched {len(runs) - failed} of {len(runs)} runs; when they have finished: "
         f"python scripts/sweep.py {sweep_file} --collect")
  if runs and kind == "tpu":
    bucket = (_bucket(launcher_args) or "gs://BUCKET/PATH").rstrip("/")
    _say("first copy each TPU run from the bucket into the sweep's layout:",
         *(f"  gcloud storage rsync -r {bucket}/{job_name(sweep, run)} {_rel(run.run_dir)}" for run in runs))
  return failed


def _train_all(sweep: Sweep, todo: list[tuple[Run, int]], groups: list[DeviceGroup], results: Results,
               done: list[dict]) -> int:
  """Train and evaluate ``todo``, as many at once as there are device groups; rows are merged into the table as
  each run ends. Returns the number of failed runs."""
  free: queue.Queue[DeviceGroup] = queue.Queue()
  for g in groups:
    free.put(g)
  total, failures = len(todo), 0

  def work(i: int, run: Run, steps: int) -> dict:
    group = free.get()
    try:
      where = f" on {group.label}" if group.label else ""
      _say(f"[{i}/{total}] {run.label}: training to step {steps}{where} (log: {_rel(run.run_dir / 'sweep.log')})")
      start = time.monotonic()
      row = execute(sweep, run, steps, group)
      took = time.monotonic() - start
      if row["status"] == "ok":
        _say(f"[{i}/{total}] {run.label}: val_loss {float(row['val_loss']):.4f} ({took:.0f} s)")
      else:
        _say(f"[{i}/{total}] {run.label}: FAILED ({row['error']})",
             *(f"    {line}" for line in _tail(run.run_dir / "sweep.log", 15)))
      results.add([row])
      return row
    finally:
      free.put(group)

  pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(groups))
  try:
    futures = [pool.submit(work, i, run, steps) for i, (run, steps) in enumerate(todo, 1)]
    for f in futures:
      row = f.result()
      done.append(row)
      failures += row["status"] != "ok"
  finally:
    # On Ctrl-C the runs in flight got the SIGINT too and save a checkpoint; start no queued one meanwhile.
    pool.shutdown(wait=True, cancel_futures=True)
  return failures


if __name__ == "__main__":
  sys.exit(main())
