"""What the package's boundaries promise beside its import layers (tests/unit/test_layering.py), read from the
sources (issue 62): what a schedule kind means is decided in ``jaxshare.schedule`` alone (``parse_kind``), never by
testing the ``schedule.kind`` string elsewhere, where a substring test takes ``"uniattn"`` for a kind it is not part
of and an equality test misses composed kinds; and parameter and FLOP counts come from the run's plan, which carries
the width ``schedule.match_params`` gave the MLPs (``scripts/bench_train.py`` counted without it: 11% low); a config
is compiled into its plan once, where it comes into being, and initialisation, the run store and the model take
narrowed records, never the whole ``Config`` (plan_of had 33 call sites in 15 files, 12 functions there took a
``Config``)."""

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


# Where a config comes into being and is compiled, once (issue 62): the command lines' starts, a run directory's
# stored config, an HF directory's, a conversion's target, a search's candidate and a sweep's trial. Code below them
# takes the ModelPlan they built (a Run, a TrainSetup, a Conversion carry it) and never compiles a config again.
PLAN_DOORS = {
  "jaxshare/train/start.py": "train.py's run, once composed on its train.init_from source",
  "jaxshare/train/state.py": "a training setup started from a config alone (the fit check, benchmarks); a run's start "
                             "passes its plan",
  "jaxshare/store/runs.py": "a run directory's stored config (StoredFiles.planned)",
  "jaxshare/convert/hf_import.py": "an HF directory's config.json",
  "jaxshare/convert/uptrain.py": "a conversion's target config",
  "jaxshare/search/budget.py": "a search candidate's config (its footprint)",
  "jaxshare/sweep/spec.py": "a sweep trial's config",
}
PACKAGE = [*sorted((ROOT / "jaxshare").rglob("*.py")), ROOT / "train.py", ROOT / "eval.py"]


def plan_compilations(source: str) -> list[int]:
  """The lines of ``source`` that call ``plan_of``."""
  return sorted(node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
                and ((isinstance(node.func, ast.Name) and node.func.id == "plan_of")
                     or (isinstance(node.func, ast.Attribute) and node.func.attr == "plan_of")))


def test_configs_are_compiled_only_where_they_come_into_being():
  sites = {str(p.relative_to(ROOT)): plan_compilations(p.read_text()) for p in PACKAGE if p.name != "plan.py"}
  sites = {path: lines for path, lines in sites.items() if lines}
  elsewhere = {path: lines for path, lines in sites.items() if path not in PLAN_DOORS}
  assert not elsewhere, f"plan_of(cfg) below the doors (take the caller's ModelPlan): {elsewhere}"
  twice = {path: lines for path, lines in sites.items() if len(lines) > 1}
  assert not twice, f"a door compiles its config more than once: {twice}"
  assert len(sites) <= len(PLAN_DOORS) == 7


def test_the_scan_finds_each_plan_compilation():
  assert plan_compilations("from jaxshare.plan import plan_of\n"
                           "a = plan_of(cfg).schedule\n"
                           "import jaxshare.plan as P\n"
                           "b = P.plan_of(cfg)\n"
                           "c = compile_plan(cfg.model, cfg.schedule, cfg.attention)\n") == [2, 4]


NARROWED = ("init", "store", "model")  # packages that take narrowed records, never the whole Config


def whole_config_parameters(source: str) -> list[str]:
  """The parameters of ``source``'s functions annotated with the whole ``Config`` (alone or optional), or named
  ``cfg`` without an annotation."""
  found = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      for arg in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs):
        kind = ast.unparse(arg.annotation) if arg.annotation is not None else None
        whole = kind is not None and "Config" in [t.strip() for t in kind.split("|")]
        if whole or (kind is None and arg.arg == "cfg"):
          found.append(f"{node.name}({arg.arg})")
  return found


def test_init_store_and_model_take_no_whole_config():
  found = {str(p.relative_to(ROOT)): names for package in NARROWED
           for p in sorted((ROOT / "jaxshare" / package).rglob("*.py"))
           if (names := whole_config_parameters(p.read_text()))}
  assert not found, f"take a ModelPlan, InitRules, a config group or a Run instead of the whole Config: {found}"


def test_the_scan_finds_a_whole_config_parameter():
  assert whole_config_parameters("def a(cfg: Config): pass\n"
                                 "def b(x, src: Config | None = None): pass\n"
                                 "def c(cfg): pass\n"
                                 "def d(model: ModelConfig, plan: ModelPlan): pass\n") == ["a(cfg)", "b(src)", "c(cfg)"]
