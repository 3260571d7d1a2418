"""lm-evaluation-harness adapter: a jaxshare run as an ``lm_eval`` model named ``jaxshare``.

``python -m jaxshare.evaluation.lm_eval_harness`` is ``lm_eval`` with this model registered (the harness has no
plugin entry point for models), so its flags are the harness's own:

  python -m jaxshare.evaluation.lm_eval_harness --model jaxshare --model_args run=runs/shakespeare_cla2 \\
      --batch_size 16 --tasks my_task --include_path path/to/tasks

Loglikelihoods come from one forward pass per batch of right-padded rows (causal attention never reads the
padding); ``generate_until`` uses the decode cache through :class:`~jaxshare.evaluation.generate.Generator`.
"""

from __future__ import annotations

import sys
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from jaxshare.evaluation.generate import Generator
from jaxshare.evaluation.sampling import Sampling
from jaxshare.store.runs import load_run

WIDTH_BUCKET = 32  # scored rows are right-padded to a multiple of this: fewer shapes to compile


@register_model("jaxshare")
class JaxshareLM(LM):
  """A jaxshare run directory (or checkpoint step) as an lm-eval model.

  Args:
    run: run directory or ``<run_dir>/checkpoints/<step>``.
    batch_size: rows per forward pass (scoring) and per generation batch (the harness's ``--batch_size``).
    max_length: context window in tokens (default: the run's ``data.seq_len``); longer inputs keep their end.
    nf: LISA's NF prefill for ``generate_until``.
  """

  def __init__(self, run: str, batch_size: int | str = 8, max_length: int | str = 0, nf: bool | str = False,
               **_unused):
    super().__init__()
    loaded = load_run(run)
    cfg = loaded.cfg
    self.tokenizer = loaded.tokenizer()
    self.batch_size = int(batch_size) if str(batch_size).isdigit() else 8  # "auto" is not measured here
    self.max_length = int(max_length) or cfg.data.seq_len
    self.nf = str(nf).lower() in ("1", "true")
    self.params, graphdef = loaded.params, loaded.graphdef
    self.generator = Generator(loaded.model(), loaded.plan, pad_id=self.tokenizer.eos_id)

    @jax.jit
    def token_logprobs(params, inputs, targets):
      logits = nnx.merge(graphdef, params)(inputs)
      logp = jax.nn.log_softmax(logits, axis=-1)
      return jnp.take_along_axis(logp, targets[..., None], -1)[..., 0], jnp.argmax(logits, -1) == targets

    self._token_logprobs = token_logprobs

  def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Token ids of a context and its continuation; trailing spaces of the context move to the continuation (as
    the harness's HF model does), and an empty context becomes EOS."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
      context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = self.tokenizer.encode(context + continuation)
    ctx = self.tokenizer.encode(context)
    if not ctx:
      return [self.tokenizer.eos_id], whole
    return whole[:len(ctx)], whole[len(ctx):]

  def score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
    """``(sum of log p(continuation | context), whether greedy decoding gives the continuation)`` per pair of
    token lists (the context is cut from the left to fit ``max_length``)."""
    rows = []
    for ctx, cont in pairs:
      full = (ctx + cont)[-(self.max_length + 1):]
      rows.append((full[:-1], full[1:], min(len(cont), len(full) - 1)))
    out: list[tuple[float, bool]] = []
    for i in range(0, len(rows), self.batch_size):
      chunk = rows[i:i + self.batch_size]
      width = -(-max(len(r[0]) for r in chunk) // WIDTH_BUCKET) * WIDTH_BUCKET
      inputs = np.full((self.batch_size, width), self.tokenizer.eos_id, np.int32)
      targets = np.zeros_like(inputs)
      for b, (x, y, _) in enumerate(chunk):
        inputs[b, :len(x)], targets[b, :len(y)] = x, y
      logp, greedy = (np.asarray(a) for a in self._token_logprobs(self.params, inputs, targets))
      for b, (x, _, n) in enumerate(chunk):
        span = slice(len(x) - n, len(x))
        out.append((float(logp[b, span].sum()), bool(greedy[b, span].all())))
    return out

  def loglikelihood(self, requests) -> list[tuple[float, bool]]:
    return self.score([self._encode_pair(*r.args) for r in requests])

  def loglikelihood_rolling(self, requests) -> list[float]:
    """The whole string's log-likelihood in disjoint windows of ``max_length`` (the harness's rolling scheme)."""
    pairs, owner = [], []
    for n, r in enumerate(requests):
      windows = get_rolling_token_windows(token_list=self.tokenizer.encode(r.args[0]),
                                          prefix_token=self.tokenizer.eos_id, max_seq_len=self.max_length,
                                          context_len=1)
      for ctx, cont in map(make_disjoint_window, windows):
        pairs.append((list(ctx), list(cont)))
        owner.append(n)
    totals = [0.0] * len(requests)
    for n, (logp, _) in zip(owner, self.score(pairs)):
      totals[n] += logp
    return totals

  def generate_until(self, requests) -> list[str]:
    """Continue each context until one of its ``until`` strings, EOS or ``max_gen_toks`` tokens; requests with the
    same generation settings are batched."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    settings = []
    for n, r in enumerate(requests):
      kw = dict(r.args[1])
      until = kw.get("until") or []
      until = [until] if isinstance(until, str) else list(until)
      temperature = float(kw.get("temperature", 0.0)) if kw.get("do_sample", False) else 0.0
      key = (int(kw.get("max_gen_toks", 256)), temperature, int(kw.get("top_k", 0) or 0),
             float(kw.get("top_p", 1.0) or 1.0))
      settings.append(until)
      groups[key].append(n)
    out = [""] * len(requests)
    for (max_new, temperature, top_k, top_p), members in groups.items():
      for i in range(0, len(members), self.batch_size):
        batch = members[i:i + self.batch_size]
        prompts = [(self.tokenizer.encode(requests[n].args[0]) or [self.tokenizer.eos_id])[-self.max_length:]
                   for n in batch]
        ids = self.generator.generate(prompts, max_new, Sampling(temperature, top_k, top_p),
                                      stop_tokens=[self.tokenizer.eos_id], nf=self.nf)
        for n, row in zip(batch, ids):
          text = self.tokenizer.decode(row)
          cuts = [text.index(s) for s in settings[n] if s and s in text]
          out[n] = text[:min(cuts)] if cuts else text
    return out


if __name__ == "__main__":
  from lm_eval.__main__ import cli_evaluate

  sys.exit(cli_evaluate())
