"""Where a published number comes from: each result an experiment commits (``results/<experiment>/``) carries the
command that made it, the code's commit, the jax and flax versions, the date and the validation measure, so that a
table rendered from those files says at which code version each of its cells was measured."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from jaxshare.files import write_atomic


def code_version(repo: Path) -> dict:
  """``{"commit": HEAD's hash or None outside a git checkout, "dirty": tracked files differ from it}``."""
  def git(*args: str) -> str | None:
    try:
      return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
      return None

  commit = git("rev-parse", "HEAD")
  status = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)results")
  return {"commit": commit.strip() if commit else None, "dirty": bool(status and status.strip())}


def portable(command: Sequence[str], repo: Path) -> list[str]:
  """``command`` as a reader re-runs it from the repository root: the interpreter as ``python``, paths under
  ``repo`` relative to it."""
  out = []
  for arg in command:
    arg = "python" if arg == sys.executable else str(arg)
    if os.path.isabs(arg) and Path(arg).is_relative_to(repo):
      arg = str(Path(arg).relative_to(repo))
    out.append(arg)
  return out


def provenance(commands: Sequence[Sequence[str]], measure: str, repo: Path) -> dict:
  """The record of a result made by ``commands`` (run in order from ``repo``) and measured as ``measure`` (e.g. what
  eval.py computes, on which split)."""
  import flax
  import jax

  return {"commands": [portable(c, repo) for c in commands], **code_version(repo), "jax": jax.__version__,
          "flax": flax.__version__, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
          "measure": measure}


def script_command(script: str, argv: Sequence[str] | None) -> list[str]:
  """The command line that ran ``script`` (``scripts/<name>.py``, relative to the repository) with ``argv`` (None:
  this process's own arguments), as :func:`provenance` records it."""
  return [sys.executable, script, *(sys.argv[1:] if argv is None else argv)]


def short_version(record: dict) -> str:
  """The code version a :func:`provenance` record was measured at: the commit's short hash, ``+`` when the tree
  differed from it."""
  return (record["commit"] or "unknown")[:7] + ("+" if record["dirty"] else "")


def read_result(path: Path) -> dict | None:
  """A result file's content, None when there is none.

  Raises:
    ValueError: the file is not a JSON object (naming it).
  """
  if not path.exists():
    return None
  try:
    data = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"result file {path} is not valid JSON ({e}): restore it from git or delete it to re-run") from e
  if not isinstance(data, dict):
    raise ValueError(f"result file {path} holds a {type(data).__name__}, not a JSON object")
  return data


def write_result(path: Path, data: dict) -> None:
  """Write a result file whole (atomically: an interrupted experiment leaves the previous one), keys sorted, so that
  a re-run that changes nothing leaves git clean."""
  path.parent.mkdir(parents=True, exist_ok=True)
  write_atomic(path, json.dumps(data, indent=1, sort_keys=True) + "\n")


def publish_table(root: Path, lines: Sequence[str], commands: Sequence[Sequence[str]], measure: str,
                  repo: Path) -> None:
  """Write a markdown table a script printed (e.g. a benchmark's, whose cells are timings of one run) to
  ``root``/table.json with the provenance of the ``commands`` that made it: what :func:`render_table` publishes."""
  write_result(root / "table.json", {"lines": list(lines), "provenance": provenance(commands, measure, repo)})


def render_table(root: Path, repo: Path) -> list[str]:
  """``root``/table.json's table as it was printed, then a line naming the command, commit, date and measure.

  Raises:
    ValueError: ``root`` has no table.json.
  """
  data = read_result(root / "table.json")
  if data is None:
    raise ValueError(f"{root} has no table.json: a script run with --results {root} writes it")
  p = data["provenance"]
  where = root.relative_to(repo) if root.is_relative_to(repo) else root
  version = short_version(p)
  return [*data["lines"], "", f"Rendered by scripts/render_results.py from {where}/table.json: "
          + ", ".join(f"`{' '.join(c)}`" for c in p["commands"]) + f" at commit {version} on {p['date']} "
          f"(jax {p['jax']}); {p['measure']}."]
