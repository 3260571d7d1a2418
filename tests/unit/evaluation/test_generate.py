"""Sampling draws from the right sets with the right frequencies; cached generation equals generation by full
forward passes (greedy and sampled, left-padded rows of different lengths); stop tokens end their row only."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_config
from jaxshare.config.catalogue import schedule_matrix
from jaxshare.evaluation.generate import Generator, decode_steps
from jaxshare.evaluation.sampling import Sampling, sample
from jaxshare.model.cache import init_cache
from jaxshare.plan import plan_of
from support.models import randomized

ALL = schedule_matrix("decode")

PROBS = np.array([0.5, 0.3, 0.15, 0.05])


def _draw(sampling, rows=4000):
  logits = jnp.broadcast_to(jnp.log(jnp.asarray(PROBS, jnp.float32)), (rows, len(PROBS)))
  return np.asarray(sample(logits, jax.random.key(0), sampling))


def test_greedy_is_argmax():
  logits = jax.random.normal(jax.random.key(1), (5, 11))
  np.testing.assert_array_equal(np.asarray(sample(logits, jax.random.key(0), Sampling())),
                                np.argmax(np.asarray(logits), -1))


def test_temperature_one_follows_the_distribution():
  freq = np.bincount(_draw(Sampling(temperature=1.0)), minlength=4) / 4000
  np.testing.assert_allclose(freq, PROBS, atol=0.03)


def test_low_temperature_sharpens():
  freq = np.bincount(_draw(Sampling(temperature=0.25)), minlength=4) / 4000
  want = PROBS ** 4 / (PROBS ** 4).sum()
  np.testing.assert_allclose(freq, want, atol=0.03)


def test_top_k_keeps_the_k_most_likely():
  freq = np.bincount(_draw(Sampling(temperature=1.0, top_k=2)), minlength=4) / 4000
  np.testing.assert_allclose(freq, [0.5 / 0.8, 0.3 / 0.8, 0, 0], atol=0.03)


def test_top_p_keeps_the_nucleus():
  # 0.5 < 0.7 needs the second token; 0.8 >= 0.7, so the third is out
  freq = np.bincount(_draw(Sampling(temperature=1.0, top_p=0.7)), minlength=4) / 4000
  np.testing.assert_allclose(freq, [0.5 / 0.8, 0.3 / 0.8, 0, 0], atol=0.03)
  assert set(_draw(Sampling(temperature=1.0, top_p=0.4))) == {0}  # the most likely token is always kept


@pytest.mark.parametrize("bad, match", [(dict(temperature=-1.0), "temperature=-1.0"), (dict(top_k=-2), "top_k=-2"),
                                        (dict(top_p=0.0), r"top_p=0.0 is invalid: must be in \(0, 1\]")])
def test_bad_sampling_is_refused(bad, match):
  with pytest.raises(ValueError, match=match):
    Sampling(**bad)


PROMPTS = [[5, 9, 11], list(range(20, 40)), [7]]


def test_cached_generation_equals_full_forward_generation():
  """UniAttn: probability rows handed within the step, a compensated superblock and plain producers (every other
  role's cached step is checked against the forward in test_decode)."""
  cfg = tiny_config(*ALL["uniattn"])
  schedule, graphdef, params = randomized(cfg)
  generator = Generator(nnx.merge(graphdef, params), plan_of(cfg))
  for sampling in (Sampling(), Sampling(temperature=1.0, top_k=50, top_p=0.9)):
    cached = generator.generate(PROMPTS, 9, sampling, seed=3, chunk=4)
    assert cached == generator.generate(PROMPTS, 9, sampling, seed=3, chunk=4, use_cache=False)
    assert [len(row) for row in cached] == [9, 9, 9]
  # a row decodes the same alone as in a left-padded batch
  assert generator.generate(PROMPTS[1:2], 9) == generator.generate(PROMPTS, 9)[1:2]


def test_stop_token_ends_its_row_only():
  cfg = tiny_config("schedule.kind=cla")
  schedule, graphdef, params = randomized(cfg)
  generator = Generator(nnx.merge(graphdef, params), plan_of(cfg))
  free = generator.generate(PROMPTS, 8)
  stop = free[0][2]
  stopped = generator.generate(PROMPTS, 8, stop_tokens=[stop])
  for row, out in zip(free, stopped):
    assert out == row[:row.index(stop)] if stop in row else out == row
  streamed = []
  generator.generate(PROMPTS, 8, stop_tokens=[stop], chunk=3,
                     on_tokens=lambda t, live: streamed.append([list(r[m]) for r, m in zip(t, live)]))
  assert [sum((c[b] for c in streamed), []) for b in range(3)] == stopped


def test_generate_refuses_bad_requests():
  cfg = tiny_config()
  schedule, graphdef, params = randomized(cfg)
  generator = Generator(nnx.merge(graphdef, params), plan_of(cfg))
  with pytest.raises(ValueError, match="no empty prompt"):
    generator.generate([[1], []], 4)
  with pytest.raises(ValueError, match="max_new_tokens=0"):
    generator.generate([[1]], 0)


@pytest.mark.parametrize("scan", [True, False])
def test_decode_step_updates_the_cache_in_place(scan):
  """The compiled decode chunk moves no whole cache buffer: no copy, and no value of a buffer's shape other than
  the donated input and its output (a scanned model once copied every buffer twice per step)."""
  cfg = tiny_config(*ALL["uniattn"], f"model.scan_layers={str(scan).lower()}")
  schedule, graphdef, params = randomized(cfg)
  cache = init_cache(plan_of(cfg), 2, 64)
  shapes = {f"[{','.join(map(str, b.shape))}]" for b in jax.tree.leaves(cache.buffers)}
  logits = jnp.zeros((2, cfg.model.vocab_size))
  hlo = decode_steps.lower(graphdef, params, cache, logits, jnp.zeros(2, bool), jax.random.key(0),
                           jnp.asarray([-1]), jnp.asarray(0), sampling=Sampling(), chunk=2, pad_id=0
                           ).compile().as_text()
  whole = [line.strip() for line in hlo.splitlines()
           if re.search(r"= \w+\[", line) and any(s in line.split("=", 1)[1].split(" ")[1] for s in shapes)
           and re.search(r"\b(copy|copy-start|concatenate|select|broadcast)\(", line)]
  assert not whole, "\n".join(whole[:5])
