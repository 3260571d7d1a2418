"""What the package's boundaries promise beside its import layers (tests/unit/test_layering.py), read from the
sources (issue 62): what a schedule kind means is decided in ``jaxshare.schedule`` alone (``parse_kind``), never by
testing the ``schedule.kind`` string elsewhere, where a substring test takes ``"uniattn"`` for a kind it is not part
of and an equality test misses composed kinds; and parameter and FLOP counts come from the run's plan, which carries
the width ``schedule.match_params`` gave the MLPs (``scripts/bench_train.py`` counted without it: 11% low)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [p for p in sorted((ROOT / "jaxshare").rglob("*.py")) if "schedule" not in p.relative_to(ROOT).parts[:2]]
SOURCES += [ROOT / "train.py", ROOT / "eval.py", *sorted((ROOT / "scripts").glob("*.py"))]


def _reads_schedule_kind(node: ast.AST) -> bool:
  """Whether ``node`` reads ``<something>.schedule.kind`` (directly or through a call on it, as ``.split("+")``)."""
  return any(isinstance(n, ast.Attribute) and n.attr == "kind" and isinstance(n.value, ast.Attribute)
             and n.value.attr == "schedule" for n in ast.walk(node))


def kind_string_tests(source: str) -> list[int]:
  """The lines of ``source`` that compare a ``schedule.kind`` with a string."""
  lines = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Compare):
      operands = [node.left, *node.comparators]
      strings = any(isinstance(o, ast.Constant) and isinstance(o.value, str) for o in operands)
      if strings and any(_reads_schedule_kind(o) for o in operands):
        lines.append(node.lineno)
  return lines


def test_schedule_kinds_are_not_tested_as_strings_outside_the_schedule_package():
  found = [f"{path.relative_to(ROOT)}:{line}" for path in SOURCES for line in kind_string_tests(path.read_text())]
  assert not found, f"schedule.kind compared with a string (ask jaxshare.schedule.parse_kind): {found}"


def test_the_scan_finds_each_form_of_kind_string_test():
  assert kind_string_tests('"cla" in cfg.schedule.kind.split("+")\n'
                           'if "uniattn" not in cfg.schedule.kind: pass\n'
                           'ok = src.schedule.kind != "dense"\n'
                           'fine = parse_kind(cfg.schedule.kind).dense\n') == [1, 2, 3]


# Counts that depend on the MLP width schedule.match_params gives (jaxshare.plan.ModelPlan passes its match).
WIDTH_DEPENDENT = {"mlp_dim", "param_count", "forward_flops_per_token", "train_flops_per_token"}


def width_counts_without_a_plan(source: str) -> list[int]:
  """The lines of ``source`` that call a width-dependent ``jaxshare.accounting`` function directly."""
  tree = ast.parse(source)
  imported = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
              and node.module == "jaxshare.accounting" for alias in node.names if alias.name in WIDTH_DEPENDENT}
  lines = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Call):
      fn = node.func
      if (isinstance(fn, ast.Attribute) and fn.attr in WIDTH_DEPENDENT and isinstance(fn.value, ast.Name)
          and fn.value.id == "accounting") or (isinstance(fn, ast.Name) and fn.id in imported):
        lines.append(node.lineno)
  return lines


def test_width_dependent_counts_come_from_the_plan():
  callers = [p for p in SOURCES if p != ROOT / "jaxshare" / "plan.py"]
  found = [f"{path.relative_to(ROOT)}:{line}" for path in callers for line in width_counts_without_a_plan(
    path.read_text())]
  assert not found, f"parameter or FLOP counts without the run's width match (use plan_of(cfg).<count>): {found}"


def test_the_scan_finds_a_count_without_its_plan():
  assert width_counts_without_a_plan("from jaxshare import accounting\n"
                                     "f = accounting.train_flops_per_token(cfg.model, schedule, 128)\n"
                                     "b = accounting.kv_cache_bytes_per_token(cfg.model, schedule)\n"
                                     "from jaxshare.accounting import param_count as pc\n"
                                     "n = pc(cfg.model, schedule)\n") == [2, 5]
