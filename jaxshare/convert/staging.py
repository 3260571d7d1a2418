"""HF directories on a bucket (``gs://``): safetensors memory-maps local files and transformers reads local ones, so an
import from a bucket first copies the directory to a local temporary one, and an export to a bucket is written to one
and then uploaded, ``config.json`` last: on the bucket, a directory that has its config is whole."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from etils import epath

from jaxshare.exit_codes import InputError
from jaxshare.files import is_remote, writable_dir

_CHUNK = 64 << 20  # bytes per read while streaming a file between the bucket and local disk


def _stream(src, dst) -> None:
  with src.open("rb") as r, dst.open("wb") as w:
    shutil.copyfileobj(r, w, _CHUNK)


@contextlib.contextmanager
def local_hf_input(path: str) -> Iterator[str]:
  """``path`` itself when local; for a bucket path, a local copy of the directory's files (HF directories are flat),
  removed on exit.

  Raises:
    InputError: ``path`` names no directory on the bucket.
  """
  if not is_remote(path):
    yield path
    return
  src = epath.Path(path)
  files = [f for f in src.iterdir() if f.is_file()] if src.is_dir() else []
  if not files:
    raise InputError(f"hf_dir={path}: no such HF directory on the bucket (no files under it)")
  with tempfile.TemporaryDirectory(prefix="jaxshare-hf-") as tmp:
    for f in files:
      _stream(f, Path(tmp) / f.name)
    yield tmp


@contextlib.contextmanager
def local_hf_output(path: str) -> Iterator[str]:
  """``path`` itself when local; for a bucket path (checked writable and empty first), a local temporary directory
  whose files are uploaded to ``path`` once the body succeeds, ``config.json`` last.

  Raises:
    InputError: the bucket cannot be written. FileExistsError: ``path`` holds files already.
  """
  if not is_remote(path):
    yield path
    return
  out = writable_dir(path, "hf_dir")
  if out.is_dir() and any(out.iterdir()):
    raise FileExistsError(f"output directory {path!r} exists and is not empty; choose a new one")
  with tempfile.TemporaryDirectory(prefix="jaxshare-hf-") as tmp:
    yield tmp
    for f in sorted(Path(tmp).iterdir(), key=lambda f: (f.name == "config.json", f.name)):
      _stream(f, out / f.name)
