"""The unit tier stays what `make check` promises (docs/testing.md, Tiers): no test in tests/unit/ trains a model,
starts a CLI or a process, or compiles for a TPU or GPU; those live in tests/integration/. Read from the sources, so
a test that comes to do so is named here before it slows the developer loop."""

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
# Modules whose import means a process, a training run or an accelerator compile.
_MODULES = {"subprocess": "starts a process", "multiprocessing": "starts a process",
            "jaxshare.train.loop": "trains a model", "jaxshare.aot": "compiles for a TPU or GPU"}
# Names whose use means the same: conftest's markers and session fixtures.
_NAMES = {"needs_libtpu": "compiles for a TPU", "needs_cuda_plugin": "compiles for a GPU",
          "needs_cudnn": "compiles for a GPU", "straight_run": "trains a model (conftest.straight_run)",
          "gcs": "starts a GCS server (conftest.gcs)", "OPTIMIZED_ENV": "starts a production-compiled process"}


def integration_reasons(path: Path) -> list[str]:
  """Why the test file at ``path`` belongs in tests/integration/: ``"line N: <what> (<reason>)"`` per finding."""
  tree = ast.parse(path.read_text(), str(path))
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      modules = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      modules = [node.module or ""]
      if modules[0].endswith("__main__") or modules[0] in ("train", "eval"):
        modules += [f"{modules[0]}.{alias.name}" for alias in node.names if alias.name == "main"]
    else:
      modules = []
    for module in modules:
      if module.endswith(".main") and (module.startswith(("train.", "eval.")) or "__main__" in module):
        found.append(f"line {node.lineno}: {module} (runs a CLI)")
      for banned, reason in _MODULES.items():
        if module == banned or module.startswith(banned + "."):
          found.append(f"line {node.lineno}: import {module} ({reason})")
    if isinstance(node, ast.Name) and node.id in _NAMES:
      found.append(f"line {node.lineno}: {node.id} ({_NAMES[node.id]})")
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
      found += [f"line {node.lineno}: fixture {arg.arg} ({_NAMES[arg.arg]})"
                for arg in node.args.args if arg.arg in _NAMES]
    if isinstance(node, ast.Attribute) and node.attr == "main" and isinstance(node.value, ast.Name) \
        and node.value.id in ("train", "eval_py", "eval"):
      found.append(f"line {node.lineno}: {node.value.id}.main (runs a CLI)")
  return found


@pytest.mark.parametrize("path", sorted((TESTS / "unit").rglob("test_*.py")), ids=lambda p: str(p.relative_to(TESTS)))
def test_unit_tests_train_nothing_and_start_nothing(path):
  assert not integration_reasons(path), f"{path.relative_to(TESTS)} belongs in tests/integration/: " \
    f"{integration_reasons(path)}"


@pytest.mark.parametrize("name, reason", [("train/test_train.py", "trains a model"),
                                          ("search/test_study.py", "starts a process"),
                                          ("aot/test_aot.py", "compiles for a TPU"),
                                          ("data/test_data_prepare.py", "runs a CLI"),
                                          ("test_files.py", "starts a GCS server")])
def test_the_check_names_what_the_integration_tests_do(name, reason):
  assert any(reason in found for found in integration_reasons(TESTS / "integration" / name))
