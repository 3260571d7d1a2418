"""KVSharer's proposals (Yang et al. 2024, "KVSharer: Efficient Inference via Layer-Wise Dissimilar KV Cache
Sharing", arXiv 2410.18517, Sec. 3): on calibration data, rank layer pairs by the Euclidean distance of their average
K/V caches, most *dissimilar* first, and let the later layer of each pair read the earlier one's K/V until the
wanted number of layers share.

KVSharer accepts each replacement only while the model's final hidden states stay close to the original's; a search
scores every proposal by its stage-1 loss and KL to the source instead (:mod:`jaxshare.search.calibration`), which
judges the whole proposal rather than each step of it. The average keys are taken before RoPE: each position's
rotation differs, and averaging rotated keys would mostly cancel them.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from jaxshare.data.batch import Batch
from jaxshare.model.params import layer_params
from jaxshare.store.runs import Run
from jaxshare.search.space import Option, explicit_option


def layer_kv_means(src: Run, batches: list[Batch]) -> np.ndarray:
  """Every layer's average K and V over the calibration tokens, concatenated: ``[L, 2 * G * d]`` float64.

  Raises:
    ValueError: a layer of the source does not compute its own K/V (KVSharer starts from a model whose every layer
      does).
  """
  @jax.jit
  def capture(params, b: Batch) -> jax.Array:
    return nnx.merge(src.graphdef, params).capture_mha(b.inputs, b.positions, b.segment_ids)[1].normed.mean((1, 2))

  normed = np.mean([np.asarray(capture(src.params, b), np.float64) for b in batches], axis=0)  # [L, D]
  params, means = jax.device_get(src.params), []
  for layer, plan in enumerate(src.schedule.layers):
    if not plan.is_producer:
      raise ValueError(f"KVSharer starts from a model whose every layer computes its K/V; layer {layer} of "
                       f"schedule {src.schedule.kind!r} reads another's")
    attn = layer_params(params, src.schedule, layer)["attn"]
    parts = []
    for name in ("k_proj", "v_proj"):
      kv = np.einsum("d,dgh->gh", normed[layer], np.asarray(attn[name]["kernel"], np.float64))
      parts.append((kv + np.asarray(attn[name].get("bias", 0.0), np.float64)).ravel())
    means.append(np.concatenate(parts))
  return np.stack(means)


def kvsharer_sources(means: np.ndarray, num_shared: int) -> list[int]:
  """Per-layer K/V sources (LCKV style) with ``num_shared`` layers reading an earlier layer's K/V: layer pairs are
  taken in order of decreasing distance between their average caches (``means``, ``[L, F]``), a pair ``(i, j > i)``
  when layer ``j`` still computes its own K/V and no layer reads it, and layer ``i`` computes its own (so a layer
  that reads another is never read itself).

  Raises:
    ValueError: ``num_shared`` outside ``0..L-1``.
  """
  L = len(means)
  if not 0 <= num_shared < L:
    raise ValueError(f"num_shared={num_shared} is invalid: must be in 0..{L - 1}")
  dist = np.linalg.norm(means[:, None, :] - means[None, :, :], axis=-1)
  pairs = sorted(((i, j) for j in range(L) for i in range(j)), key=lambda p: (-dist[p], p))
  sources, read, shared = list(range(L)), set(), 0
  for i, j in pairs:
    if shared == num_shared:
      break
    if sources[j] == j and j not in read and sources[i] == i:
      sources[j], shared = i, shared + 1
      read.add(i)
  return sources


def kvsharer_options(src: Run, batches: list[Batch]) -> list[Option]:
  """KVSharer's proposals sharing a quarter, half and three quarters of the layers (``kvsharer<n>``, n the layers
  that read another's K/V: fewer than asked when the greedy order leaves no pair to take)."""
  L = len(src.schedule.layers)
  means = layer_kv_means(src, batches)
  proposals = {tuple(kvsharer_sources(means, n)) for n in {max(1, L // 4), L // 2, (3 * L) // 4} if 0 < n < L}
  return sorted((explicit_option(s, f"kvsharer{sum(k != v for k, v in enumerate(s))}") for s in proposals),
                key=lambda o: o.name)
