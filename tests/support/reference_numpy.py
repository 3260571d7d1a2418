"""An independent float64 NumPy forward pass of the transformer, layer by layer, for parity tests.

It reads the NNX model's parameters but shares no code with jaxshare's model: explicit K/V head repetition,
per-layer loops, its own RoPE, norms, MLPs and masking.
"""

import math

import jax
import numpy as np

from jaxshare.config import ModelConfig
from jaxshare.model.params import layer_params as _layer_params
from jaxshare.schedule import Schedule

_erf = np.vectorize(math.erf)


def _rope(x, pos, theta, rot):
  half = rot // 2
  inv = theta ** (-np.arange(half) * 2.0 / rot)
  ang = pos[..., None] * inv                          # [B,T,half]
  c, s = np.cos(ang)[:, :, None], np.sin(ang)[:, :, None]
  x1, x2 = x[..., :half], x[..., half:rot]
  return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, x[..., rot:]], axis=-1)


def _norm(cfg, p, x):
  if cfg.flavor == "llama":
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps) * p["scale"]
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + cfg.norm_eps) * p["scale"] + p["bias"]


def _dense(p, x, spec):
  y = np.einsum(spec, x, p["kernel"])
  return y + p["bias"] if p.get("bias") is not None else y


def forward(cfg: ModelConfig, schedule: Schedule, params: dict, tokens, positions=None, segment_ids=None,
            lisa_rope: bool = False, wc_normed: bool = False):
  """float64 logits ``[B, T, V]`` (``lisa_rope``: RoPE on LISA's low-rank Q/K; ``wc_normed``: UniAttn's W_c reads
  Norm(x) instead of x)."""
  tokens = np.asarray(tokens)
  b, t = tokens.shape
  pos = np.broadcast_to(np.arange(t), (b, t)) if positions is None else np.asarray(positions)
  seg = np.ones((b, t), int) if segment_ids is None else np.asarray(segment_ids)
  H, d = cfg.num_heads, cfg.resolved_head_dim
  rot = int(d * cfg.rotary_pct)
  emb = np.asarray(params["embedding"], np.float64)
  x = emb[tokens]
  mask = (seg[:, :, None] == seg[:, None, :]) & (np.arange(t)[:, None] >= np.arange(t)[None, :])
  kv, logits_of, probs_of = {}, {}, {}

  def softmax(a):
    a = np.where(mask[:, None], a, -np.inf)
    e = np.exp(a - a.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)

  for plan in schedule.layers:
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), _layer_params(params, schedule, plan.index))
    h = _norm(cfg, p["norm1"], x)
    if plan.is_producer:
      v = _dense(p["attn"]["v_proj"], h, "btd,dgk->btgk")
      k = (_rope(_dense(p["attn"]["k_proj"], h, "btd,dgk->btgk"), pos, cfg.rope_theta, rot)
           if "k_proj" in p["attn"] else None)
      kv[plan.index] = (k, v)
    k, v = kv[plan.kv_source]
    rep = H // v.shape[2]
    v = np.repeat(v, rep, axis=2)
    if plan.score_reuse == "probs":
      logits, probs = logits_of[plan.score_source], probs_of[plan.score_source]
    elif plan.score_reuse == "logits":
      logits = logits_of[plan.score_source]
      if plan.integrator != "none":
        r = schedule.lisa_rank
        q_lr = _dense(p["attn"]["q_lr"], h, "btd,dhk->bthk")
        k_lr = _dense(p["attn"]["k_lr"], h, "btd,dgk->btgk")
        if lisa_rope:
          q_lr, k_lr = (_rope(z, pos, cfg.rope_theta, r - r % 2) for z in (q_lr, k_lr))
        k_lr = np.repeat(k_lr, rep, axis=2)
        delta = np.einsum("bthk,bshk->bhts", q_lr, k_lr) / math.sqrt(r)
        z = np.concatenate([logits, delta], axis=1)  # [B, 2H, T, S]
        if plan.integrator == "add":
          logits = logits + delta
        elif plan.integrator == "linear":
          logits = np.einsum("bets,eh->bhts", z, p["attn"]["align"])
        else:
          hid = np.maximum(np.einsum("bets,ef->bfts", z, p["attn"]["align_in"]), 0)
          logits = np.einsum("bfts,fh->bhts", hid, p["attn"]["align_out"])
      probs = softmax(logits)
    else:
      q = _rope(_dense(p["attn"]["q_proj"], h, "btd,dhk->bthk"), pos, cfg.rope_theta, rot)
      logits = np.einsum("bthk,bshk->bhts", q, np.repeat(k, rep, axis=2)) / math.sqrt(d)
      probs = softmax(logits)
    logits_of[plan.index], probs_of[plan.index] = logits, probs
    a = _dense(p["attn"]["o_proj"], np.einsum("bhts,bshk->bthk", probs, v), "bthk,hkd->btd")
    if plan.compensation:
      a = a + ((h if wc_normed else x) @ p["compensation"]["kernel"])

    def mlp(z):
      if cfg.flavor == "llama":
        g = _dense(p["mlp"]["gate"], z, "btd,df->btf")
        return _dense(p["mlp"]["down"], g / (1 + np.exp(-g)) * _dense(p["mlp"]["up"], z, "btd,df->btf"),
                      "btf,fd->btd")
      u = _dense(p["mlp"]["up"], z, "btd,df->btf")
      return _dense(p["mlp"]["down"], 0.5 * u * (1 + _erf(u / math.sqrt(2))), "btf,fd->btd")

    if cfg.flavor == "neox":
      x = x + a + mlp(_norm(cfg, p["norm2"], x))
    else:
      x = x + a
      x = x + mlp(_norm(cfg, p["norm2"], x))
  fn = {k: np.asarray(v, np.float64) for k, v in params["final_norm"].items()}
  x = _norm(cfg, fn, x)
  head = emb.T if params.get("lm_head") is None else np.asarray(params["lm_head"]["kernel"], np.float64)
  return x @ head
