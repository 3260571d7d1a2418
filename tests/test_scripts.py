"""Every script in scripts/ imports: a name moved or removed elsewhere breaks a script no other test runs end to end
(uptrain_experiment.py imported three names that the sweep rewrite had removed)."""

import subprocess
import sys

from conftest import REPO

_IMPORT_ALL = """
import importlib.util, pathlib, sys
sys.path.insert(0, "scripts")
for path in sorted(pathlib.Path("scripts").glob("*.py")):
  spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
  spec.loader.exec_module(importlib.util.module_from_spec(spec))  # main() stays behind its __main__ guard
  print(path.name)
"""


def test_every_script_imports():
  proc = subprocess.run([sys.executable, "-c", _IMPORT_ALL], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert set(proc.stdout.split()) == {p.name for p in (REPO / "scripts").glob("*.py")}
