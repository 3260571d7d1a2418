"""Writing converted parameters as a jaxshare run directory: ``config.yaml``, an orbax checkpoint of the parameters
at step 0 and the tokenizer, so that ``train.py train.init_from=<dir>``, ``eval.py`` and the analysis CLI
read it like a trained run."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from jaxshare.config import Config, to_yaml
from jaxshare.convert.mapping import UnsupportedModelError
from jaxshare.train.checkpoint import save_params

TOKENIZER_DIR = "tokenizer"


def write_run(run_dir: str | Path, cfg: Config, params: dict, *, tokenizer_files: Sequence[Path] = (),
              meta: dict | None = None) -> Path:
  """Save ``params`` (pure dict, NumPy or JAX arrays) as run directory ``run_dir`` at step 0.

  The tokenizer files are copied to ``<run_dir>/tokenizer`` and ``data.tokenizer`` points there; without any the
  run keeps the byte tokenizer, which needs ``model.vocab_size >= 256``.

  Raises:
    UnsupportedModelError: no tokenizer files and a vocabulary smaller than the byte tokenizer's.
    FileExistsError: ``run_dir`` exists and is not empty (nothing is overwritten).
  """
  run_dir = Path(run_dir).absolute()
  if run_dir.exists() and any(run_dir.iterdir()):
    raise FileExistsError(f"run directory {str(run_dir)!r} exists and is not empty; choose a new one")
  if not tokenizer_files and cfg.data.tokenizer == "byte" and cfg.model.vocab_size < 256:
    raise UnsupportedModelError(f"the checkpoint has no tokenizer files and model.vocab_size={cfg.model.vocab_size} "
                                "is smaller than the byte tokenizer's 256")
  run_dir.mkdir(parents=True, exist_ok=True)
  if tokenizer_files:
    (run_dir / TOKENIZER_DIR).mkdir()
    for f in tokenizer_files:
      shutil.copy2(f, run_dir / TOKENIZER_DIR / f.name)
    cfg.data.tokenizer = str(run_dir / TOKENIZER_DIR)
  cfg.train.run_dir = str(run_dir)
  (run_dir / "config.yaml").write_text(to_yaml(cfg))
  # parameters only (no optimizer moments: two more copies of the model); load_run and train.init_from read just
  # the parameters, and a run resumed in this directory starts a fresh optimizer (train/loop.py)
  save_params(run_dir / "checkpoints", 0, params, {"step": 0, "stage": 0, **(meta or {})})
  return run_dir
