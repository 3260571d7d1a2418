"""Cross-layer similarity metrics of attention maps and attention weights (pure numpy).

Attention maps come as ``probs [L, B, H, T, T]``: layer, sample, head, query row, key column; every row is a
distribution over keys (causally masked entries are 0). The metrics follow the analyses of the sharing papers:

* :func:`js_divergence_matrix` -- LISA Fig. 2 (layer x layer Jensen-Shannon divergence),
* :func:`head_matching` -- LISA Fig. 3b-d (direct / random / best head pairing of adjacent layers),
* :func:`adjacent_cosine` -- UniAttn Fig. 2, ``Sim(i) = cos(s_i, s_{i-1})``; :func:`cosine_matrix` the L x L variant
  (SA Fig. 2/3, head-wise paper Eq. 1),
* :func:`weight_head_similarity` / :func:`best_earlier_match` -- head-wise sharing Eq. 3 and Algorithm 1 step 1,
* :func:`suggest_schedule` -- UniAttn's adaptive grouping (Table 5), whose algorithm the paper leaves unstated.

Reductions run in float64 one layer (pair) at a time, so the input may stay float32.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


def causal_softmax(logits: np.ndarray, window: int = 0) -> np.ndarray:
  """Attention probabilities from unmasked logits: query ``t`` attends keys ``s <= t`` (and ``t - s < window``
  with a sliding ``window`` > 0, the model's ``model.sliding_window``).

  Args:
    logits: ``[..., T, T]`` float pre-softmax attention logits (already scaled by 1/sqrt(d)), e.g. the
      ``[L, B, H, T, T]`` that ``Transformer.capture_logits`` returns.

  Returns:
    Same shape and dtype; each row sums to 1 and is 0 above the diagonal (and before the window).
  """
  logits = np.asarray(logits)
  if logits.ndim < 2 or logits.shape[-1] != logits.shape[-2]:
    raise ValueError(f"logits has shape {logits.shape}: expected [..., T, T] (square in the last two axes)")
  t = logits.shape[-1]
  causal = np.tril(np.ones((t, t), bool))
  if window:
    causal &= np.triu(np.ones((t, t), bool), -(window - 1))
  masked = np.where(causal, logits, -np.inf)
  # Subtracting the row max keeps exp() finite; the diagonal is always unmasked, so the max is finite.
  e = np.exp(masked - masked.max(axis=-1, keepdims=True))
  return (e / e.sum(axis=-1, keepdims=True)).astype(logits.dtype)


def _check_probs(probs: np.ndarray, min_layers: int) -> np.ndarray:
  probs = np.asarray(probs)
  if probs.ndim != 5 or probs.shape[-1] != probs.shape[-2]:
    raise ValueError(f"probs has shape {probs.shape}: expected [L, B, H, T, T] attention probabilities")
  if probs.shape[0] < min_layers:
    raise ValueError(f"probs has {probs.shape[0]} layers: this metric needs at least {min_layers}")
  return probs


def js_divergence(p: np.ndarray, q: np.ndarray) -> np.ndarray:
  """Jensen-Shannon divergence between distributions along the last axis, in nats.

  ``JS(p, q) = KL(p || m) / 2 + KL(q || m) / 2`` with ``m = (p + q) / 2`` and the convention ``0 log 0 = 0``
  (masked keys); symmetric and in ``[0, ln 2]``.

  Args:
    p, q: ``[..., S]`` non-negative arrays whose last axis sums to 1 (broadcastable against each other).

  Returns:
    ``[...]`` float64 divergences.
  """
  p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
  m = 0.5 * (p + q)

  def kl_to_m(a: np.ndarray) -> np.ndarray:
    # a > 0 implies m > 0, so the masked division never divides by zero.
    ratio = np.divide(a, m, out=np.ones_like(m), where=a > 0)
    return np.sum(a * np.log(ratio), axis=-1)

  return 0.5 * (kl_to_m(p) + kl_to_m(q))


def js_divergence_matrix(probs: np.ndarray) -> np.ndarray:
  """Layer x layer Jensen-Shannon divergence of head-averaged attention (LISA Fig. 2).

  The probabilities are averaged over the heads of each layer; the divergence of two layers is the JS divergence
  (natural log, so at most ln 2 ~ 0.693; the paper does not state its base) of each query row's distribution over
  keys, averaged over rows and samples. Row 0 attends only key 0 in every layer and so contributes 0 to every pair.

  Args:
    probs: ``[L, B, H, T, T]`` attention probabilities.

  Returns:
    ``[L, L]`` float64, symmetric, zero diagonal.
  """
  return _layer_pairs(probs, 0.0, lambda a, b: js_divergence(a, b).mean())


def head_js_matrix(p_n: np.ndarray, p_prev: np.ndarray) -> np.ndarray:
  """``M[h, h'] = mean JS(P_n[h], P_prev[h'])`` over samples and query rows (LISA Fig. 3b-d).

  Args:
    p_n, p_prev: ``[B, H, T, T]`` attention probabilities of two layers.

  Returns:
    ``[H, H]`` float64; rows index the heads of ``p_n``, columns those of ``p_prev``.
  """
  p_n, p_prev = np.asarray(p_n), np.asarray(p_prev)
  if p_n.ndim != 4 or p_n.shape != p_prev.shape:
    raise ValueError(f"p_n has shape {p_n.shape} and p_prev {p_prev.shape}: expected both [B, H, T, T]")
  heads = p_n.shape[1]
  m = np.empty((heads, heads))
  for h2 in range(heads):
    # One column at a time: broadcasting head h2 of the earlier layer against all heads of layer n.
    m[:, h2] = js_divergence(p_n, p_prev[:, h2:h2 + 1]).mean(axis=(0, 2))
  return m


def head_matching(probs: np.ndarray, seed: int = 0) -> dict[str, np.ndarray]:
  """How well the heads of each layer match those of the layer before (LISA Fig. 3b-d).

  For each layer ``n >= 1`` with ``M = head_js_matrix(P_n, P_{n-1})``:
  ``direct = mean_h M[h, h]`` (heads paired by index), ``random = mean_h M[h, pi(h)]`` for a random permutation
  ``pi`` (drawn from ``seed``, one per layer; the paper's "random pairing", read as a permutation) and
  ``best = mean_h min_h' M[h, h']`` (the oracle: each head's closest earlier head, not necessarily a bijection,
  so ``best <= direct`` and ``best <= random``).

  Args:
    probs: ``[L, B, H, T, T]`` attention probabilities, L >= 2.
    seed: seed of the random permutations.

  Returns:
    ``{"direct", "random", "best"}``, each ``[L-1]`` float64 (entry ``n-1`` for layer ``n``), in nats.
  """
  probs = _check_probs(probs, 2)
  rng = np.random.default_rng(seed)
  heads = probs.shape[2]
  out = {k: np.empty(probs.shape[0] - 1) for k in ("direct", "random", "best")}
  for n in range(1, probs.shape[0]):
    m = head_js_matrix(probs[n], probs[n - 1])
    out["direct"][n - 1] = np.trace(m) / heads
    out["random"][n - 1] = m[np.arange(heads), rng.permutation(heads)].mean()
    out["best"][n - 1] = m.min(axis=1).mean()
  return out


def _cosine_per_sample(a: np.ndarray, b: np.ndarray) -> float:
  """Mean over the leading (sample) axis of the cosine of the flattened remaining axes."""
  a = np.asarray(a, np.float64).reshape(a.shape[0], -1)
  b = np.asarray(b, np.float64).reshape(b.shape[0], -1)
  # Probability rows sum to 1, so no flattened map is the zero vector.
  return float(np.mean(np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))))


def adjacent_cosine(probs: np.ndarray) -> np.ndarray:
  """Softmax redundancy ``Sim(i) = cos(s_i, s_{i-1})`` of adjacent layers (UniAttn Fig. 2 / Sec. 3.1).

  Each sequence's ``[H, T, T]`` probabilities are flattened (heads kept apart, since UniAttn reuses them head by
  head), the cosine is taken per sequence and averaged over sequences.

  Args:
    probs: ``[L, B, H, T, T]`` attention probabilities, L >= 2.

  Returns:
    ``[L-1]`` float64 in ``[0, 1]``; entry ``i-1`` is ``Sim(i)``.
  """
  probs = _check_probs(probs, 2)
  return np.array([_cosine_per_sample(probs[i], probs[i - 1]) for i in range(1, probs.shape[0])])


def cosine_matrix(probs: np.ndarray) -> np.ndarray:
  """Layer x layer cosine similarity of head-averaged attention maps (SA Fig. 2/3, head-wise paper Eq. 1).

  Heads are averaged first (as in :func:`js_divergence_matrix`), then each sequence's ``[T, T]`` map is flattened,
  and the cosine is averaged over sequences ("cos per sample, then mean"; the papers leave the aggregation open).

  Args:
    probs: ``[L, B, H, T, T]`` attention probabilities.

  Returns:
    ``[L, L]`` float64, symmetric, unit diagonal.
  """
  return _layer_pairs(probs, 1.0, _cosine_per_sample)


def _layer_pairs(probs: np.ndarray, diagonal: float, metric) -> np.ndarray:
  """Symmetric ``[L, L]`` matrix of ``metric`` between head-averaged layers (``[B, T, T]`` each)."""
  mean = _check_probs(probs, 1).mean(axis=2)  # [L, B, T, T]
  n = mean.shape[0]
  out = np.full((n, n), diagonal)
  for i in range(n):
    for j in range(i + 1, n):
      out[i, j] = out[j, i] = metric(mean[i], mean[j])
  return out


def weight_head_similarity(wq: np.ndarray, wk: np.ndarray) -> np.ndarray:
  """Cosine similarity of every pair of heads' query/key weights (head-wise sharing, Eq. 3).

  ``m[i, j] = cos(W_i^q || W_i^k, W_j^q || W_j^k)`` with each head's matrices flattened (once flattened, the
  concatenation axis does not matter).

  Args:
    wq, wk: ``[L, D, H, d]`` query and key kernels of every layer (multi-head attention: as many K as Q heads).

  Returns:
    ``[L*H, L*H]`` float64, symmetric, unit diagonal; head ``h`` of layer ``l`` is index ``l*H + h``.

  Raises:
    ValueError: mismatched or non-4-D shapes, or a head whose weights are all zero (its cosine is undefined).
  """
  wq, wk = np.asarray(wq, np.float64), np.asarray(wk, np.float64)
  if wq.ndim != 4 or wq.shape != wk.shape:
    raise ValueError(f"wq has shape {wq.shape} and wk {wk.shape}: expected both [L, D, H, d] (equal shapes)")
  n_layers, _, heads, _ = wq.shape
  # [L, D, H, d] -> [L, H, D*d] per matrix, then one row per head of W_q || W_k.
  vecs = np.concatenate([w.transpose(0, 2, 1, 3).reshape(n_layers * heads, -1) for w in (wq, wk)], axis=1)
  norms = np.linalg.norm(vecs, axis=1)
  if np.any(norms == 0):
    i = int(np.argmin(norms))
    raise ValueError(f"wq/wk of layer {i // heads} head {i % heads} are all zero: cosine similarity is undefined")
  unit = vecs / norms[:, None]
  return unit @ unit.T


def best_earlier_match(sim: np.ndarray, num_layers: int, num_heads: int) -> tuple[np.ndarray, np.ndarray]:
  """Each head's most similar head in a strictly earlier layer (head-wise sharing, Algorithm 1 step 1).

  Args:
    sim: ``[L*H, L*H]`` head similarity (:func:`weight_head_similarity`).
    num_layers, num_heads: L and H.

  Returns:
    ``(match, score)``, both ``[L-1, H]``: for head ``h`` of layer ``l >= 1`` (row ``l-1``), the flat index
    ``l'*H + h'`` (``l' < l``) of its best match (int64) and the similarity (float64).
  """
  if num_layers < 2 or num_heads < 1:
    raise ValueError(f"num_layers={num_layers}, num_heads={num_heads}: need num_layers >= 2 and num_heads >= 1")
  size = num_layers * num_heads
  sim = np.asarray(sim)
  if sim.shape != (size, size):
    raise ValueError(f"sim has shape {sim.shape}: expected [L*H, L*H] = ({size}, {size})")
  match = np.empty((num_layers - 1, num_heads), np.int64)
  score = np.empty((num_layers - 1, num_heads))
  for layer in range(1, num_layers):
    rows = sim[layer * num_heads:(layer + 1) * num_heads, :layer * num_heads]  # candidates: earlier layers only
    match[layer - 1] = rows.argmax(axis=1)
    score[layer - 1] = rows.max(axis=1)
  return match, score


@dataclasses.dataclass(frozen=True)
class ScheduleSuggestion:
  """A sharing schedule suggested from attention similarity.

  Attributes:
    groups: ``(bottom, reusers)`` per superblock: the reusers would reuse the bottom layer's probabilities.
      Only groups with at least one reuser are listed.
    uniattn: overrides for ``schedule.kind=uniattn`` that build exactly these groups, or None when they are not
      contiguous blocks of one size (the last one may be shorter: ``uniattn.end`` truncates it).
    sa: overrides for ``schedule.kind=sa`` (``semantics=reference_code``: the span reuses the layer before it) for
      the longest group, or None without groups.
  """

  groups: list[tuple[int, list[int]]]
  uniattn: list[str] | None
  sa: list[str] | None


def _uniattn_overrides(groups: list[tuple[int, list[int]]]) -> list[str] | None:
  sizes = [1 + len(r) for _, r in groups]
  bottoms = [b for b, _ in groups]
  size = sizes[0]
  # UniAttn superblocks start every block_size layers from start; end (exclusive) may cut the last one short.
  if any(s != size for s in sizes[:-1]) or sizes[-1] > size:
    return None
  if any(b != bottoms[0] + k * size for k, b in enumerate(bottoms)):
    return None
  return ["schedule.kind=uniattn", f"schedule.uniattn.block_size={size}", f"schedule.uniattn.start={bottoms[0]}",
          f"schedule.uniattn.end={bottoms[-1] + sizes[-1]}"]


def suggest_schedule(adjacent_sim: np.ndarray, threshold: float, max_block: int) -> ScheduleSuggestion:
  """Group layers into superblocks whose attention is similar enough to share (UniAttn-style adaptive grouping).

  UniAttn (Table 5) groups adaptively by cosine similarity but does not give the algorithm; this greedy rule is
  our choice. Scanning layers bottom-up, a block starts at the first layer not yet grouped and takes in the next
  layer ``j`` while ``adjacent_sim[j-1] = Sim(j) >= threshold`` and the block has fewer than ``max_block`` layers.
  Similarity is chained layer to layer, so a long block can drift away from its bottom; ``max_block`` bounds that.

  Args:
    adjacent_sim: ``[L-1]`` similarity of each layer to the one before (:func:`adjacent_cosine`).
    threshold: minimum similarity for a layer to join the block below it.
    max_block: maximum layers per block (bottom included), >= 2.

  Returns:
    The groups and equivalent config overrides (see :class:`ScheduleSuggestion`). Among equally long groups,
    the SA span is the deepest one, since deep layers tolerate sharing best (LISA Fig. 4, SA Table 1).
  """
  sim = np.asarray(adjacent_sim, np.float64)
  if sim.ndim != 1 or sim.size < 1:
    raise ValueError(f"adjacent_sim has shape {sim.shape}: expected [L-1] with L >= 2")
  if not math.isfinite(threshold):
    raise ValueError(f"threshold={threshold!r} is invalid: must be a finite number (cosine similarities are in "
                     "[-1, 1])")
  if max_block < 2:
    raise ValueError(f"max_block={max_block!r} is invalid: must be >= 2 (a block of one layer shares nothing)")
  num_layers = sim.size + 1
  groups: list[tuple[int, list[int]]] = []
  bottom = 0
  while bottom < num_layers:
    end = bottom + 1
    while end < num_layers and end - bottom < max_block and sim[end - 1] >= threshold:
      end += 1
    if end - bottom > 1:
      groups.append((bottom, list(range(bottom + 1, end))))
    bottom = end
  if not groups:
    return ScheduleSuggestion([], None, None)
  longest = max(reversed(groups), key=lambda g: len(g[1]))  # max keeps the first maximum: reversed -> deepest
  sa = ["schedule.kind=sa", f"schedule.sa.start={longest[1][0]}", f"schedule.sa.end={longest[1][-1]}",
        "schedule.sa.semantics=reference_code"]
  return ScheduleSuggestion(groups, _uniattn_overrides(groups), sa)
