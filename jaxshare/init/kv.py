"""K/V sharing from a model that projects its own K/V in every layer: each producer layer's K/V projections.

Every target layer that projects K/V (a producer) serves a group of reader layers (itself and its consumers). Its
``k_proj`` / ``v_proj`` kernels and biases are built from the source's projections of exactly those layers:

- heads: the source's H heads mean-pooled into the target's G groups of H/G consecutive heads (GQA, Ainslie et al.
  2023, Sec. 2.1: "the key and value head for each group is constructed by mean-pooling all the original heads
  within that group"; MQA is G = 1);
- layers: the group's head-pooled projections combined by ``kv_pool``: ``mean`` (uniform mean over the group, MLKV
  Sec. 4.2) or ``running`` (pythia-mlkv's conversion script: a running pairwise mean ``acc = (acc + w_l) / 2`` over the
  group's layers in order, which weights the last layer by 1/2 and the first by 1/2^(n-1)), or ``producer`` (this
  project's rule for CLA, which its paper trains from scratch: the producer layer's own projection, the consumers'
  dropped).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxshare.config.choices import KVPool, parse
from jaxshare.model import params as P
from jaxshare.schedule import Schedule

_KV = ("k_proj", "v_proj")


def pool_heads(x: jax.Array, groups: int) -> jax.Array:
  """``[..., H, d]`` -> ``[..., G, d]``: the mean of each group of H/G consecutive heads (query head h reads K/V
  group ``h // (H/G)``, as in :mod:`jaxshare.kernels.reference`).

  Raises:
    ValueError: G does not divide H.
  """
  h, d = x.shape[-2:]
  if h % groups:
    raise ValueError(f"cannot mean-pool {h} K/V heads into {groups} groups: {groups} must divide {h}")
  return x.reshape(*x.shape[:-2], groups, h // groups, d).mean(-2)


def combine_layers(xs: list[jax.Array], kv_pool: str) -> jax.Array:
  """Combine one group's per-layer projections (in layer order) by ``kv_pool`` (see the module docstring).

  Raises:
    ValueError: ``kv_pool`` is not ``mean``, ``running`` or ``producer``.
  """
  kv_pool = parse(KVPool, kv_pool, "kv_pool")
  if kv_pool == "producer":
    return xs[0]
  if kv_pool == "mean":
    return sum(xs[1:], xs[0]) / len(xs)
  if kv_pool == "running":
    acc = xs[0]
    for x in xs[1:]:
      acc = (acc + x) / 2
    return acc
  raise ValueError(f"kv_pool={kv_pool!r} is invalid: must be mean, running or producer")


def reader_groups(schedule: Schedule) -> dict[int, list[int]]:
  """``{producer layer: [layers attending with its K/V, in order]}``."""
  groups: dict[int, list[int]] = {}
  for plan in schedule.layers:
    groups.setdefault(plan.kv_source, []).append(plan.index)
  return groups


def convertible_groups(src_schedule: Schedule, dst_schedule: Schedule) -> dict[int, list[int]]:
  """The target's reader groups whose every layer projects its own K/V in the source (and whose head counts
  divide): those :func:`convert_kv` builds; any other producer keeps its fresh initialisation."""
  src = {p.index: p for p in src_schedule.layers}
  return {producer: readers for producer, readers in reader_groups(dst_schedule).items()
          if all(src[r].kv_source == r and src[r].num_kv_heads % dst_schedule.layers[producer].num_kv_heads == 0
                 for r in readers)}


def convert_kv(src: dict, src_schedule: Schedule, dst: dict, dst_schedule: Schedule, *, kv_pool: str = "mean"
               ) -> dict:
  """``dst`` with every producer's ``k_proj`` / ``v_proj`` (kernel and bias) pooled from ``src``. Traceable.

  Only :func:`convertible_groups` are converted; the report says which are not.
  """
  out = dst
  for producer, readers in convertible_groups(src_schedule, dst_schedule).items():
    layer = P.layer_params(out, dst_schedule, producer)
    attn = dict(layer["attn"])
    for m in (m for m in _KV if m in attn):  # probability reusers project V only
      leaves = {}
      for leaf, target in attn[m].items():
        per_layer = []
        for r in readers:
          source = P.layer_params(src, src_schedule, r)["attn"][m][leaf].astype(jnp.float32)
          per_layer.append(pool_heads(source, target.shape[-2]))
        leaves[leaf] = combine_layers(per_layer, kv_pool).astype(target.dtype)
      attn[m] = leaves
    out = P.replace_layer(out, dst_schedule, producer, {**layer, "attn": attn})
  return out


def kv_report(src_schedule: Schedule, dst_schedule: Schedule, kv_pool: str) -> list[str]:
  """One line per target producer layer saying how its K/V were built (static: shapes and schedules only)."""
  h_src = {p.index: p.num_kv_heads for p in src_schedule.layers}
  ok = convertible_groups(src_schedule, dst_schedule)
  lines = []
  for producer, readers in reader_groups(dst_schedule).items():
    if producer not in ok:
      lines.append(f"layer {producer} k_proj/v_proj: NEW (fresh initialisation): the source does not project K/V "
                   f"in every layer of {readers} with a head count divisible by the target's")
      continue
    g = dst_schedule.layers[producer].num_kv_heads
    heads = f"{h_src[readers[0]]} -> {g} heads (mean of groups)" if h_src[readers[0]] != g else f"{g} heads"
    how = {"mean": f"mean over layers {readers}", "running": f"running pairwise mean over layers {readers}",
           "producer": f"layer {producer}'s own (its readers {readers})"}[kv_pool] if len(readers) > 1 \
      else f"from layer {producer}"
    lines.append(f"layer {producer} k_proj/v_proj: {how}, {heads}")
  return lines
