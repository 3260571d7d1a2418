"""Head-wise weight sharing: DirectShare head selection (Head-wise Shareable Attention, Eq. 3, Alg. 1-2).

For every head of a layer after the first, find its most similar head in a strictly earlier layer (cosine of the
flattened ``W_q || W_k`` or another match function of Table 12), keep the N best pairs, join them into connected
components and tie every member's W_q, W_k, W_v to the member with the highest mean similarity to the others.
Each head has at most one edge to an earlier layer, so the pairs form a forest and N pairs remove exactly N heads.
"""

from __future__ import annotations

import dataclasses

import numpy as np

MATRICES = ("q", "k", "v")
_MATCH_FEATURES = {"qk": ("q", "k"), "q": ("q",), "k": ("k",), "v": ("v",), "qkv": ("q", "k", "v")}


@dataclasses.dataclass(frozen=True)
class HeadTies:
  """Which stored head each layer's heads use, per projection matrix.

  Attributes:
    rows: per matrix (``q``, ``k``, ``v``), the ``(layer, head)`` whose weights each stored row holds (ascending).
    index: per matrix, ``[L][H]`` row of the stored head that layer l's head h uses.
    pairs: the N selected ``(head, matched earlier head)`` pairs as flat indices ``layer * H + head``, per matrix
      (PostShare's penalty pairs).
  """

  rows: dict[str, tuple[tuple[int, int], ...]]
  index: dict[str, tuple[tuple[int, ...], ...]]
  pairs: dict[str, tuple[tuple[int, int], ...]]

  @property
  def num_rows(self) -> int:
    return len(self.rows["q"])


def _unit_rows(feat: np.ndarray) -> np.ndarray:
  norms = np.linalg.norm(feat, axis=1, keepdims=True)
  return feat / np.maximum(norms, 1e-12)


def _select(feat: np.ndarray, num_layers: int, num_heads: int, n: int) -> tuple[dict[int, int], list[tuple[int, int]]]:
  """DirectShare on per-head features ``[L*H, F]``: head -> representative map, and the N chosen pairs."""
  unit = _unit_rows(feat.astype(np.float64))
  sim = unit @ unit.T
  candidates = []
  for i in range(num_heads, num_layers * num_heads):
    earlier = sim[i, : (i // num_heads) * num_heads]
    j = int(np.argmax(earlier))
    candidates.append((-float(earlier[j]), i, j))
  candidates.sort()  # highest similarity first; ties broken by head index, deterministically
  pairs = [(i, j) for _, i, j in candidates[:n]]
  parent = list(range(num_layers * num_heads))

  def find(a: int) -> int:
    while parent[a] != a:
      parent[a] = parent[parent[a]]
      a = parent[a]
    return a

  for i, j in pairs:
    parent[find(i)] = find(j)
  components: dict[int, list[int]] = {}
  for a in range(num_layers * num_heads):
    components.setdefault(find(a), []).append(a)
  rep = {}
  for members in components.values():
    if len(members) == 1:
      rep[members[0]] = members[0]
      continue
    sub = sim[np.ix_(members, members)]
    mean_to_others = (sub.sum(axis=1) - 1.0) / (len(members) - 1)
    best = members[int(np.argmax(mean_to_others))]
    for a in members:
      rep[a] = best
  return rep, pairs


def direct_share(weights: dict[str, np.ndarray], num_tied: int, match: str = "qk") -> HeadTies:
  """Choose the head ties of DirectShare.

  Args:
    weights: ``{"q", "k", "v"}`` kernels ``[L, D, H, d]`` (every layer's own projections, MHA).
    num_tied: N, heads to tie (``schedule.tied_head_count``).
    match: ``qk`` (the paper's), ``q``, ``k``, ``v``, ``qkv`` (all three matrices tied by one match), or
      ``separately`` (q, k and v each matched and tied on their own; Table 12).

  Returns:
    The ties.

  Raises:
    ValueError: unknown match function, shapes that disagree, or N larger than the heads outside layer 0.
  """
  if match not in _MATCH_FEATURES and match != "separately":
    raise ValueError(f"match={match!r} is invalid: must be one of {', '.join(list(_MATCH_FEATURES) + ['separately'])}")
  shapes = {m: weights[m].shape for m in MATRICES}
  if len({s for s in shapes.values()}) != 1 or len(shapes["q"]) != 4:
    raise ValueError(f"weights must all be [L, D, H, d] of one shape (MHA), got {shapes}")
  L, D, H, d = shapes["q"]
  if not 0 <= num_tied <= (L - 1) * H:
    raise ValueError(f"num_tied={num_tied} is invalid: must be in 0..{(L - 1) * H}")
  per_head = {m: np.asarray(weights[m]).transpose(0, 2, 1, 3).reshape(L * H, D * d) for m in MATRICES}

  def feature(names: tuple[str, ...]) -> np.ndarray:
    return np.concatenate([per_head[m] for m in names], axis=1)

  if match == "separately":
    chosen = {m: _select(feature((m,)), L, H, num_tied) for m in MATRICES}
  else:
    shared = _select(feature(_MATCH_FEATURES[match]), L, H, num_tied)
    chosen = {m: shared for m in MATRICES}
  rows, index, pairs = {}, {}, {}
  for m, (rep, chosen_pairs) in chosen.items():
    reps = sorted(set(rep.values()))
    row_of = {r: k for k, r in enumerate(reps)}
    rows[m] = tuple(divmod(r, H) for r in reps)
    index[m] = tuple(tuple(row_of[rep[l * H + h]] for h in range(H)) for l in range(L))
    pairs[m] = tuple(chosen_pairs)
  return HeadTies(rows, index, pairs)


def tie_weights(weights: dict[str, np.ndarray], ties: HeadTies) -> dict[str, np.ndarray]:
  """The stored head table ``{m: [rows, D, d]}`` holding each representative's weights from ``[L, D, H, d]``."""
  return {m: np.stack([np.asarray(weights[m])[l, :, h, :] for l, h in ties.rows[m]]) for m in MATRICES}


def dense_kernels(params: dict, schedule, num_layers: int) -> dict[str, np.ndarray]:
  """Every layer's own ``{"q", "k", "v"}`` kernels ``[L, D, H, d]`` from a dense model's parameters."""
  from jaxshare.model.params import layer_params  # the model package imports this module

  per_layer = [layer_params(params, schedule, layer)["attn"] for layer in range(num_layers)]
  return {m: np.stack([np.asarray(p[f"{m}_proj"]["kernel"]) for p in per_layer]) for m in MATRICES}


def tied_params_from_dense(dense_params: dict, template: dict, ties: HeadTies, schedule) -> dict:
  """DirectShare conversion: the head-wise model's parameters from a dense model's (same other shapes).

  Every parameter the two models share is copied (:func:`~jaxshare.model.params.copy_shared_weights`); the head
  table takes each representative head's W_q, W_k, W_v. Works on traced arrays (the row choice is static).
  """
  import jax.numpy as jnp

  from jaxshare.model.params import copy_shared_weights, layer_params

  L = len(ties.index["q"])
  per_layer = [layer_params(dense_params, schedule, layer)["attn"] for layer in range(L)]
  table = {m: jnp.stack([per_layer[l][f"{m}_proj"]["kernel"][:, h, :] for l, h in ties.rows[m]]).astype(
    template["head_table"][m].dtype) for m in MATRICES}
  # both models are all-dense-layer stacks of one segment, so they share the superblock grouping
  return {**copy_shared_weights(dense_params, schedule, template, schedule), "head_table": table}
