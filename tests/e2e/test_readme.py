"""The README and docs/ as a new user runs them (issue 43): every fenced shell block of README.md, then of each docs/
page, runs verbatim and in order in a scratch copy of the repository beside ``../shared`` (the tour used to break:
paths that did not connect, a checkpoint that is never kept, a missing ``tensorboard``, placeholders such as
``HF_DIR``). Commands run through bash with the state one command leaves for the next (``source``, ``cd``, exported
variables); a server command (``tensorboard``) must serve a page, then is stopped.

The only change is ``JAXSHARE_SMOKE=1`` (jaxshare/smoke.py, documented in the README): every training run trains a
narrow model on small batches for the same steps (so every checkpoint and path the docs name exists), and experiment
drivers run one seed of one variant. What is not run: ``make test`` (this suite), and blocks marked
``<!-- not run here: REASON -->`` on the line before them (a GPU, a cloud project, a cluster): NOT_HERE lists the
reasons a block may give. A page's ``gs://my-bucket`` is served by a real GCS server on loopback (fake-gcs-server).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import REPO, cpu_env

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Commands shown but not run here, and why.
NOT_RUN = {"make test": "the whole test suite: the command that runs this test"}
# Why a block may be marked not to run on this machine: <!-- not run here: REASON -->.
NOT_HERE = ("needs an NVIDIA GPU", "needs vLLM on a GPU", "needs a Google Cloud project", "needs a Slurm cluster")
# Commands that serve until stopped: the output line that says they serve, with their address.
SERVERS = {"tensorboard": re.compile(r"TensorBoard \S+ at (http://\S+)")}
_BLOCK = re.compile(r"^```(?:bash|sh|shell)[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
_MARK = re.compile(r"<!-- not run here: (.+?) -->\s*$")


def shell_blocks(page: Path) -> list[tuple[int, str, str | None]]:
  """``(line, block, reason it is not run here or None)`` for every fenced bash block of ``page``."""
  text = page.read_text()
  out = []
  for m in _BLOCK.finditer(text):
    before = text[:m.start()].rstrip().rsplit("\n", 1)[-1]
    mark = _MARK.search(before)
    out.append((text.count("\n", 0, m.start()) + 1, m.group(1), mark.group(1) if mark else None))
  return out


def commands(block: str) -> list[str]:
  """The block's commands: continuation lines joined, comment-only and blank lines dropped."""
  lines, out, current = block.splitlines(), [], ""
  for line in lines:
    current += line
    if current.endswith("\\"):
      current = current[:-1]
      continue
    if current.strip() and not current.lstrip().startswith("#"):
      out.append(current.strip())
    current = ""
  return out


def _installed_beside(root: Path) -> None:
  """What ``make`` installs, seen from the copy: ``.venv`` as this interpreter's environment (its bin and lib linked,
  pyvenv.cfg copied) and the repository's ``.libtpu`` / ``.jaxcuda`` linked, with ``make``'s marks dated so that it
  finds them installed (pyproject.toml older than ``.venv/.installed``, older than theirs) and installs nothing."""
  venv, real = root / ".venv", Path(sys.prefix)
  venv.mkdir()
  for name in ("bin", "lib", "lib64", "include"):
    if (real / name).exists():
      (venv / name).symlink_to(real / name)
  shutil.copy2(real / "pyvenv.cfg", venv / "pyvenv.cfg")
  (venv / ".installed").touch()
  os.utime(root / "pyproject.toml", (1, 1))
  os.utime(venv / ".installed", (2, 2))
  for name in (".libtpu", ".jaxcuda"):
    if (REPO / name / ".installed").is_file():
      (root / name).symlink_to(REPO / name)


def _repository_files() -> list[str]:
  """The repository's files as a fresh clone has them, and what is new but not ignored (git's view; without git,
  everything but what make and the runs write)."""
  try:
    return subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.splitlines()
  except (OSError, subprocess.CalledProcessError):
    skip = {".git", ".venv", ".libtpu", ".jaxcuda", ".vllm", "runs", "__pycache__", ".pytest_cache", "bench"}
    return [str(p.relative_to(REPO)) for p in REPO.rglob("*") if p.is_file()
            and not skip.intersection(p.relative_to(REPO).parts)]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
  """A copy of the repository's files beside a link to ``../shared``."""
  root = tmp_path_factory.mktemp("new_user")
  for name in _repository_files():
    if (REPO / name).is_file():
      (root / "jaxshare" / name).parent.mkdir(parents=True, exist_ok=True)
      shutil.copy2(REPO / name, root / "jaxshare" / name)
  (root / "shared").symlink_to(REPO.parent / "shared")
  _installed_beside(root / "jaxshare")
  return root / "jaxshare"


class Shell:
  """Runs commands one after another in bash, each starting from the variables and directory the last one left."""

  def __init__(self, cwd: Path, env: dict[str, str]):
    self.cwd, self.env = cwd, env
    self.state = cwd.parent / ".shell_state"
    self.state.write_text("")

  def _script(self, command: str) -> str:
    return (f"source {self.state} 2>/dev/null; cd \"$__CWD\" 2>/dev/null\n{command}\nrc=$?\n"
            f"__CWD=\"$PWD\"; export __CWD; export -p > {self.state}; exit $rc\n")

  def run(self, command: str, where: str = "", timeout: int = 900) -> None:
    """Run ``command`` (shown at ``where``, e.g. ``README.md:44``); fails unless it exits 0."""
    started = time.perf_counter()
    name = command.split()[0]
    if name in SERVERS:
      self._serve(command, SERVERS[name])
    else:
      done = subprocess.run(["bash", "-c", self._script(command)], cwd=self.cwd, env=self.env, capture_output=True,
                            text=True, timeout=timeout)
      assert done.returncode == 0, (f"{where} `{command}` exited {done.returncode}:\n--- stdout\n"
                                    f"{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}")
    print(f"{time.perf_counter() - started:6.1f} s  {command}", file=sys.stderr, flush=True)  # seen with pytest -s

  def _serve(self, command: str, ready: re.Pattern) -> None:
    """Start a server command, wait for its address, fetch its page, stop it."""
    proc = subprocess.Popen(["bash", "-c", f"source {self.state} 2>/dev/null; cd \"$__CWD\" 2>/dev/null; "
                             f"exec {command}"], cwd=self.cwd, env=self.env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen = []
    try:
      deadline = time.monotonic() + 120
      for line in proc.stdout:
        seen.append(line)
        if m := ready.search(line):
          with urllib.request.urlopen(m.group(1), timeout=30) as page:
            assert page.status == 200
          return
        assert time.monotonic() < deadline, f"`{command}` did not serve within 120 s:\n{''.join(seen)[-3000:]}"
      raise AssertionError(f"`{command}` exited {proc.wait()} before serving:\n{''.join(seen)[-3000:]}")
    finally:
      os.killpg(proc.pid, signal.SIGTERM)
      proc.wait(timeout=30)


@pytest.fixture(scope="module")
def shell(checkout, tmp_path_factory, gcs) -> Shell:
  """The user's shell; the docs' gs://my-bucket is a real GCS server on loopback (the gcs fixture)."""
  gcs.make_bucket("my-bucket")
  env = {**cpu_env(1), **gcs.env(), "JAXSHARE_SMOKE": "1",
         "JAXSHARE_TOKEN_CACHE": str(tmp_path_factory.mktemp("tokens"))}
  env.pop("PYTHONPATH", None)  # as a user's shell has it: the copy's own files, found from where commands run
  return Shell(checkout, env)


def test_every_not_run_command_and_mark_is_one_the_docs_show():
  shown = [c for page in PAGES for _, block, _ in shell_blocks(page) for c in commands(block)]
  assert all(any(c.startswith(cmd) for c in shown) for cmd in NOT_RUN), "NOT_RUN names a command no page shows"
  marks = {reason for page in PAGES for _, _, reason in shell_blocks(page) if reason}
  assert marks <= set(NOT_HERE), f"blocks marked not to run for reasons NOT_HERE does not list: {marks - set(NOT_HERE)}"


@pytest.mark.slow
@pytest.mark.longest
def test_the_readme_then_each_docs_page_runs_verbatim_in_order(shell):
  """One test, not one per page: a page's commands start from what the README's left (its runs, its exports), so
  they run in this order in one copy, whichever test process runs them."""
  for page in PAGES:
    for line, block, reason in shell_blocks(page):
      if reason:
        continue
      for command in commands(block):
        if not any(command.startswith(cmd) for cmd in NOT_RUN):
          shell.run(command, f"{page.relative_to(REPO)}:{line}")


def test_the_tours_override_example_builds_the_model_its_words_name():
  """The tour's MLKV example once left schedule.kv_heads at 0 (every head) and built exactly CLA2. Its overrides, as
  the README shows them, must give the KV cache the text beside it states."""
  from jaxshare import accounting
  from jaxshare.config import load_config
  from jaxshare.schedule import compile_schedule

  command = next(c for _, block, _ in shell_blocks(REPO / "README.md") for c in commands(block)
                 if "schedule.kind=mlkv" in c and "train.py" in c)
  experiment = REPO / re.search(r"--config (\S+)", command).group(1)
  mlkv = load_config(experiment, [o for o in command.split() if "=" in o])
  kv = {c.schedule.kind: accounting.kv_cache_bytes_per_token(c.model, compile_schedule(c.model, c.schedule), 4)
        for c in (mlkv, load_config(experiment))}
  assert kv["mlkv"] < kv["cla"]
  words = " ".join((REPO / "README.md").read_text().split())
  assert f"a KV cache of {kv['mlkv']:,} bytes per token against CLA2's {kv['cla']:,}" in words
