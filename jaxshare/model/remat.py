"""Rematerialisation policies (``model.remat``): what each layer keeps for the backward pass, and how a superblock
keeps what its layers share.

Two levels, so that a shared schedule never keeps more than dense does:

- **Per layer** (every schedule): the layer runs under ``jax.checkpoint`` with the policy of its name. ``full`` keeps
  the layer's input only; the others keep the named projection outputs as MaxText's policies of the same names do
  (``jax.checkpoint_policies``; MaxText ``decoders.py``). A layer's backward pass then holds one layer's
  activations, whatever the size of its superblock.
- **Per superblock** (superblocks of several layers): the superblock runs under ``jax.checkpoint`` too, keeping the
  score sources' log-sum-exp (:data:`SCORE_LSE`, ``[B, H, T]`` float32) and, under every policy but ``full``, its
  layers' inputs (:data:`LAYER_INPUT`) and what the layer policy keeps. ``full`` keeps the superblock's input alone,
  as a dense layer keeps its own: the backward pass first replays the superblock's layers but the last, each under
  its own checkpoint (one layer's activations at a time), to recover their outputs. What the layers share — a
  producer's K/V, a score source's Q, a LISA chain's low-rank features — is computed at the superblock level,
  outside the layers' checkpoints (:meth:`~jaxshare.model.block.DecoderLayer.prepare`), so the backward pass
  recomputes it once for all its readers, and neither keeps it per layer nor recomputes a producer's K/V
  projections inside every reader. Without this level the readers' checkpoints would keep the shared tensors as
  residuals (a CLA2 producer's K/V: two ``[B, T, D]`` arrays per superblock more than dense keeps). A probability
  reuser sends its gradient into its source's Q and K through the source's projections at once
  (:mod:`jaxshare.model.source_projection`), so that no gradient the size of Q and K lives across the superblock's
  backward pass either.

Measured on the ~1.2B Llama compiled for one H100 at 128k tokens (``train.num_vocab_tiling=8``): ``full`` keeping
each layer's input needed 39.66 GiB with CLA2 and 40.81 GiB with MLKV 4x8 against dense's 39.16 GiB (a shared K/V's
gradient lives across its readers' backward passes), keeping the superblock's alone 35.66 and 34.81 GiB, for 2.6%
and 5.5% more executed FLOPs (the replayed layers).

Without rematerialisation (``none``) every superblock still runs under ``jax.checkpoint``, with
:func:`keep_all_but_elementwise`: the backward pass recomputes casts, elementwise arithmetic and layout changes from
what is kept, as XLA does itself when it fuses them into their consumers in an unrolled program. A scanned stack
cannot fuse across its loop: without the policy it stacked every such result as a residual (the ~1.2B Llama's four
float32 copies of each layer's residual stream took 16 GiB at 32k tokens, and the step 68.55 GiB on one H100; with
it 51.22 GiB, for the same executed FLOPs). A stack whose superblocks hold several layers is unrolled under ``none``,
and under ``minimal`` where they hold more than two (:func:`jaxshare.model.block.unrolled`). What must be recomputed
whatever an enclosing policy keeps (probability reuse in XLA, a LISA chain's chunks) uses
:func:`jaxshare.kernels.recompute.recomputed`, not a nested ``jax.checkpoint``, whose choice an enclosing policy
overrides.

Host offloading (``*_offloaded``) moves the kept arrays to pinned host memory, which jax has on GPUs and TPUs only:
:func:`check_platform` refuses them elsewhere before anything is compiled.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
from flax import nnx
from jax import lax

from jaxshare.config import ConfigError
from jaxshare.config.choices import RematPolicy, parse

# Names of the arrays the policies choose from (jax.ad_checkpoint.checkpoint_name), MaxText's where they mean the same.
QUERY_PROJ, KEY_PROJ, VALUE_PROJ, OUT_PROJ = "query_proj", "key_proj", "value_proj", "out_proj"
LAYER_INPUT = "layer_input"  # a layer's input residual stream [B, T, D], kept by every superblock checkpoint
SCORE_LSE = "score_lse"  # a score source's log-sum-exp [B, H, T] float32, which its probability reusers read

_QKV = (QUERY_PROJ, KEY_PROJ, VALUE_PROJ)
_OFFLOAD = dict(offload_src="device", offload_dst="pinned_host")
# each offloading policy and the policy that keeps the same arrays on the device
OFFLOADED = {RematPolicy.MINIMAL_OFFLOADED: RematPolicy.MINIMAL,
             RematPolicy.QKV_PROJ_OFFLOADED: RematPolicy.SAVE_QKV_PROJ}
_OFFLOAD_PLATFORMS = ("gpu", "tpu")
# What model.remat=none recomputes rather than keeps: elementwise arithmetic, casts and layout changes, which read
# only what is kept and cost no matmul.
_ELEMENTWISE = frozenset({
  lax.convert_element_type_p, lax.add_p, lax.sub_p, lax.mul_p, lax.div_p, lax.neg_p, lax.max_p, lax.min_p,
  lax.exp_p, lax.log_p, lax.rsqrt_p, lax.sqrt_p, lax.square_p, lax.integer_pow_p, lax.logistic_p, lax.tanh_p,
  lax.erf_p, lax.sin_p, lax.cos_p, lax.select_n_p, lax.broadcast_in_dim_p, lax.reshape_p, lax.squeeze_p,
  lax.transpose_p, lax.concatenate_p, lax.pad_p, lax.slice_p})


def keep_all_but_elementwise(prim, *_, **__) -> bool:
  """``model.remat=none``'s policy: keep every result but those of elementwise, cast and layout primitives, which the
  backward pass recomputes from what is kept (module docstring). Named results (``checkpoint_name``) are kept."""
  return prim not in _ELEMENTWISE


@functools.cache
def layer_policy(name: str) -> Callable | None:
  """The ``jax.checkpoint`` policy of ``model.remat=name`` for one layer (None: save nothing but the inputs).

  Raises:
    ValueError: ``none`` (no checkpoint at all) or an unknown name.
  """
  policy = parse(RematPolicy, name, "model.remat")
  cp = jax.checkpoint_policies
  table = {
    RematPolicy.FULL: None,
    RematPolicy.MINIMAL: cp.checkpoint_dots_with_no_batch_dims,
    RematPolicy.SAVE_QKV_PROJ: cp.save_only_these_names(*_QKV),
    RematPolicy.SAVE_DOT_EXCEPT_MLP: cp.save_only_these_names(*_QKV, OUT_PROJ),
    RematPolicy.SAVE_OUT_PROJ: cp.save_only_these_names(OUT_PROJ),
    RematPolicy.MINIMAL_OFFLOADED: cp.offload_dot_with_no_batch_dims(**_OFFLOAD),
    RematPolicy.QKV_PROJ_OFFLOADED: cp.save_and_offload_only_these_names(
      names_which_can_be_saved=[], names_which_can_be_offloaded=list(_QKV), **_OFFLOAD),
  }
  if policy not in table:
    raise ValueError(f"model.remat={name!r} has no checkpoint policy: it rematerialises nothing")
  return table[policy]


@functools.cache
def superblock_policy(name: str) -> Callable:
  """The policy of a superblock's checkpoint under ``model.remat=name``: under ``none``
  :func:`keep_all_but_elementwise`; else every score source's log-sum-exp and, unless ``full``, every layer's input
  and what the layer policy keeps (so that the layers' checkpoints find it kept)."""
  if not enabled(name):
    return keep_all_but_elementwise
  inner = layer_policy(name)
  if inner is None:  # full: the superblock's input alone (its checkpoint's argument) and the score statistics
    return jax.checkpoint_policies.save_only_these_names(SCORE_LSE)
  shared = jax.checkpoint_policies.save_only_these_names(LAYER_INPUT, SCORE_LSE)

  def policy(prim, *args, **params):
    return shared(prim, *args, **params) or inner(prim, *args, **params)
  return policy


def enabled(name: str) -> bool:
  """Whether ``model.remat=name`` rematerialises anything."""
  return parse(RematPolicy, name, "model.remat") != RematPolicy.NONE


def keeps_every_matmul(name: str) -> bool:
  """Whether ``model.remat=name`` keeps every weight matmul's output on the device (``minimal``), the MLP's included:
  the most a layer keeps under a policy."""
  return parse(RematPolicy, name, "model.remat") == RematPolicy.MINIMAL


def offloads(name: str) -> bool:
  """Whether ``model.remat=name`` moves what it keeps to pinned host memory."""
  return parse(RematPolicy, name, "model.remat") in OFFLOADED


def checkpoint(fn: Callable, policy: Callable | None, static_argnums: tuple[int, ...] = ()) -> Callable:
  """``fn`` (whose first argument is an NNX module) under ``nnx.remat`` with ``policy``. With ``prevent_cse`` (jax's
  default) the backward pass's recomputation waits behind an optimisation barrier on its inputs and the incoming
  cotangent, so a layer is recomputed only when its backward pass is due: without it the ~1.2B MLKV 4x8 step at
  128k tokens held 2.8 GiB more (two layers' recomputed activations at once)."""
  return nnx.remat(fn, policy=policy, prevent_cse=True, static_argnums=static_argnums)


def check_platform(name: str, platform: str) -> None:
  """Refuse a policy the platform being compiled for lacks, before anything is compiled.

  Raises:
    ConfigError: a host-offloading policy on a platform without pinned host memory (a CPU).
  """
  policy = parse(RematPolicy, name, "model.remat")
  if policy in OFFLOADED and platform not in _OFFLOAD_PLATFORMS:
    raise ConfigError(f"model.remat={name} offloads to pinned host memory, which jax has on GPUs and TPUs only; this "
                      f"run compiles for {platform}. Use model.remat={OFFLOADED[policy]} to keep the same arrays on "
                      "the device")
