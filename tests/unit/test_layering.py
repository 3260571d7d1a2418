"""The package's import graph is layered and acyclic (issue 27): every import of every module — at module level or
inside a function — points at the module's own layer or a lower one, and the module graph has no cycle.

Layers, lowest first: the config and schedule language (and what only needs a config); kernels, model and data;
run directories, checkpoints and initialisation from another model; the workflows (train, evaluation, convert,
analysis, sweep, ahead-of-time compilation); the command lines. Workflows other than training never import
``jaxshare.train``: reading a run needs no optimizer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = (
  ("foundation", ("jaxshare.config", "jaxshare.schedule", "jaxshare.cli_args", "jaxshare.allocator",
                  "jaxshare.distributed", "jaxshare.parallel", "jaxshare.accounting", "jaxshare.exit_codes",
                  "jaxshare.files", "jaxshare.smoke", "jaxshare.plan", "jaxshare.context")),
  ("model", ("jaxshare.kernels", "jaxshare.model", "jaxshare.data")),
  ("runs", ("jaxshare.store", "jaxshare.init")),
  ("workflows", ("jaxshare.train", "jaxshare.evaluation", "jaxshare.convert", "jaxshare.analysis", "jaxshare.sweep",
                 "jaxshare.aot", "jaxshare.search", "jaxshare.serve")),
  ("cli", ("train", "eval")),
)
NO_TRAIN = ("jaxshare.evaluation", "jaxshare.convert", "jaxshare.analysis", "jaxshare.sweep", "jaxshare.search",
            "jaxshare.serve", "eval")


def _modules() -> dict[str, Path]:
  mods = {"train": ROOT / "train.py", "eval": ROOT / "eval.py"}
  for f in (ROOT / "jaxshare").rglob("*.py"):
    parts = list(f.relative_to(ROOT).with_suffix("").parts)
    mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
  return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
  """The package modules ``name`` imports anywhere in its source (``from a import b`` counts ``a.b`` when that is a
  module, else ``a``)."""
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
      targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    else:
      continue
    for t in targets:
      while t and t not in mods:
        t = t.rpartition(".")[0]
      if t and t != name:
        found.add(t)
  return found


def _layer(name: str) -> int:
  if name.endswith(".__main__"):
    return len(LAYERS) - 1
  if name == "jaxshare":  # the package's own __init__ (its version)
    return 0
  best = max(((len(prefix), i) for i, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
              if name == prefix or name.startswith(prefix + ".")), default=None)
  if best is None:
    raise AssertionError(f"module {name} is in no layer: add it to LAYERS in {__file__}")
  return best[1]


GRAPH = {name: _imports(name, path, _modules()) for name, path in _modules().items()}


def test_every_module_is_in_a_layer():
  for name in GRAPH:
    _layer(name)


@pytest.mark.parametrize("name", sorted(GRAPH))
def test_imports_point_down(name):
  up = [f"{t} ({LAYERS[_layer(t)][0]})" for t in sorted(GRAPH[name]) if _layer(t) > _layer(name)]
  assert not up, f"{name} ({LAYERS[_layer(name)][0]}) imports a higher layer: {', '.join(up)}"


@pytest.mark.parametrize("name", sorted(n for n in GRAPH if n.startswith(NO_TRAIN)))
def test_workflows_read_runs_without_the_training_package(name):
  train = sorted(t for t in GRAPH[name] if t == "jaxshare.train" or t.startswith("jaxshare.train."))
  assert not train, f"{name} imports {train}: read runs through jaxshare.store.runs"


def test_no_import_cycle():
  state: dict[str, int] = {}  # 1: on the current path, 2: done

  def visit(node: str, path: list[str]) -> None:
    state[node] = 1
    for t in sorted(GRAPH.get(node, ())):
      if state.get(t) == 1:
        cycle = path[path.index(t):] + [t]
        raise AssertionError("import cycle: " + " -> ".join(cycle))
      if t not in state:
        visit(t, path + [t])
    state[node] = 2

  for name in sorted(GRAPH):
    if name not in state:
      visit(name, [name])


@pytest.mark.parametrize("name", ["jaxshare.model.attention", "jaxshare.model.block", "jaxshare.model.transformer"])
def test_layers_run_attention_only_through_the_dispatch(name):
  """Every attention computation of a layer (own scores, consumer, reuse, materialise, LISA, decode, prefill) goes
  through the one :class:`~jaxshare.kernels.dispatch.AttentionOps` that ``attention.impl`` chooses: the modules that
  build layers import no kernel module but the dispatch."""
  kernels = sorted(t for t in GRAPH[name] if t.startswith("jaxshare.kernels") and t != "jaxshare.kernels.dispatch")
  assert not kernels, f"{name} calls kernels beside the dispatch: {kernels}"
