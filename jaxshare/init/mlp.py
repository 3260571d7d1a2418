"""MLP widening for parameter matching (``schedule.match_params``, MLKV's parameter matching).

The first F neurons of each widened MLP are the source's; the F' - F new ones follow ``train.init_mlp_widen``:
``duplicate`` (pythia-mlkv's conversion script: copies of the source's first F' - F neurons, in- and out-weights and
biases, so their contribution doubles and the function changes) or ``zero`` (fresh input weights, zero output rows:
the widened MLP computes exactly the source's function, and the new neurons still learn, since their output rows
receive gradients).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxshare.config.choices import MLPWiden, parse
from jaxshare.model import params as P
from jaxshare.schedule import Schedule



def widen_mlp(src: dict, src_schedule: Schedule, dst: dict, dst_schedule: Schedule, *, rule: str = "zero") -> dict:
  """``dst`` with every MLP of another width than the source's built from it: wider (F' > F hidden units) by ``rule``
  (see the module docstring; ``duplicate`` repeats the source's neurons cyclically when F' > 2F), narrower (a matched
  model that adds parameters elsewhere, or a target larger than its GQA source) from the source's first F' units.
  Traceable.

  Raises:
    ValueError: ``rule`` is invalid.
  """
  rule = parse(MLPWiden, rule, "train.init_mlp_widen")
  out = dst
  for layer in range(len(dst_schedule.layers)):
    s_mlp = P.layer_params(src, src_schedule, layer)["mlp"]
    d_layer = P.layer_params(out, dst_schedule, layer)
    f, f_new = s_mlp["up"]["kernel"].shape[-1], d_layer["mlp"]["up"]["kernel"].shape[-1]
    if f_new == f:
      continue
    if f_new < f:
      mlp = {name: {leaf: jax.lax.slice_in_dim(s_mlp[name][leaf], 0, f_new, axis=0 if name == "down" else -1)
                    if s_mlp[name][leaf].shape != target.shape else s_mlp[name][leaf]
                    for leaf, target in proj.items()} for name, proj in d_layer["mlp"].items()}
      out = P.replace_layer(out, dst_schedule, layer, {**d_layer, "mlp": mlp})
      continue
    extra = jnp.arange(f_new - f) % f
    mlp = {}
    for name, proj in d_layer["mlp"].items():
      leaves = {}
      for leaf, target in proj.items():
        source = s_mlp[name][leaf]
        hidden_axis = 0 if name == "down" else -1  # [D, F] in, [F, D] out; biases [F] in, [D] out
        if source.shape == target.shape:
          leaves[leaf] = source
          continue
        if rule == "duplicate":
          new = jnp.take(source, extra, axis=hidden_axis)
        elif name == "down":
          new = jnp.zeros((f_new - f, *source.shape[1:]), source.dtype)
        else:
          new = jax.lax.slice_in_dim(target, f, f_new, axis=hidden_axis)
        leaves[leaf] = jnp.concatenate([source, new.astype(source.dtype)], axis=hidden_axis)
      mlp[name] = leaves
    out = P.replace_layer(out, dst_schedule, layer, {**d_layer, "mlp": mlp})
  return out


def widened_layers(src: dict, src_schedule: Schedule, dst: dict, dst_schedule: Schedule) -> dict[int, tuple[int, int]]:
  """``{layer: (F, F')}`` for the layers whose MLP :func:`widen_mlp` resizes (shapes only)."""
  def width(params, schedule, layer):
    return jax.eval_shape(lambda: P.layer_params(params, schedule, layer)["mlp"]["up"]["kernel"]).shape[-1]
  out = {}
  for layer in range(len(dst_schedule.layers)):
    f, f_new = width(src, src_schedule, layer), width(dst, dst_schedule, layer)
    if f_new != f:
      out[layer] = (f, f_new)
  return out
