"""The released vLLM and the lowest transformers the ``hf`` extra allows (issue 45), in the ``.vllm/`` environment
``make test`` installs beside the venv: tests/support/vllm_released_checks.py (the plugin inside vLLM 0.33's own engine
config, model runner, loader and KV-cache allocator) and tests/equivalence/test_remote_code.py (the remote code on
transformers 5.16.1; the main suite runs it on the newest) in one pytest process whose imports find ``.vllm/`` first."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import REPO

VLLM_ENV = REPO / ".vllm"
needs_vllm = pytest.mark.skipif(not (VLLM_ENV / ".installed").is_file(),
                                reason="vLLM is not installed beside the venv (make .vllm/.installed)")


@pytest.mark.longest
@needs_vllm
def test_the_plugin_in_released_vllm_and_the_remote_code_on_the_lowest_transformers():
  env = {**os.environ, "PYTHONPATH": str(VLLM_ENV), "VLLM_TARGET_DEVICE": "cpu"}
  env.pop("PYTEST_XDIST_WORKER", None)
  probe = subprocess.run([sys.executable, "-c", "import transformers, vllm; print(transformers.__version__, "
                          "vllm.__version__)"], env=env, capture_output=True, text=True, cwd=REPO)
  assert probe.stdout.split() == ["5.16.1", "0.33.0"], probe.stderr[-2000:]
  run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                        "tests/support/vllm_released_checks.py", "tests/equivalence/test_remote_code.py"],
                       env=env, capture_output=True, text=True, cwd=REPO, timeout=1800)
  summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
  assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
  assert re.search(r"\d+ passed", summary) and "skipped" not in summary, summary


@needs_vllm
def test_the_hf_and_vllm_extras_admit_the_versions_vllm_pins():
  """``jaxshare[hf,vllm]`` installs together: the ``hf`` extra admits vLLM's torch pin and its transformers floor,
  which is the ``hf`` extra's floor and the transformers ``.vllm/`` tests the remote code on."""
  import importlib.metadata
  import tomllib

  from packaging.requirements import Requirement

  extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
  hf = {r.name: r.specifier for r in map(Requirement, extras["hf"])}
  (vllm_req,) = map(Requirement, extras["vllm"])
  (dist,) = importlib.metadata.distributions(name="vllm", path=[str(VLLM_ENV)])
  assert vllm_req.specifier.contains(dist.version)
  pins = {r.name: r.specifier for r in map(Requirement, dist.requires) if r.marker is None}
  (torch_pin,) = pins["torch"]
  assert torch_pin.operator == "==" and hf["torch"].contains(torch_pin.version)
  floor = next(s.version for s in pins["transformers"] if s.operator == ">=")
  assert {str(s) for s in hf["transformers"]} == {f">={floor}"}
  (tested,) = importlib.metadata.distributions(name="transformers", path=[str(VLLM_ENV)])
  assert tested.version == floor
