"""Where data paths point: a relative ``data.path`` (or mixture path) is looked for in the working directory, then in
the data directory; the errors name every place tried and, for a path of the wrong kind (a prepared directory given as
a text file, or a text file as a prepared directory), the override that reads it."""

from __future__ import annotations

import os
from pathlib import Path

from jaxshare.config import DATA_DIR_ENV, REPO_ROOT, DataConfig
from jaxshare.data.errors import DataError
from jaxshare.data.shards import MANIFEST


_RULE = (f": a relative path is looked for in the working directory, then in the data directory (data.data_dir, "
         f"${DATA_DIR_ENV} or ../shared/data)")


def resolve_data_dir(cfg: DataConfig) -> Path:
  """The data directory, where relative data paths not found in the working directory are read from: data.data_dir,
  then $JAXSHARE_DATA_DIR, then ../shared/data beside the repository."""
  if cfg.data_dir:
    return Path(cfg.data_dir).expanduser()
  if os.environ.get(DATA_DIR_ENV):
    return Path(os.environ[DATA_DIR_ENV]).expanduser()
  return REPO_ROOT.parent / "shared" / "data"


def path_candidates(path: str, cfg: DataConfig) -> list[Path]:
  """Where a local data path is looked for, in order: an absolute path as it is; a relative one in the working
  directory (what the user typed, e.g. the ``--out`` of ``python -m jaxshare.data prepare`` run from there), then in
  the data directory (:func:`resolve_data_dir`, where corpus names such as the default
  ``tinyshakespeare.txt`` are found)."""
  p = Path(path).expanduser()
  return [p] if p.is_absolute() else [Path.cwd() / p, resolve_data_dir(cfg) / p]


def resolve_path(cfg: DataConfig, path: str | None = None) -> Path:
  """``data.path`` (or ``path``, e.g. a mixture component's) as a local path: the first of :func:`path_candidates`
  that exists, else the last one (whose error names every place tried: :func:`places_tried`)."""
  candidates = path_candidates(cfg.path if path is None else path, cfg)
  return next((c for c in candidates if c.exists()), candidates[-1])


def places_tried(cfg: DataConfig, path: str | None = None) -> str:
  """The places :func:`resolve_path` looked, for an error message: ``'a' nor 'b'``."""
  first, *rest = (str(c) for c in path_candidates(cfg.path if path is None else path, cfg))
  return repr(first) + "".join(f" nor {r!r}" for r in rest)


def source_file(cfg: DataConfig) -> Path:
  """The local text/JSONL file of ``cfg`` (:func:`resolve_path`), refused up front with a message naming
  ``data.path`` when it is missing (every place tried), a directory (a prepared one: the override that reads it) or
  empty. Its content is checked as it is read.

  Raises:
    DataError: as above.
  """
  path, what = resolve_path(cfg), "JSONL file" if cfg.source == "jsonl" else "text file"
  if not path.exists():
    rule = "" if Path(cfg.path).expanduser().is_absolute() else _RULE
    raise DataError(f"data.path={cfg.path!r}: the {what} does not exist (looked for {places_tried(cfg)}; expected "
                    f"a UTF-8 {what}){rule}")
  if (path / MANIFEST).is_file():
    raise DataError(f"data.path={cfg.path!r}: {str(path)!r} is a prepared directory (python -m jaxshare.data "
                    f"prepare), not a {what}: add data.source=prepared")
  if path.is_dir():
    raise DataError(f"data.path={cfg.path!r}: {str(path)!r} is a directory, not a {what}: data.source={cfg.source} "
                    "reads one file; tokenize a directory of files with python -m jaxshare.data prepare --out DIR "
                    "and train with data.source=prepared data.path=DIR")
  if not path.is_file():
    raise DataError(f"data.path={cfg.path!r}: {what} {str(path)!r} is not a regular file")
  with open(path, "rb") as f:
    if not f.read(1 << 20).strip() and path.stat().st_size <= 1 << 20:
      raise DataError(f"data.path={cfg.path!r}: {what} {str(path)!r} is empty (expected UTF-8 text)")
  return path


def prepared_location(cfg: DataConfig, path: str, field: str) -> str:
  """A prepared directory's location (``field``: the config field that names it, for errors): a URL (gs://...) as
  it is, a local path by :func:`resolve_path`.

  Raises:
    DataError: a local path that is nowhere (every place tried), or a file (with the override that reads a text or
      JSONL file).
  """
  if "://" in path:
    return path
  local = resolve_path(cfg, path)
  if not local.exists():
    rule = "" if Path(path).expanduser().is_absolute() else _RULE
    raise DataError(f"{field}={path!r}: the prepared directory does not exist (looked for {places_tried(cfg, path)}; "
                    f"python -m jaxshare.data prepare --out DIR writes one){rule}")
  if local.is_file():
    raise DataError(f"{field}={path!r}: {str(local)!r} is a file, not a prepared directory: train on a text file with "
                    "data.source=text (JSONL: data.source=jsonl), or prepare it with python -m jaxshare.data prepare")
  return str(local)
