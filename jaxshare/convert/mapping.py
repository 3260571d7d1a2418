"""Mapping tables between Hugging Face state dicts and jaxshare parameter trees.

An architecture is one :class:`Architecture`: how its ``config.json`` becomes jaxshare config overrides, and a table
of :class:`Rule` s, each turning one or more HF tensors into one or more jaxshare leaves (and back). Layer rules
address a layer's unstacked parameters (``attn/q_proj/kernel``) and HF names with ``{i}`` for the layer index, so one
table serves every schedule (``model/params.py`` finds the layer in the scanned stacks).

HF linear weights are ``[out, in]``; jaxshare kernels are ``[in, ...out]`` with heads split out (``[D, H, d]`` for
Q/K/V, ``[H, d, D]`` for the output projection), so most rules are a transpose and a reshape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence

import numpy as np
from tqdm.auto import tqdm

from jaxshare.config import ModelConfig
from jaxshare.exit_codes import InputError
from jaxshare.model import params as P
from jaxshare.plan import ModelPlan


class UnsupportedModelError(InputError, ValueError):
  """An HF model jaxshare cannot represent exactly: names the config field, its value and what is supported."""


@dataclasses.dataclass(frozen=True)
class Dims:
  """Model dimensions the rules reshape with: D model width, H query heads, G K/V heads, d head width, F MLP width,
  V vocabulary; per layer (:attr:`Architecture.layer_dims`) LISA's rank r and aligner width A."""

  D: int
  H: int
  G: int
  d: int
  F: int
  V: int
  r: int = 0
  A: int = 0


@dataclasses.dataclass(frozen=True)
class Rule:
  """HF tensors ``hf`` (names; ``{i}`` is the layer) <-> jaxshare leaves ``paths`` ('/'-separated within the layer,
  or from the tree's root for global rules).

  ``hf_shapes(dims)`` gives the HF shapes, checked before conversion; ``to_jax`` / ``to_hf`` map lists of arrays in
  the order of ``hf`` and ``paths``.
  """

  hf: tuple[str, ...]
  paths: tuple[str, ...]
  hf_shapes: Callable[[Dims], Sequence[tuple[int, ...]]]
  to_jax: Callable[[list[np.ndarray], Dims], list[np.ndarray]]
  to_hf: Callable[[list[np.ndarray], Dims], list[np.ndarray]]


def same(hf: str, path: str, shape: Callable[[Dims], tuple[int, ...]]) -> Rule:
  """A tensor stored identically on both sides (norm scales and biases, embeddings)."""
  return Rule((hf,), (path,), lambda n: [shape(n)], lambda a, n: list(a), lambda a, n: list(a))


def linear(hf: str, path: str, in_shape: Callable[[Dims], tuple[int, ...]],
           out_shape: Callable[[Dims], tuple[int, ...]]) -> Rule:
  """An HF ``[out, in]`` weight <-> a jaxshare ``[*in_shape, *out_shape]`` kernel: ``in_shape`` ``(D,)`` and
  ``out_shape`` ``(H, d)`` for a Q projection, ``(H, d)`` and ``(D,)`` for the output projection."""
  def to_jax(a, n):
    return [a[0].T.reshape(*in_shape(n), *out_shape(n))]

  def to_hf(a, n):
    return [a[0].reshape(int(np.prod(in_shape(n))), int(np.prod(out_shape(n)))).T]

  return Rule((hf,), (path,), lambda n: [(int(np.prod(out_shape(n))), int(np.prod(in_shape(n))))], to_jax, to_hf)


@dataclasses.dataclass(frozen=True)
class Architecture:
  """One HF architecture: its names, config translation and tensor tables.

  Attributes:
    hf_names: ``architectures[0]`` values (and ``model_type``) this table reads.
    config_overrides: HF ``config.json`` -> jaxshare dotted overrides; raises :class:`UnsupportedModelError`.
    hf_config: ``(plan, seq_len)`` -> HF ``config.json`` of the model of a :class:`~jaxshare.plan.ModelPlan`
      trained on ``seq_len`` tokens (export; the inverse of ``config_overrides``).
    global_rules / layer_rules: the tables of a model (a :class:`~jaxshare.config.ModelConfig`: tied embeddings and
      biases change them).
    ignored: HF tensor-name suffixes that carry no parameters (rotary caches, causal-mask buffers).
    layer_dims: ``(dims, schedule, layer) -> Dims`` of one layer, for tables whose layers differ (per-layer K/V heads,
      LISA ranks); None: every layer has ``dims``.
    rules_by_presence: a rule applies where the model has its parameters (layers that differ in what they own);
      otherwise every rule applies everywhere and a missing parameter is an error.
  """

  hf_names: tuple[str, ...]
  config_overrides: Callable[[dict], list[str]]
  hf_config: Callable[[ModelPlan, int], dict]
  global_rules: Callable[[ModelConfig], list[Rule]]
  layer_rules: Callable[[ModelConfig], list[Rule]]
  ignored: tuple[str, ...] = ()
  layer_dims: Callable[[Dims, object, int], Dims] | None = None
  rules_by_presence: bool = False

  def rules_for(self, rules: list[Rule], tree: dict) -> list[Rule]:
    """The rules that apply to a (layer or global) parameter tree.

    Raises:
      UnsupportedModelError: with ``rules_by_presence``, a parameter of the tree that no rule covers (it would be
        left out of an export).
    """
    if not self.rules_by_presence:
      return rules
    present = set(P.flat_leaves(tree))
    chosen = [r for r in rules if all(p in present for p in r.paths)]
    uncovered = sorted(present - {p for r in chosen for p in r.paths})
    if uncovered:
      raise UnsupportedModelError(f"jaxshare parameters the {self.hf_names[0]} table has no rule for: {uncovered[:8]}")
    return chosen

  def dims_of(self, dims: Dims, schedule, layer: int) -> Dims:
    """The dimensions of one layer."""
    return dims if self.layer_dims is None else self.layer_dims(dims, schedule, layer)


def _get(tree: dict, path: str):
  for key in path.split("/"):
    tree = tree[key]
  return tree


def hf_to_params(arch: Architecture, plan: ModelPlan, dims: Dims, template: dict, read, names: Sequence[str], *,
                 progress: bool = False) -> dict:
  """Fill ``template`` (a pure-dict tree of writable NumPy arrays, the parameters of the model of ``plan``) in place
  from HF tensors, one tensor at a time (no second copy of the model is made).

  Args:
    read: ``read(name, shape) -> np.ndarray`` (e.g. :meth:`HFCheckpoint.read`, which checks the shape).
    names: every tensor name of the checkpoint; any that no rule consumes (and not ``arch.ignored``) is an error.
    progress: a tqdm bar over the layers (large checkpoints).

  Returns:
    The parameter tree as NumPy arrays in the template's dtypes.

  Raises:
    UnsupportedModelError: tensors the table does not know (unexpected tensors).
  """
  out = template
  used: set[str] = set()

  def apply(rule: Rule, fmt: dict, dst: dict, index=None, dims=dims):
    names_ = [h.format(**fmt) for h in rule.hf]
    arrays = [read(h, s) for h, s in zip(names_, rule.hf_shapes(dims))]
    used.update(names_)
    for path, value in zip(rule.paths, rule.to_jax(arrays, dims)):
      leaf = _get(dst, path)
      where = ... if index is None else index
      if tuple(value.shape) != leaf[where].shape:
        raise UnsupportedModelError(f"{names_} converts to shape {list(value.shape)} but jaxshare's {path} is "
                                    f"{list(leaf[where].shape)}")
      leaf[where] = value  # cast to the leaf's dtype by the assignment

  global_tree = {k: v for k, v in out.items() if k != P.STACKS}
  global_rules = arch.rules_for(arch.global_rules(plan.model), global_tree)
  for rule in global_rules:
    apply(rule, {}, out)
  unfilled = sorted(set(P.flat_leaves(global_tree)) - {p for r in global_rules for p in r.paths})
  layer_paths = {p for r in arch.layer_rules(plan.model) for p in r.paths}
  schedule = plan.schedule
  for layer in tqdm(range(plan.model.num_layers), desc="layers", disable=not progress, dynamic_ncols=True):
    run_tree, index = P.layer_slot(out, schedule, layer)
    for rule in arch.rules_for(arch.layer_rules(plan.model), run_tree):
      apply(rule, {"i": layer}, run_tree, index, arch.dims_of(dims, schedule, layer))
    unfilled += [f"layer {layer}: {p}" for p in sorted(set(P.flat_leaves(run_tree)) - layer_paths)]
  if unfilled:
    raise UnsupportedModelError(f"jaxshare parameters with no source in the {arch.hf_names[0]} table: {unfilled[:8]}")
  unexpected = sorted(n for n in names if n not in used and not any(n.endswith(suffix) for suffix in arch.ignored))
  if unexpected:
    raise UnsupportedModelError(f"the checkpoint has tensors the {arch.hf_names[0]} table does not map "
                                f"(a feature jaxshare does not model?): {unexpected[:8]}"
                                + (f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else ""))
  return out


def params_to_hf(arch: Architecture, plan: ModelPlan, dims: Dims, params: dict, *, progress: bool = False
                 ) -> Iterator[dict[str, np.ndarray]]:
  """The HF state dict of the parameter tree of the model of ``plan`` (NumPy arrays in the tree's dtypes), one
  group at a time: the global
  tensors, then each layer's, so that a writer holds one layer's converted tensors, not the model's.
  ``progress``: a bar over layers."""
  def emit(rule: Rule, fmt: dict, leaves: list[np.ndarray], dims: Dims = dims) -> dict[str, np.ndarray]:
    out = {}
    for name, value, shape in zip(rule.hf, rule.to_hf(leaves, dims), rule.hf_shapes(dims)):
      assert tuple(value.shape) == tuple(shape), (name, value.shape, shape)
      out[name.format(**fmt)] = np.ascontiguousarray(value)
    return out

  global_tree = {k: v for k, v in params.items() if k != P.STACKS}
  schedule = plan.schedule
  yield {k: v for rule in arch.rules_for(arch.global_rules(plan.model), global_tree)
         for k, v in emit(rule, {}, [np.asarray(_get(params, p)) for p in rule.paths]).items()}
  for layer in tqdm(range(plan.model.num_layers), desc="layers", disable=not progress, dynamic_ncols=True):
    layer_tree = P.layer_params(params, schedule, layer)
    layer_dims = arch.dims_of(dims, schedule, layer)
    yield {k: v for rule in arch.rules_for(arch.layer_rules(plan.model), layer_tree)
           for k, v in emit(rule, {"i": layer}, [np.asarray(_get(layer_tree, p)) for p in rule.paths],
                            layer_dims).items()}
