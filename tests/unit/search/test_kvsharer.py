"""KVSharer's greedy strategy search (Yang et al. 2024, Sec. 3; the authors' released script): layer pairs by
decreasing distance of their average KV caches, each replacement kept only where the acceptance test passes, a
layer that already reads another skipped, and every layer reading a re-pointed layer following it to its producer."""

import numpy as np
import pytest

from jaxshare.search.kvsharer import cache_distances, kvsharer_sources


def _distances() -> np.ndarray:
  """5 layers: 3-4 farthest apart (10.4), then 3 from 0, 1, 2 (10), then 4 from 0, 1, 2 (3); the rest alike."""
  means = np.zeros((5, 3))
  means[3] = [10.0, 0, 0]
  means[4] = [0, 3.0, 0]
  return np.linalg.norm(means[:, None] - means[None], axis=-1)


def test_the_most_dissimilar_pair_first_and_readers_follow_a_re_pointed_layer():
  tried = []

  def accept(sources):
    tried.append(list(sources))
    return True

  steps = kvsharer_sources(_distances(), accept, 4)
  assert steps == [[0, 1, 2, 3, 3],  # 4 reads 3 (the later layer reads the earlier's cache)
                   [0, 1, 2, 0, 0],  # 3 reads 0, and 4, which read 3, reads 0 with it
                   [0, 0, 2, 0, 0],  # 3 and 4 read another already: their pairs are skipped; then the alike pairs
                   [0, 0, 0, 0, 0]]
  assert tried == steps  # every trial passed


def test_a_replacement_that_fails_the_acceptance_test_is_not_kept():
  tried = []

  def accept(sources):
    tried.append(list(sources))
    return sources[3] != 0  # the acceptance test fails whenever layer 3 reads layer 0

  steps = kvsharer_sources(_distances(), accept, 4)
  assert steps == [[0, 1, 2, 3, 3], [0, 1, 2, 1, 1], [0, 1, 0, 1, 1]]  # the greedy order leaves no fourth
  assert tried == [[0, 1, 2, 3, 3], [0, 1, 2, 0, 0], [0, 1, 2, 1, 1], [0, 0, 2, 0, 0], [0, 1, 0, 1, 1]]
  assert kvsharer_sources(_distances(), accept, 2) == steps[:2]  # stops once enough layers share
  assert kvsharer_sources(_distances(), lambda s: False, 4) == []
  with pytest.raises(ValueError, match="max_shared=5 is invalid: must be in 0..4"):
    kvsharer_sources(_distances(), accept, 5)


def test_cache_distance_is_the_mean_per_position_and_head_euclidean_distance_of_k_and_v():
  k, v = np.zeros((3, 2, 2, 4)), np.zeros((3, 2, 2, 4))  # [L, T, G, d]
  k[1] = 1.0  # |k_1 - k_0| = 2 at every position and head
  v[2, 0, 0] = 4.0  # one position and head of layer 2's V differs, by 8
  d = cache_distances(k, v)
  assert d.shape == (3, 3) and np.allclose(d, d.T) and np.allclose(np.diag(d), 0)
  assert d[0, 1] == pytest.approx(2 / 2)  # (K's 2 + V's 0) / 2
  assert d[0, 2] == pytest.approx((0 + 8 / 4) / 2)  # V: 8 at one of 4 cells
  assert d[1, 2] == pytest.approx((2 + 8 / 4) / 2)
