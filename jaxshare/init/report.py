"""What a conversion did: one line per rule applied (shapes and schedules only, nothing computed), printed by
``train.py`` when it starts from ``train.init_from`` and by ``python -m jaxshare.convert uptrain``."""

from __future__ import annotations

import jax

from jaxshare.init.kv import convertible_groups, kv_report
from jaxshare.init.lisa import fittable_lisa_layers
from jaxshare.init.mlp import widened_layers
from jaxshare.init.shared import same_shapes
from jaxshare.model import params as P
from jaxshare.schedule import Schedule


def init_report(src: dict, src_schedule: Schedule, dst: dict, dst_schedule: Schedule, kv_pool: str,
                mlp_widen: str = "zero", wc_fitted: bool = False, lisa_start: str = "ds") -> list[str]:
  """How each parameter of ``dst`` was initialised from ``src`` (shapes only, nothing computed): the number copied
  unchanged, one line per K/V producer (:func:`kv_report`), the widened MLPs, LISA's zeroed ``k_lr``, and every
  parameter left at its fresh initialisation (UniAttn's W_c excepted when ``wc_fitted``: the calibration reports
  those)."""
  converted = convertible_groups(src_schedule, dst_schedule)
  widened = widened_layers(src, src_schedule, dst, dst_schedule)
  fitted = set(fittable_lisa_layers(src, src_schedule, dst_schedule)) if lisa_start == "fit" else set()
  low_rank = []
  copied, new = 0, []
  for key in dst:
    if key == P.STACKS:
      continue
    same = same_shapes(src.get(key), dst[key])
    copied, new = (copied + len(jax.tree.leaves(dst[key])), new) if same else (copied, new + [key])
  for layer in range(len(dst_schedule.layers)):
    d = _shapes(jax.eval_shape(lambda: P.layer_params(dst, dst_schedule, layer)))
    s = _shapes(jax.eval_shape(lambda: P.layer_params(src, src_schedule, layer)))
    for path, shape in d.items():
      if path.split("/")[:2] in (["attn", "k_proj"], ["attn", "v_proj"]) and layer in converted:
        continue
      if (path.startswith("mlp/") and layer in widened) or (path.startswith("compensation/") and wc_fitted):
        continue
      if s.get(path) == shape:
        copied += 1
      elif layer in fitted and path.split("/")[1] in ("q_lr", "k_lr"):
        continue
      elif path.startswith("attn/k_lr/"):
        low_rank.append(layer)
      else:
        new.append(f"layer {layer} {path}")
  lines = [f"{copied} tensors copied (same layer, name and shape)", *kv_report(src_schedule, dst_schedule, kv_pool)]
  how = {"zero": "new neurons: fresh input weights, zero output rows (same function)",
         "duplicate": "new neurons: copies of the first ones (pythia-mlkv)"}[mlp_widen]
  lines += [f"layer {layer} mlp: widened {f} -> {f_new} hidden units, the first {f} copied; {how}" if f_new > f else
            f"layer {layer} mlp: narrowed {f} -> {f_new} hidden units, the first {f_new} copied"
            for layer, (f, f_new) in widened.items()]
  if low_rank:
    lines.append(f"layers {sorted(set(low_rank))} attn/k_lr: zero (LISA's A_delta = 0: each starts as DS, the "
                 "previous layer's logits; q_lr random, aligners identity on A_(n-1))")
  if fitted:
    lines.append(f"layers {sorted(fitted)} attn/q_lr, k_lr: fitted, the rank-r truncated SVD of the source layer's "
                 "W_q W_k^T minus its score source's (A_(n-1) + A_delta approximates the layer's own logits; "
                 "jaxshare/init/lisa.py)")
  if new:
    lines.append(f"NEW (fresh initialisation): {', '.join(new)}")
  return lines


def _shapes(tree: dict) -> dict[str, tuple[int, ...]]:
  return {path: tuple(v.shape) for path, v in P.flat_leaves(tree).items()}
