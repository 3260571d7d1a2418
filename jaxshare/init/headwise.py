"""Head-wise weight sharing: DirectShare head selection (Head-wise Shareable Attention, Eq. 3, Alg. 1-2).

For every head of a layer after the first, find its most similar head in a strictly earlier layer (cosine of the
flattened ``W_q || W_k`` or another match function of Table 12), keep the N best pairs, join them into connected
components and tie every member's W_q, W_k, W_v to the member with the highest mean similarity to the others.
Each head has at most one edge to an earlier layer, so the pairs form a forest and N pairs remove exactly N heads.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxshare import distributed
from jaxshare.store import runs
from jaxshare.config import ConfigError
from jaxshare.init.shared import copy_shared_weights
from jaxshare.model import build_model
from jaxshare.model.params import layer_params
from jaxshare.model.ties import MATRICES, HeadTies
from jaxshare.plan import ModelPlan
from jaxshare.schedule import parse_kind

_MATCH_FEATURES = {"qk": ("q", "k"), "q": ("q",), "k": ("k",), "v": ("v",), "qkv": ("q", "k", "v")}


def _unit_rows(feat: np.ndarray) -> np.ndarray:
  norms = np.linalg.norm(feat, axis=1, keepdims=True)
  return feat / np.maximum(norms, 1e-12)


def _similarity(feat: np.ndarray) -> np.ndarray:
  unit = _unit_rows(feat.astype(np.float64))
  return unit @ unit.T


def _candidate_pairs(sim: np.ndarray, num_layers: int, num_heads: int, n: int) -> list[tuple[int, int]]:
  """Every head after layer 0 with its most similar head in a strictly earlier layer; the n most similar pairs."""
  candidates = []
  for i in range(num_heads, num_layers * num_heads):
    earlier = sim[i, : (i // num_heads) * num_heads]
    j = int(np.argmax(earlier))
    candidates.append((-float(earlier[j]), i, j))
  candidates.sort()  # highest similarity first; ties broken by head index, deterministically
  return [(i, j) for _, i, j in candidates[:n]]


def _representatives(sim: np.ndarray, pairs: list[tuple[int, int]]) -> dict[int, int]:
  """Head -> the head whose weights it uses: the connected components of the pairs, each tied to its member with the
  highest mean similarity to the others."""
  parent = list(range(sim.shape[0]))

  def find(a: int) -> int:
    while parent[a] != a:
      parent[a] = parent[parent[a]]
      a = parent[a]
    return a

  for i, j in pairs:
    parent[find(i)] = find(j)
  components: dict[int, list[int]] = {}
  for a in range(sim.shape[0]):
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
  return rep


def _per_head(weights: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], tuple[int, int]]:
  shapes = {m: weights[m].shape for m in MATRICES}
  if len({s for s in shapes.values()}) != 1 or len(shapes["q"]) != 4:
    raise ValueError(f"weights must all be [L, D, H, d] of one shape (MHA), got {shapes}")
  L, D, H, d = shapes["q"]
  return {m: np.asarray(weights[m]).transpose(0, 2, 1, 3).reshape(L * H, D * d) for m in MATRICES}, (L, H)


def _match_similarity(per_head: dict[str, np.ndarray], match: str) -> dict[str, np.ndarray]:
  """Per matrix, the head similarity it is tied by: one shared match, or each matrix's own (``separately``)."""
  if match not in _MATCH_FEATURES and match != "separately":
    raise ValueError(f"match={match!r} is invalid: must be one of {', '.join(list(_MATCH_FEATURES) + ['separately'])}")
  if match == "separately":
    return {m: _similarity(per_head[m]) for m in MATRICES}
  shared = _similarity(np.concatenate([per_head[m] for m in _MATCH_FEATURES[match]], axis=1))
  return {m: shared for m in MATRICES}


def _ties(chosen: dict[str, tuple[dict[int, int], list[tuple[int, int]]]], L: int, H: int) -> HeadTies:
  rows, index, pairs = {}, {}, {}
  for m, (rep, chosen_pairs) in chosen.items():
    reps = sorted(set(rep.values()))
    row_of = {r: k for k, r in enumerate(reps)}
    rows[m] = tuple(divmod(r, H) for r in reps)
    index[m] = tuple(tuple(row_of[rep[l * H + h]] for h in range(H)) for l in range(L))
    pairs[m] = tuple(tuple(p) for p in chosen_pairs)
  return HeadTies(rows, index, pairs)


def direct_share(weights: dict[str, np.ndarray], num_tied: int, match: str = "qk") -> HeadTies:
  """Choose the head ties of DirectShare (Alg. 1-2).

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
  per_head, (L, H) = _per_head(weights)
  sims = _match_similarity(per_head, match)
  if not 0 <= num_tied <= (L - 1) * H:
    raise ValueError(f"num_tied={num_tied} is invalid: must be in 0..{(L - 1) * H}")
  chosen = {}
  for m in MATRICES:
    pairs = _candidate_pairs(sims[m], L, H, num_tied)
    chosen[m] = (_representatives(sims[m], pairs), pairs)
  return _ties(chosen, L, H)


def ties_from_pairs(weights: dict[str, np.ndarray], pairs: dict[str, list], match: str = "qk") -> HeadTies:
  """DirectShare's ties over given pairs (PostShare: the pairs it penalised, chosen before post-training), each
  component's representative chosen on ``weights`` (the post-trained ones) as in :func:`direct_share`.

  Raises:
    ValueError: as :func:`direct_share`, or a pair that does not match a head to one of an earlier layer.
  """
  per_head, (L, H) = _per_head(weights)
  sims = _match_similarity(per_head, match)
  chosen = {}
  for m in MATRICES:
    given = [tuple(int(a) for a in p) for p in pairs[m]]
    for i, j in given:
      if not (0 <= j < L * H and 0 <= i < L * H and j // H < i // H):
        raise ValueError(f"pair {(i, j)} for {m} is invalid: head i must be matched to a head of an earlier layer "
                         f"({L} layers x {H} heads)")
    chosen[m] = (_representatives(sims[m], given), given)
  return _ties(chosen, L, H)


def tie_weights(weights: dict[str, np.ndarray], ties: HeadTies) -> dict[str, np.ndarray]:
  """The stored head table ``{m: [rows, D, d]}`` holding each representative's weights from ``[L, D, H, d]``."""
  return {m: np.stack([np.asarray(weights[m])[l, :, h, :] for l, h in ties.rows[m]]) for m in MATRICES}


def dense_kernels(params: dict, schedule, num_layers: int) -> dict[str, np.ndarray]:
  """Every layer's own ``{"q", "k", "v"}`` kernels ``[L, D, H, d]`` from a dense model's parameters."""
  per_layer = [layer_params(params, schedule, layer)["attn"] for layer in range(num_layers)]
  return {m: np.stack([np.asarray(p[f"{m}_proj"]["kernel"]) for p in per_layer]) for m in MATRICES}


def tied_params_from_dense(dense_params: dict, template: dict, ties: HeadTies, schedule) -> dict:
  """DirectShare conversion: the head-wise model's parameters from a dense model's (same other shapes).

  Every parameter the two models share is copied (:func:`~jaxshare.init.shared.copy_shared_weights`); the head
  table takes each representative head's W_q, W_k, W_v. Works on traced arrays (the row choice is static).
  """
  L = len(ties.index["q"])
  per_layer = [layer_params(dense_params, schedule, layer)["attn"] for layer in range(L)]
  table = {m: jnp.stack([per_layer[l][f"{m}_proj"]["kernel"][:, h, :] for l, h in ties.rows[m]]).astype(
    template["head_table"][m].dtype) for m in MATRICES}
  # both models are all-dense-layer stacks of one superblock structure, so they share the grouping
  return {**copy_shared_weights(dense_params, schedule, template, schedule), "head_table": table}


def fresh_ties(plan: ModelPlan, seed: int) -> HeadTies | None:
  """DirectShare's head ties (None without head-wise sharing) chosen on the dense counterpart of ``plan``'s model
  initialised from ``seed``: a run's ties when it starts from scratch (Head-wise Shareable Attention Alg. 1)."""
  if not plan.tied_heads:
    return None
  dense = plan.dense_counterpart()
  params = nnx.to_pure_dict(nnx.state(build_model(dense, seed), nnx.Param))
  return direct_share(dense_kernels(params, dense.schedule, plan.model.num_layers), plan.tied_heads,
                      plan.schedule_config.headwise.match)


def compute_ties(plan: ModelPlan, seed: int, source: runs.Run | None = None) -> HeadTies | None:
  """Choose DirectShare's head ties (None without head-wise sharing) on the dense model the run starts from:
  ``source``, the ``train.init_from`` run (uptraining, :func:`ties_from_source`), else the dense model initialised
  from ``seed`` (:func:`fresh_ties`). Called once per run, when it is created: the run then stores its ties
  (:func:`jaxshare.store.runs.write_run_files`).

  Raises:
    ConfigError: as :func:`ties_from_source`.
  """
  if not plan.tied_heads or source is None:
    return fresh_ties(plan, seed)
  return ties_from_source(plan, source)


def ties_from_source(plan: ModelPlan, src: runs.Run) -> HeadTies:
  """The ties of a head-wise model ``plan`` started from ``src`` (``train.init_from``): a head-wise ``src`` passes on
  its own ties; a PostShare ``src`` gives exactly the pairs its penalty pulled together (each component's
  representative chosen on its trained weights); a dense one gets DirectShare's choice on its weights.

  Raises:
    ConfigError: ``src`` is not a dense MHA run, or is a head-wise or PostShare run whose ties disagree with
      ``schedule.headwise`` (another count or match function).
  """
  schedule, headwise = plan.schedule, plan.schedule_config.headwise
  source = f"train.init_from={str(src.directory) if src.directory is not None else 'the source model'!r}"
  if src.ties is not None:  # already head-wise (e.g. `convert uptrain`'s output): training goes on with its ties
    theirs = src.plan.schedule_config.headwise
    if (src.schedule.tied_heads, theirs.match) != (schedule.tied_heads, headwise.match):
      raise ConfigError(f"{source} ties {src.schedule.tied_heads} heads matched by {theirs.match!r}; "
                        f"schedule.headwise (ratio {headwise.ratio}, match {headwise.match!r}) would tie "
                        f"{schedule.tied_heads} by {headwise.match!r}: set schedule.headwise.ratio={theirs.ratio} and "
                        f"match={theirs.match!r}")
    return src.ties
  if not parse_kind(src.schedule.kind).dense:
    raise ConfigError(f"{source} has schedule {src.schedule.kind!r}: head-wise sharing is selected on a dense MHA "
                      "model (or continued from a head-wise one)")
  weights = dense_kernels(distributed.to_host(src.params), src.schedule, plan.model.num_layers)
  post = src.files.pairs() if src.files is not None else None
  if post is None:
    return direct_share(weights, schedule.tied_heads, headwise.match)
  if len(post.pairs["q"]) != schedule.tied_heads:
    raise ConfigError(f"{source} is a PostShare run that penalised {len(post.pairs['q'])} head pairs "
                      f"(train.postshare_ratio={post.ratio}); schedule.headwise.ratio={headwise.ratio} would tie "
                      f"{schedule.tied_heads}: set schedule.headwise.ratio={post.ratio} to tie exactly the penalised "
                      "pairs")
  if post.match != headwise.match:
    raise ConfigError(f"schedule.headwise.match={headwise.match!r} is invalid with {source}: its PostShare pairs were "
                      f"matched with {post.match!r}")
  return ties_from_pairs(weights, post.pairs, post.match)
