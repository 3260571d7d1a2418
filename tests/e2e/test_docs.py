"""The README as a front door and docs/ as the reference (issue 27 part 8): README.md stays short; every relative link
in README.md and docs/*.md reaches an existing file (and heading); every repository path they name exists; every
command they show runs a script or module that exists, with a subcommand it defines; each command family is run by a
named test file; the configuration reference is scripts/config_reference.py's output. Reads files only."""

import importlib.util
import re
from pathlib import Path

from conftest import REPO

README = REPO / "README.md"
README_MAX_LINES = 350
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]

# Which test file runs each command family the docs show ("each command in it still tested"): a family is the script
# or module a command runs, with its subcommand; each entry names a test file and a string that file must contain
# (how it calls the command). Scripts that only test_scripts.py covers are imported by it, not run.
_IMPORTED = 'Path("scripts").glob("*.py")'
COMMAND_TESTS = {
  "train.py": [("tests/e2e/test_entry_points.py", "train.py"), ("tests/integration/aot/test_fit.py", "--compile-only")],
  "eval.py": [("tests/e2e/test_entry_points.py", "eval.py")],
  "eval.py generate": [("tests/e2e/test_entry_points.py", '"generate"'),
                       ("tests/integration/train/test_train.py", '"generate"')],
  "eval.py ppl": [("tests/integration/train/test_train.py", '"ppl"')],
  "eval.py efficiency": [("tests/integration/train/test_train.py", '"efficiency"')],
  "jaxshare.convert import": [("tests/e2e/test_entry_points.py", 'convert_cli("import"')],
  "jaxshare.convert export": [("tests/e2e/test_entry_points.py", 'convert_cli("export"')],
  "jaxshare.convert uptrain": [("tests/e2e/test_entry_points.py", 'convert_cli("uptrain"')],
  "jaxshare.convert ties": [("tests/integration/model/test_headwise.py", 'main(["ties"')],
  "jaxshare.analysis": [("tests/integration/analysis/test_analysis.py", "jaxshare.analysis.__main__")],
  "jaxshare.search": [("tests/e2e/test_search.py", "jaxshare.search.__main__")],
  "jaxshare.data prepare": [("tests/integration/data/test_data_prepare.py", 'main(["prepare"')],
  "jaxshare.evaluation.lm_eval_harness": [("tests/unit/evaluation/test_lm_eval.py",
                                            "jaxshare.evaluation.lm_eval_harness")],
  "jaxshare.sweep": [("tests/integration/sweep/test_sweep.py", '"jaxshare.sweep"')],
  "scripts/sweep.py": [("tests/e2e/test_scripts.py", _IMPORTED),
                       ("tests/integration/sweep/test_sweep.py", '"jaxshare.sweep"')],
  "scripts/uptrain_experiment.py": [("tests/e2e/test_uptrain_experiment.py", "uptrain_experiment.py")],
  "scripts/aot_compile.py": [("tests/integration/aot/test_aot.py", "scripts/aot_compile.py")],
  "scripts/fit_table.py": [("tests/integration/aot/test_aot.py", "scripts/fit_table.py")],
  "scripts/main_job.py": [("tests/e2e/test_scripts.py", "scripts/main_job.py")],
  "scripts/bench_train.py": [("tests/e2e/test_bench.py", "bench_train")],
  "scripts/bench_loop.py": [("tests/e2e/test_scripts.py", _IMPORTED)],
  "scripts/bench_compile.py": [("tests/e2e/test_scripts.py", _IMPORTED)],
  "scripts/bench_attention.py": [("tests/e2e/test_scripts.py", _IMPORTED)],
  "scripts/bench_mfu.py": [("tests/e2e/test_scripts.py", "bench_mfu.main")],
  "scripts/tune_attention.py": [("tests/e2e/test_scripts.py", "tune_attention.main")],
  "scripts/bench_decode.py": [("tests/e2e/test_scripts.py", _IMPORTED)],
  "scripts/hf_generate.py": [("tests/equivalence/test_remote_code.py", "hf_generate.py")],
  "scripts/vllm_generate.py": [("tests/e2e/test_scripts.py", _IMPORTED)],  # needs vLLM on a GPU
  "scripts/bench_convert.py": [("tests/e2e/test_scripts.py", _IMPORTED)],
  "scripts/bench_data.py": [("tests/e2e/test_scripts.py", "scripts/bench_data.py")],
  "scripts/config_reference.py": [("tests/e2e/test_docs.py", "config_reference.py")],
  "scripts/render_results.py": [("tests/e2e/test_results_render.py", "render_results")],
  "scripts/launch_tpu_pod.sh": [("tests/e2e/test_launchers.py", "launch_tpu_pod.sh")],
  "scripts/launch_slurm.sh": [("tests/e2e/test_launchers.py", "launch_slurm.sh")],
}

_FENCE = re.compile(r"^```.*?^```[ \t]*$", re.M | re.S)
_CODE_SPAN = re.compile(r"`[^`\n]+`")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
_PYTHON = re.compile(r"(?<![\w/.-])(?:\.venv/bin/)?python3?[ \t]+"
                     r"(?:-m[ \t]+(?P<module>[\w.]+)|(?P<script>[\w./-]+\.py))"
                     r"(?:[ \t]+(?P<sub>[a-z][\w-]*)(?![\w./=:-]))?")
_SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell)[ \t]*$(.*?)^```[ \t]*$", re.M | re.S)
_SHELL = re.compile(r"^[ \t]*(?P<script>scripts/[\w-]+\.sh)\b", re.M)
_PATH = re.compile(r"(?<![\w/.~:-])((?:jaxshare|scripts|tests|configs|docs)/[\w./*-]*[\w*/])(?:::(\w+))?")
# A file named in code: not inside a string literal's first character (data such as a path a test expects to be
# missing), ending in a file's suffix (not a prefix a format string completes).
_CODE_PATH = re.compile(r"(?<![\w/.~:\"'-])((?:jaxshare|scripts|tests|configs|docs)/[\w./*-]*"
                        r"\.(?:py|md|yaml|sh|json))\b")


def _text(page: Path) -> str:
  return page.read_text()


def _prose(text: str) -> str:
  """The text without fenced code blocks and code spans: what Markdown renders as links and headings."""
  return _CODE_SPAN.sub("", _FENCE.sub("", text))


def _slug(heading: str) -> str:
  """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
  text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").lower()
  return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
  seen: dict[str, int] = {}
  out = set()
  for _, heading in _HEADING.findall(_FENCE.sub("", _text(page))):
    slug = _slug(heading)
    n = seen.get(slug, 0)
    seen[slug] = n + 1
    out.add(slug if n == 0 else f"{slug}-{n}")
  return out


def _rel(path: Path) -> str:
  return str(path.relative_to(REPO))


def test_readme_is_short():
  n = len(README.read_text().splitlines())
  assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move reference text to docs/"


def _tables(text: str) -> dict[str, list[str]]:
  """Every Markdown table of ``text`` by its header line: the lines from the header to the first non-table line."""
  tables, lines = {}, text.splitlines()
  for i, line in enumerate(lines):
    if line.startswith("| ") and (i == 0 or not lines[i - 1].startswith("|")):
      rows = [line]
      for nxt in lines[i + 1:]:
        if not nxt.startswith("|"):
          break
        rows.append(nxt)
      tables[line] = rows
  return tables


def test_tables_the_readme_shares_with_results_md_agree():
  """The README repeats docs/results.md's measured tables: a re-run updates both, or this fails."""
  readme, results = _tables(README.read_text()), _tables((REPO / "docs" / "results.md").read_text())
  shared = readme.keys() & results.keys()
  assert any("uptrained" in header for header in shared), "the uptraining table is no longer in both"
  for header in shared:
    assert readme[header] == results[header], f"README.md and docs/results.md differ in the table {header!r}"


def test_every_docs_page_has_a_title_a_summary_and_a_link_from_the_readme():
  readme_links = {target.split("#")[0] for target in _LINK.findall(_prose(_text(README)))}
  for page in PAGES[1:]:
    lines = _text(page).splitlines()
    assert len(lines) > 2 and lines[0].startswith("# ") and not lines[1] and lines[2], \
      f"{_rel(page)} does not start with '# Title', a blank line and a summary"
    assert f"docs/{page.name}" in readme_links, f"README.md's reference index does not link docs/{page.name}"


def test_every_relative_link_resolves():
  broken = []
  for page in PAGES:
    for target in _LINK.findall(_prose(_text(page))):
      if re.match(r"^[a-z][a-z0-9+.-]*:", target):
        continue  # a URL
      path, _, anchor = target.partition("#")
      dest = (page.parent / path).resolve() if path else page
      if not dest.exists():
        broken.append(f"{_rel(page)}: {target} (no such file)")
      elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
        broken.append(f"{_rel(page)}: {target} (no heading #{anchor} in {_rel(dest)})")
      elif REPO not in dest.parents and dest != REPO:
        broken.append(f"{_rel(page)}: {target} (outside the repository)")
  assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_repository_path_named_exists():
  """A module moved or renamed leaves its old path in the docs; this names it."""
  missing = []
  for page in PAGES:
    for path, test_name in _PATH.findall(_text(page)):
      found = sorted(REPO.glob(path.rstrip("/"))) if "*" in path else [REPO / path]
      if not any(p.exists() for p in found):
        missing.append(f"{_rel(page)}: {path}")
      elif test_name and f"def {test_name}(" not in found[0].read_text():
        missing.append(f"{_rel(page)}: {path}::{test_name} (no such test)")
  assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(missing)


def test_every_repository_path_named_in_the_code_exists():
  """Docstrings, comments and messages in the package, scripts, tests, configs and the Makefile name files too (the
  test that proves a property, the script that measures it); a move leaves the old path behind there as well."""
  sources = [*(REPO / "jaxshare").rglob("*.py"), *(REPO / "scripts").glob("*.py"), *(REPO / "tests").rglob("*.py"),
             *(REPO / "configs").rglob("*.yaml"), REPO / "Makefile", REPO / "train.py", REPO / "eval.py"]
  missing = []
  for source in sources:
    for path in _CODE_PATH.findall(source.read_text()):
      if not any(REPO.glob(path)):
        missing.append(f"{_rel(source)}: {path}")
  assert not missing, "paths named in the code that do not exist:\n" + "\n".join(missing)


def _module_file(module: str) -> Path | None:
  """The file `python -m module` runs, if it is in the repository."""
  base = REPO.joinpath(*module.split("."))
  for candidate in (base.with_suffix(".py"), base / "__main__.py"):
    if candidate.is_file():
      return candidate
  return None


def _commands():
  """(page, family, file it runs or None, subcommand or None) for every command shown."""
  for page in PAGES:
    text = _text(page)
    for m in _PYTHON.finditer(text):
      if m["module"]:
        name, file = m["module"], _module_file(m["module"])
      else:
        name, file = m["script"], REPO / m["script"]
      yield page, name, file, m["sub"]
    for block in _SHELL_BLOCK.findall(text):  # a launcher run from a shell block
      for m in _SHELL.finditer(block):
        yield page, m["script"], REPO / m["script"], None


def test_every_command_shown_runs_an_existing_script_or_module():
  bad = []
  for page, name, file, sub in _commands():
    if name.split(".")[0] != "jaxshare" and not name.endswith((".py", ".sh")):
      if importlib.util.find_spec(name.split(".")[0]) is None:
        bad.append(f"{_rel(page)}: python -m {name} (no such module)")
      continue
    if file is None or not file.is_file():
      bad.append(f"{_rel(page)}: {name} ({'no file ' + _rel(file) if file else 'no module file'})")
      continue
    source = file.read_text()
    if sub and "add_parser(" in source and f'add_parser("{sub}"' not in source:
      bad.append(f"{_rel(page)}: {name} {sub} ({_rel(file)} defines no subcommand {sub!r})")
  assert not bad, "commands in the docs that cannot run:\n" + "\n".join(bad)


def test_every_command_family_shown_is_run_by_a_test():
  untested = []
  for page, name, file, sub in _commands():
    if file is None or name.split(".")[0] != "jaxshare" and not name.endswith((".py", ".sh")):
      continue
    family = f"{name} {sub}" if sub and f'add_parser("{sub}"' in file.read_text() else name
    if family not in COMMAND_TESTS:
      untested.append(f"{_rel(page)}: {family} (add it to COMMAND_TESTS with the test file that runs it)")
  for family, entries in COMMAND_TESTS.items():
    for test_file, needle in entries:
      path = REPO / test_file
      if not path.is_file():
        untested.append(f"COMMAND_TESTS[{family!r}]: {test_file} does not exist")
      elif needle not in path.read_text():
        untested.append(f"COMMAND_TESTS[{family!r}]: {test_file} does not contain {needle!r}")
  assert not untested, "\n".join(untested)


def test_configuration_reference_is_generated():
  spec = importlib.util.spec_from_file_location("config_reference", REPO / "scripts" / "config_reference.py")
  ref = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(ref)
  text = ref.DOC.read_text()
  assert ref.rewrite(text, ref.render()) == text, \
    "docs/configuration.md's field tables are stale: python scripts/config_reference.py --write"
