"""A local Hugging Face checkpoint as a jaxshare model: config, schedule and parameters."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np

from jaxshare.config import load_config
from jaxshare.convert import hf_config, remote
from jaxshare.convert.hf_checkpoint import HFCheckpoint
from jaxshare.convert.llama import LLAMA
from jaxshare.convert.mapping import Architecture, Dims, UnsupportedModelError, hf_to_params
from jaxshare.convert.neox import NEOX
from jaxshare.plan import ModelPlan, plan_of
from jaxshare.store.runs import Run, abstract_params

ARCHITECTURES: tuple[Architecture, ...] = (LLAMA, NEOX)


def architecture_for(ckpt: HFCheckpoint) -> Architecture:
  """The table for a checkpoint's ``architectures[0]`` (or ``model_type``).

  Raises:
    UnsupportedModelError: not a supported architecture; lists the supported ones.
  """
  names = {ckpt.architecture, str(ckpt.config.get("model_type", ""))}
  for arch in ARCHITECTURES:
    if names & set(arch.hf_names):
      return arch
  supported = sorted(n for a in ARCHITECTURES for n in a.hf_names if n[0].isupper())
  raise UnsupportedModelError(f"config.json architectures={ckpt.architecture!r} is not supported; supported: "
                              f"{', '.join(supported)}")


def dims(plan: ModelPlan) -> Dims:
  """The :class:`Dims` of the model of ``plan`` when uniform (every layer alike; else per layer:
  :attr:`~jaxshare.convert.mapping.Architecture.layer_dims`)."""
  m = plan.model
  return Dims(D=m.d_model, H=m.num_heads, G=hf_config.kv_heads(plan), d=m.resolved_head_dim,
              F=m.mlp_dim, V=m.vocab_size)


def load_hf_model(directory: str | Path | HFCheckpoint, overrides: Sequence[str] = (), *, progress: bool = False,
                  scratch_dir: str | Path | None = None) -> Run:
  """Read an HF directory into a :class:`~jaxshare.store.runs.Run` (no directory, step 0, host arrays): parameters a
  pure dict of NumPy arrays in the config's ``param_dtype`` (float32 unless overridden), every leaf converted from a
  named HF tensor, one tensor at a time; a remote-code directory's head-wise ties as it carries them.

  Args:
    directory: a local HF model directory, or one already opened (see :class:`HFCheckpoint`).
    overrides: further jaxshare config overrides (``train.*``, ``data.*``; model fields come from the checkpoint).
    progress: show a progress bar over the layers.
    scratch_dir: back the parameters by ``.npy`` memory maps in this (existing) directory instead of anonymous
      memory: filled pages are written back to disk and can be evicted, so converting a model larger than RAM
      holds only the tensor being converted (the caller deletes the files once done with the arrays).

  Raises:
    HFCheckpointError: unreadable directory, missing or mis-shaped tensors.
    UnsupportedModelError: an architecture, config value or tensor jaxshare cannot represent exactly.
  """
  ckpt = directory if isinstance(directory, HFCheckpoint) else HFCheckpoint(directory)
  native = ckpt.architecture == remote.ARCHITECTURE  # a jaxshare model with a sharing schedule, exported by us
  if native:
    cfg = remote.read_config(ckpt.config, overrides)
  else:
    arch = architecture_for(ckpt)
    cfg = load_config(None, arch.config_overrides(ckpt.config) + list(overrides))
  plan = plan_of(cfg)  # the imported model's, compiled once
  if native:
    ties = remote.read_ties(ckpt.config, plan)
    arch = remote.architecture(plan, ties)
  elif plan.schedule.tied_heads:
    raise UnsupportedModelError(f"schedule.kind={cfg.schedule.kind!r} ties heads, which an import cannot choose: "
                                "import the dense model, then `python -m jaxshare.convert uptrain RUN OUT "
                                "schedule.kind=headwise ...`")
  else:
    ties = None
  graphdef, abstract = abstract_params(plan, ties)
  params = hf_to_params(arch, plan, dims(plan), _template(abstract, scratch_dir), ckpt.read, ckpt.names(),
                        progress=progress)
  return Run(None, cfg, plan, ties, graphdef, params, 0, None)


def _template(abstract: dict, scratch_dir: str | Path | None = None) -> dict:
  """Zero arrays shaped as ``abstract`` (lazily allocated pages, or ``.npy`` memory maps in ``scratch_dir``)."""
  if scratch_dir is None:
    return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), abstract)
  index = itertools.count()
  return jax.tree.map(lambda s: np.lib.format.open_memmap(Path(scratch_dir) / f"{next(index)}.npy", mode="w+",
                                                          dtype=s.dtype, shape=s.shape), abstract)
