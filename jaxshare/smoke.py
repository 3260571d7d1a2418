"""``JAXSHARE_SMOKE=1``: every documented command as a quick check of itself (tests/e2e/test_readme.py runs the README
and docs/ this way). What the commands measure (losses, speeds, fits) means nothing under it; that they run does.

Under it:

- every training run (``train.py``, and the runs ``scripts/sweep.py`` and ``scripts/uptrain_experiment.py`` start)
  and every fit check (``train.py --compile-only``) uses a narrow model of the configured depth, heads, vocabulary
  and schedule (:data:`HEAD_DIM` dimensions per head, an MLP twice the width) on sequences of :data:`SEQ_LEN` tokens,
  training on batches of :data:`BATCH` for the configured number of steps: every step number, checkpoint, file and
  directory a command names exists as it would in the full run (:func:`overrides`); a fit check keeps its batch,
  and ``--max-batch`` compiles it alone;
- experiment drivers (sweeps, the uptraining experiment, ``scripts/aot_compile.py``, ``scripts/bench_decode.py``) run
  their first variant at their first seed (:func:`first`); a schedule search (``python -m jaxshare.search``) its
  first two candidates, at one seed;
- decode measurements (``eval.py efficiency``, ``scripts/bench_decode.py``) time caches of at most :data:`CONTEXT`
  tokens in a :data:`BUDGET_GIB` budget (:func:`cache_sizes`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TypeVar

ENV = "JAXSHARE_SMOKE"
HEAD_DIM = 8
SEQ_LEN = 32
BATCH = 8
VARIANTS = 1  # of an experiment driver: its first variant, at its first seed
CONTEXT = 256  # decode measurements: the longest cache timed
BUDGET_GIB = 1 / 64  # decode measurements: the cache budget of the largest-batch figure

T = TypeVar("T")


def enabled() -> bool:
  """Whether this process runs as a smoke check (``JAXSHARE_SMOKE`` set to anything but empty or 0)."""
  return os.environ.get(ENV, "") not in ("", "0")


def overrides(num_heads: int, grad_accum_steps: int, fit_check: bool = False) -> list[str]:
  """The dotted overrides that narrow a config of ``num_heads`` heads: its depth, heads, vocabulary and schedule kept,
  :data:`HEAD_DIM` dimensions per head, :data:`SEQ_LEN` tokens per sequence, and to train, batches of :data:`BATCH`
  sequences (a multiple of ``grad_accum_steps``; a ``fit_check`` keeps the configured batch, which fits its mesh)."""
  d_model = HEAD_DIM * num_heads
  narrow = [f"model.d_model={d_model}", "model.head_dim=0", f"model.mlp_dim={2 * d_model}", f"data.seq_len={SEQ_LEN}"]
  return narrow if fit_check else [*narrow, f"train.batch_size={max(BATCH // grad_accum_steps, 1) * grad_accum_steps}"]


def first(items: Sequence[T], n: int = VARIANTS) -> list[T]:
  """``items`` (the variants or seeds of an experiment driver), cut to the first ``n`` under a smoke check."""
  return list(items[:n]) if enabled() else list(items)


def cache_sizes(budget_gib: float, max_batch_context: int, contexts: Sequence[int]) -> tuple[float, int, list[int]]:
  """A decode measurement's ``(budget in GiB, context of the largest-batch figure, timed contexts)``: as given, or
  under a smoke check :data:`BUDGET_GIB`, :data:`CONTEXT` and the first context capped at :data:`CONTEXT`."""
  if not enabled():
    return budget_gib, max_batch_context, list(contexts)
  return BUDGET_GIB, CONTEXT, [min(contexts[0], CONTEXT)]
