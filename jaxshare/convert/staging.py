"""HF directories on a bucket (``gs://``): safetensors memory-maps local files and transformers reads local ones, so an
import from a bucket first copies the directory to a local temporary one, and an export to a bucket is written to one
and then uploaded, ``config.json`` last: on the bucket, a directory that has its config is whole."""

from __future__ import annotations

import contextlib
import tempfile
from typing import Iterator

from etils import epath

from jaxshare.exit_codes import InputError
from jaxshare.files import copy_files, is_remote, writable_dir


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
  if not epath.Path(path).is_dir():
    raise InputError(f"hf_dir={path}: no such HF directory on the bucket (no files under it)")
  with tempfile.TemporaryDirectory(prefix="jaxshare-hf-") as tmp:
    copy_files(path, tmp)
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
    copy_files(tmp, out, last=("config.json",))
