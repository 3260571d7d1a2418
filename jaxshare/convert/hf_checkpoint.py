"""A local Hugging Face model directory, read lazily and only through safetensors.

Layout: ``config.json``; weights in ``model.safetensors`` or sharded as ``model.safetensors.index.json`` plus the
shards it names; tokenizer files beside them. Tensors are read one at a time (safetensors maps the file; a tensor is
materialised only when asked for), so converting a checkpoint needs memory for one tensor, not for the model.
Nothing is unpickled: a directory with only ``pytorch_model.bin`` / ``*.pt`` weights is refused with the command that
converts it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
import safetensors

from jaxshare.exit_codes import InputError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt")
_TOKENIZER_CORE = ("tokenizer.json", "tokenizer.model", "vocab.json")  # without one of these there is no tokenizer
_PICKLE_PATTERNS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt")
# safetensors dtype names -> numpy dtypes (bf16 through ml_dtypes, which JAX depends on)
_DTYPES = {"F32": "float32", "F16": "float16", "BF16": ml_dtypes.bfloat16, "F64": "float64", "I64": "int64",
           "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


class HFCheckpointError(InputError, ValueError):
  """A Hugging Face directory that cannot be read: missing or pickle-only weights, a truncated or malformed
  safetensors file, an index naming absent shards, or tensors that are missing, unexpected or mis-shaped."""


class HFCheckpoint:
  """The ``config.json`` and safetensors weights of a local HF directory.

  Args:
    directory: the HF model directory (never downloaded).

  Raises:
    HFCheckpointError: no ``config.json``; no safetensors weights (pickle-only directories are refused with the
      conversion command); an index that names missing shards; a shard whose header is truncated or malformed, or
      whose data is shorter than its header says.
  """

  def __init__(self, directory: str | Path):
    self.directory = Path(directory)
    if not self.directory.is_dir():
      raise HFCheckpointError(f"HF directory {str(self.directory)!r} does not exist")
    config_path = self.directory / "config.json"
    if not config_path.is_file():
      raise HFCheckpointError(f"{str(self.directory)!r} has no config.json: not a Hugging Face model directory")
    try:
      self.config: dict = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
      raise HFCheckpointError(f"{config_path} is not valid JSON: {e}") from e
    self._file_of = self._locate_weights()
    self._headers = {f: _read_header(self.directory / f) for f in sorted(set(self._file_of.values()))}
    for name, file in self._file_of.items():
      if name not in self._headers[file]:
        raise HFCheckpointError(f"{INDEX_FILE} places tensor {name!r} in {file}, which does not contain it")
    self._open: dict[str, object] = {}

  def _locate_weights(self) -> dict[str, str]:
    index = self.directory / INDEX_FILE
    if index.is_file():
      try:
        weight_map = json.loads(index.read_text())["weight_map"]
      except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise HFCheckpointError(f"{index} is malformed (expected a JSON object with a 'weight_map'): {e}") from e
      missing = sorted({f for f in weight_map.values() if not (self.directory / f).is_file()})
      if missing:
        raise HFCheckpointError(f"{INDEX_FILE} names shards that are not in {str(self.directory)!r}: {missing}")
      return dict(weight_map)
    single = self.directory / SINGLE_FILE
    if single.is_file():
      return {name: SINGLE_FILE for name in _read_header(single)}
    pickles = sorted(p.name for pat in _PICKLE_PATTERNS for p in self.directory.glob(pat))
    if pickles:
      raise HFCheckpointError(
        f"{str(self.directory)!r} has only pickle weights ({', '.join(pickles)}); jaxshare reads weights through "
        f"safetensors only and never unpickles files. Convert them where you trust the file, e.g. "
        f"`python -c \"from transformers import AutoModelForCausalLM as M; "
        f"M.from_pretrained('{self.directory}').save_pretrained('{self.directory}-safetensors')\"`")
    raise HFCheckpointError(f"{str(self.directory)!r} has no weights: expected {SINGLE_FILE} or {INDEX_FILE}")

  @property
  def architecture(self) -> str:
    """``config.json``'s ``architectures[0]`` (e.g. ``LlamaForCausalLM``), else its ``model_type``."""
    archs = self.config.get("architectures") or []
    return archs[0] if archs else str(self.config.get("model_type", ""))

  def names(self) -> list[str]:
    """Every tensor name, sorted."""
    return sorted(self._file_of)

  def spec(self, name: str) -> tuple[tuple[int, ...], np.dtype]:
    """``(shape, dtype)`` of a tensor from the file header, without reading it.

    Raises:
      HFCheckpointError: no such tensor.
    """
    if name not in self._file_of:
      raise HFCheckpointError(f"tensor {name!r} is missing from {str(self.directory)!r}")
    entry = self._headers[self._file_of[name]][name]
    return tuple(entry["shape"]), _numpy_dtype(entry["dtype"], name)

  def read(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """One tensor as a NumPy array in its stored dtype (``bfloat16`` via ml_dtypes).

    Args:
      shape: the shape the caller expects; a different stored shape is an error naming both.

    Raises:
      HFCheckpointError: missing tensor (with the expected shape, when given) or wrong shape.
    """
    if shape is not None and name not in self._file_of:
      raise HFCheckpointError(f"tensor {name!r} is missing from {str(self.directory)!r}: expected shape "
                              f"{list(shape)} in {', '.join(k for k in _DTYPES if k.startswith(('F', 'BF')))}")
    stored, dtype = self.spec(name)
    if shape is not None and tuple(shape) != stored:
      raise HFCheckpointError(f"tensor {name!r} has shape {list(stored)} ({dtype}) in {str(self.directory)!r}, "
                              f"expected {list(shape)}")
    file = self._file_of[name]
    if file not in self._open:  # one memory-mapped handle per shard, opened on first use
      self._open[file] = safetensors.safe_open(self.directory / file, framework="flax")
    return np.asarray(self._open[file].get_tensor(name))

  def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, array)`` for every tensor, one at a time, in name order."""
    for name in self.names():
      yield name, self.read(name)

  def tokenizer_files(self) -> list[Path]:
    """The tokenizer files present (``tokenizer.json`` etc.); none unless a vocabulary file is among them."""
    if not any((self.directory / f).is_file() for f in _TOKENIZER_CORE):
      return []
    return [self.directory / f for f in TOKENIZER_FILES if (self.directory / f).is_file()]


def _numpy_dtype(code: str, name: str) -> np.dtype:
  if code not in _DTYPES:
    raise HFCheckpointError(f"tensor {name!r} has dtype {code}, which jaxshare does not read; allowed: "
                            f"{', '.join(_DTYPES)}")
  return np.dtype(_DTYPES[code])


def _read_header(path: Path) -> dict[str, dict]:
  """The tensor entries of a safetensors header (``{name: {dtype, shape, data_offsets}}``), checked against the
  file's size so that a truncated download is caught before any tensor is read."""
  size = path.stat().st_size
  with open(path, "rb") as f:
    head = f.read(8)
    if len(head) < 8:
      raise HFCheckpointError(f"{path} is truncated: {size} bytes, shorter than a safetensors header")
    (n,) = struct.unpack("<Q", head)
    if n > size - 8:
      raise HFCheckpointError(f"{path} is truncated or not safetensors: its header claims {n} bytes, the file has "
                              f"{size}")
    try:
      header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise HFCheckpointError(f"{path} has a malformed safetensors header: {e}") from e
  header.pop("__metadata__", None)
  end = max((e["data_offsets"][1] for e in header.values()), default=0)
  if 8 + n + end > size:
    raise HFCheckpointError(f"{path} is truncated: its tensors need {8 + n + end} bytes, the file has {size}")
  return header
