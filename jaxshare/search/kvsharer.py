"""KVSharer as published (Yang et al. 2024, "KVSharer: Efficient Inference via Layer-Wise Dissimilar KV Cache
Sharing", arXiv 2410.18517, Sec. 3 and the authors' released strategy search), as the search's K/V proposals.

1. Each layer's KV cache (K after RoPE, as the cache holds it, and V) is averaged over the calibration sequences,
   position by position (:func:`layer_kv_caches`).
2. Layer pairs are ranked by the Euclidean distance of those averages, most **dissimilar** first
   (:func:`cache_distances`).
3. Greedily, the later layer of each pair reads the earlier one's K/V (:func:`kvsharer_sources`): the consumer reads
   the earlier layer's K/V unchanged (the search's ``own`` rule, ``train.init_kv_pool=producer``), a layer that reads
   another already is skipped, and layers that read the re-pointed one follow it to its producer. A replacement is
   kept only while the model's final hidden states on the calibration sequences stay cosine-similar to the
   original's above a threshold (:func:`hidden_similarity`), until the wanted number of layers share.

The search then converts each proposal under every K/V rule as it does any architecture: ``kvsharer<n>-own`` is
KVSharer's conversion; ``-mean`` and ``-running`` are its layer choice started as MLKV and pythia-mlkv start theirs.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxshare.convert.uptrain import convert
from jaxshare.data.batch import Batch
from jaxshare.schedule import Schedule
from jaxshare.store.runs import Run
from jaxshare.search.space import KV_RULES, Option, explicit_option

def kvsharer_applies(schedule: Schedule) -> bool:
  """Whether KVSharer starts from this schedule: every layer attends with its own K/V and scores, all with one
  number of K/V heads (its caches are compared as arrays of one shape)."""
  layers = schedule.layers
  return len({p.num_kv_heads for p in layers}) == 1 and all(
    p.is_producer and p.has_query_key and not p.score_reuse for p in layers)


def layer_kv_caches(src: Run, batches: list[Batch]) -> tuple[np.ndarray, np.ndarray]:
  """Every layer's K and V cache averaged over the calibration sequences position by position: ``[L, T, G, d]``
  float64 each (K after RoPE).

  Raises:
    ValueError: a source KVSharer does not start from (:func:`kvsharer_applies`).
  """
  if not kvsharer_applies(src.schedule):
    raise ValueError(f"KVSharer starts from a model whose every layer computes its own K/V and scores with one number "
                     f"of K/V heads; schedule {src.schedule.kind!r} is not one")

  @jax.jit
  def sums(params, b: Batch) -> tuple[jax.Array, jax.Array]:
    k, v = nnx.merge(src.graphdef, params).capture_kv(b.inputs, b.positions, b.segment_ids)[1]
    return k.astype(jnp.float32).sum(1), v.astype(jnp.float32).sum(1)

  totals = [sum(np.asarray(x, np.float64) for x in parts) for parts in zip(*(sums(src.params, b) for b in batches))]
  rows = sum(b.inputs.shape[0] for b in batches)
  return totals[0] / rows, totals[1] / rows


def cache_distances(k: np.ndarray, v: np.ndarray) -> np.ndarray:
  """``[L, L]``: for layers i, j the mean over positions and heads of ``|K_i - K_j|`` (Euclidean over the head
  dimension), averaged with V's alike, from the average caches ``[L, T, G, d]`` of :func:`layer_kv_caches`."""
  L = len(k)
  out = np.zeros((L, L))
  for i in range(L):
    out[i] = (np.linalg.norm(k - k[i], axis=-1).mean((1, 2)) + np.linalg.norm(v - v[i], axis=-1).mean((1, 2))) / 2
  return out


def kvsharer_sources(distances: np.ndarray, accept: Callable[[list[int]], bool], max_shared: int
                     ) -> list[list[int]]:
  """KVSharer's greedy search: per-layer K/V sources (LCKV style) after each kept replacement, at most
  ``max_shared`` of them (fewer when the pairs run out).

  Pairs ``(i, j > i)`` are taken by decreasing ``distances[i, j]``; a pair whose later layer ``j`` reads another
  layer already is skipped; otherwise ``j``, and every layer that reads ``j``, reads ``i``'s producer, and the trial
  is kept when ``accept(trial sources)`` holds.

  Raises:
    ValueError: ``max_shared`` outside ``0..L-1``.
  """
  L = len(distances)
  if not 0 <= max_shared < L:
    raise ValueError(f"max_shared={max_shared} is invalid: must be in 0..{L - 1}")
  pairs = sorted(((i, j) for j in range(L) for i in range(j)), key=lambda p: (-distances[p], p))
  sources, steps = list(range(L)), []
  for i, j in pairs:
    if len(steps) == max_shared:
      break
    if sources[j] != j:
      continue
    trial = [sources[i] if s == j else s for s in sources]
    if accept(trial):
      sources = trial
      steps.append(list(sources))
  return steps


def hidden_similarity(reference: list[np.ndarray], hidden: list[np.ndarray]) -> float:
  """KVSharer's acceptance measure: the mean over calibration sequences of the cosine similarity of two models'
  final hidden states, each sequence's ``[T, D]`` flattened; batches ``[B, T, D]``."""
  sims = []
  for a, b in zip(reference, hidden):
    a, b = a.reshape(len(a), -1).astype(np.float64), b.reshape(len(b), -1).astype(np.float64)
    sims.extend((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)))
  return float(np.mean(sims))


def _final_hidden(graphdef: nnx.GraphDef, params: dict, batches: list[Batch]) -> list[np.ndarray]:
  @jax.jit
  def hidden(p, b: Batch) -> jax.Array:
    return nnx.merge(graphdef, p).final_hidden(b.inputs, b.positions, b.segment_ids).astype(jnp.float32)
  return [np.asarray(hidden(params, b)) for b in batches]


def kvsharer_options(src: Run, batches: list[Batch], threshold: float,
                     say: Callable[[str], None] = lambda line: None) -> list[Option]:
  """KVSharer's proposals sharing a quarter, half and three quarters of the layers (``kvsharer<n>``, n the layers
  that read another's K/V: fewer than asked when the acceptance test or the pairs run out), searched on the
  calibration ``batches`` at the acceptance ``threshold`` (a cosine similarity of the final hidden states: the
  authors' released search uses 0.5, the CLI's default); ``say`` hears each trial's similarity.

  Raises:
    As :func:`layer_kv_caches`.
  """
  L = len(src.schedule.layers)
  distances = cache_distances(*layer_kv_caches(src, batches))
  reference = _final_hidden(src.graphdef, src.params, batches)

  def accept(sources: list[int]) -> bool:
    # the consumer reads the earlier layer's K/V unchanged: the own rule
    overrides = ["schedule.kind=explicit", *explicit_option(sources, "trial").knobs,
                 f"train.init_kv_pool={KV_RULES['own'].value}"]
    trial = convert(src, src.directory, overrides, calibration_batches=0)
    similarity = hidden_similarity(reference, _final_hidden(trial.graphdef, trial.params, batches))
    say(f"kvsharer: sources {'_'.join(map(str, sources))}: final hidden cosine similarity {similarity:.4f} "
        f"({'kept' if similarity > threshold else 'not kept'}, threshold {threshold})")
    return similarity > threshold

  wanted = sorted(n for n in {max(1, L // 4), L // 2, (3 * L) // 4} if 0 < n < L)
  steps = kvsharer_sources(distances, accept, wanted[-1]) if wanted else []
  proposals = {tuple(steps[min(n, len(steps)) - 1]) for n in wanted if steps}
  return sorted((explicit_option(s, f"kvsharer{sum(k != v for k, v in enumerate(s))}") for s in proposals),
                key=lambda o: o.name)
