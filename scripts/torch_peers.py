"""PyTorch peers for ``bench_train.py``: a nanoGPT-style minimal Llama and transformers' Llama / GPT-NeoX, each
trained with AdamW as nanoGPT and HF users would (eager, fp32, decay on matrices, global-norm clipping); and, to
calibrate the nanoGPT-style one, the same contestant with nanoGPT's GPT-2 layer raced against nanoGPT itself (its
``model.py`` imported from a checkout named by ``NANOGPT_DIR``, run as its ``train.py`` runs it: its own loss and
``configure_optimizers``)."""

from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn


class _Rope(nn.Module):
  """Rotate-half RoPE over the first ``rotary_dim`` dims (as HF Llama / GPT-NeoX and jaxshare)."""

  def __init__(self, rotary_dim: int, seq_len: int, theta: float):
    super().__init__()
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    angles = torch.outer(torch.arange(seq_len).float(), inv_freq)
    emb = torch.cat([angles, angles], dim=-1)
    self.register_buffer("cos", emb.cos()[None, None], persistent=False)
    self.register_buffer("sin", emb.sin()[None, None], persistent=False)

  def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, H, T, d]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    t = x.shape[2]
    return x * self.cos[:, :, :t] + rotated * self.sin[:, :, :t]


def _causal_attention(qkv: torch.Tensor, heads: int, rope: _Rope | None = None) -> torch.Tensor:
  """Causal SDPA of a fused projection ``[B, T, 3 d]`` (q, k, v), RoPE on q and k if given; ``[B, T, d]``."""
  b, t, d = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
  q, k, v = qkv.view(b, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
  if rope is not None:
    q, k = rope(q), rope(k)
  return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)


class _Block(nn.Module):
  def __init__(self, d: int, heads: int, mlp: int, rope: _Rope):
    super().__init__()
    self.heads, self.rope = heads, rope
    self.norm1, self.norm2 = nn.RMSNorm(d, eps=1e-5), nn.RMSNorm(d, eps=1e-5)
    self.qkv = nn.Linear(d, 3 * d, bias=False)
    self.o = nn.Linear(d, d, bias=False)
    self.gate_up = nn.Linear(d, 2 * mlp, bias=False)
    self.down = nn.Linear(mlp, d, bias=False)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    x = x + self.o(_causal_attention(self.qkv(self.norm1(x)), self.heads, self.rope))
    gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
    return x + self.down(F.silu(gate) * up)


class NanoLlama(nn.Module):
  """nanoGPT's ``model.py`` structure (fused QKV, SDPA causal attention, pre-norm blocks) with the Llama layer of
  jaxshare's default model (RMSNorm, RoPE, SwiGLU, untied head), so that both frameworks train the same math."""

  def __init__(self, vocab: int, layers: int, d: int, heads: int, mlp: int, seq_len: int, theta: float):
    super().__init__()
    rope = _Rope(d // heads, seq_len, theta)
    self.embed = nn.Embedding(vocab, d)
    self.blocks = nn.ModuleList(_Block(d, heads, mlp, rope) for _ in range(layers))
    self.norm = nn.RMSNorm(d, eps=1e-5)
    self.head = nn.Linear(d, vocab, bias=False)
    for p in self.parameters():
      nn.init.normal_(p, std=0.02) if p.dim() >= 2 else None

  def forward(self, tokens: torch.Tensor) -> torch.Tensor:
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x)
    return self.head(self.norm(x))


class _GPT2Block(nn.Module):
  def __init__(self, d: int, heads: int):
    super().__init__()
    self.heads = heads
    self.norm1, self.norm2 = nn.LayerNorm(d, bias=False), nn.LayerNorm(d, bias=False)
    self.qkv = nn.Linear(d, 3 * d, bias=False)
    self.o = nn.Linear(d, d, bias=False)
    self.up = nn.Linear(d, 4 * d, bias=False)
    self.down = nn.Linear(4 * d, d, bias=False)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    x = x + self.o(_causal_attention(self.qkv(self.norm1(x)), self.heads))
    return x + self.down(F.gelu(self.up(self.norm2(x))))


class NanoGPT2(nn.Module):
  """The nanoGPT-style contestant's structure (the same fused QKV, SDPA and pre-norm blocks as :class:`NanoLlama`)
  with the GPT-2 layer nanoGPT trains (LayerNorm without bias, learned positions, exact GELU MLP of 4 x d, head tied
  to the embedding): the same math as nanoGPT's own model, so that the two run at the same speed if the contestant
  is built and trained as nanoGPT is. The calibration ``bench_train.py --nanogpt`` measures."""

  def __init__(self, vocab: int, layers: int, d: int, heads: int, seq_len: int):
    super().__init__()
    self.embed, self.positions = nn.Embedding(vocab, d), nn.Embedding(seq_len, d)
    self.blocks = nn.ModuleList(_GPT2Block(d, heads) for _ in range(layers))
    self.norm = nn.LayerNorm(d, bias=False)
    self.head = nn.Linear(d, vocab, bias=False)
    self.head.weight = self.embed.weight
    for p in self.parameters():
      nn.init.normal_(p, std=0.02) if p.dim() >= 2 else None

  def forward(self, tokens: torch.Tensor) -> torch.Tensor:
    x = self.embed(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
    for block in self.blocks:
      x = block(x)
    return self.head(self.norm(x))


def upstream_nanogpt(shape: dict) -> nn.Module:
  """nanoGPT's own GPT (GPT-2 layer: LayerNorm, learned positions, GELU MLP of 4 x d, tied head; no bias, no
  dropout) at the shape's layers, width, heads, sequence length and vocabulary, from the checkout ``NANOGPT_DIR``.

  Raises:
    ValueError: ``NANOGPT_DIR`` unset or without nanoGPT's ``model.py``.
  """
  checkout = os.environ.get("NANOGPT_DIR", "")
  if not os.path.isfile(os.path.join(checkout, "model.py")):
    raise ValueError(f"NANOGPT_DIR={checkout!r} is invalid: must be a nanoGPT checkout (holding model.py); "
                     "git clone https://github.com/karpathy/nanoGPT")
  sys.path.insert(0, checkout)
  from model import GPT, GPTConfig  # nanoGPT's model.py

  with contextlib.redirect_stdout(sys.stderr):  # it prints its parameter count; stdout is bench_train's protocol
    return GPT(GPTConfig(block_size=shape["seq_len"], vocab_size=shape["vocab"], n_layer=shape["layers"],
                         n_head=shape["heads"], n_embd=shape["d"], dropout=0.0, bias=False))


def build(kind: str, shape: dict) -> nn.Module:
  """``kind``: ``nanogpt`` | ``nanogpt_gpt2`` | ``nanogpt_upstream`` | ``hf_llama`` | ``hf_neox``; ``shape``: the
  benchmark's shape dict."""
  if kind == "nanogpt":
    return NanoLlama(shape["vocab"], shape["layers"], shape["d"], shape["heads"], shape["mlp"], shape["seq_len"],
                     shape["theta"])
  if kind == "nanogpt_gpt2":
    return NanoGPT2(shape["vocab"], shape["layers"], shape["d"], shape["heads"], shape["seq_len"])
  if kind == "nanogpt_upstream":
    return upstream_nanogpt(shape)
  import transformers
  common = dict(vocab_size=shape["vocab"], hidden_size=shape["d"], num_hidden_layers=shape["layers"],
                num_attention_heads=shape["heads"], intermediate_size=shape["mlp"],
                max_position_embeddings=shape["seq_len"], tie_word_embeddings=False)
  if kind == "hf_llama":
    cfg = transformers.LlamaConfig(**common, num_key_value_heads=shape["heads"], rms_norm_eps=1e-5,
                                   rope_theta=shape["theta"])
    model = transformers.LlamaForCausalLM(cfg)
  elif kind == "hf_neox":
    cfg = transformers.GPTNeoXConfig(**common, rotary_pct=shape["rotary_pct"], rotary_emb_base=shape["theta"],
                                     use_parallel_residual=True, hidden_act="gelu")
    model = transformers.GPTNeoXForCausalLM(cfg)
  else:
    raise ValueError(f"peer kind {kind!r} is invalid: must be nanogpt, nanogpt_gpt2, nanogpt_upstream, hf_llama or "
                     "hf_neox")
  model.config.use_cache = False
  return model


class PeerTrainer:
  """One AdamW step per call on a fixed set of synthetic batches: forward, cross-entropy, backward, clip, update."""

  def __init__(self, kind: str, shape: dict, batches: list, lr: float = 3e-3, clip: float = 1.0):
    torch.manual_seed(0)
    self.kind, self.model, self.clip = kind, build(kind, shape).train(), clip
    if kind == "nanogpt_upstream":  # its train.py's optimizer (the same groups and settings as below)
      with contextlib.redirect_stdout(sys.stderr):
        self.opt = self.model.configure_optimizers(0.1, lr, (0.9, 0.95), "cpu")
    else:
      decay = [p for p in self.model.parameters() if p.dim() >= 2]
      no_decay = [p for p in self.model.parameters() if p.dim() < 2]
      self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                    {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95), eps=1e-8)
    self.batches = [(torch.from_numpy(x).long(), torch.from_numpy(y).long()) for x, y in batches]
    self.i = 0

  def step(self) -> float:
    x, y = self.batches[self.i % len(self.batches)]
    self.i += 1
    if self.kind == "nanogpt_upstream":
      _, loss = self.model(x, y)  # its forward computes the loss when given targets
    else:
      logits = self.model(x) if self.kind.startswith("nanogpt") else self.model(input_ids=x).logits
      loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
    self.opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
    self.opt.step()
    return loss.item()  # the host sync every PyTorch loop has


def num_params(model: nn.Module) -> int:
  return sum(p.numel() for p in model.parameters())

