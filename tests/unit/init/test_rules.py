"""What a start takes from its kind: the K/V conversion rule ``train.init_kv_pool=auto`` resolves to
(:class:`~jaxshare.init.rules.InitRules`), and the two-stage UniAttn recipe refused on a kind without UniAttn (a
composed kind included)."""

import pytest

from conftest import tiny_config
from jaxshare.config import ConfigError
from jaxshare.init.rules import InitRules
from jaxshare.train.start import _open_data


@pytest.mark.parametrize("kind, pool", [("cla", "producer"), ("cla+uniattn", "producer"), ("mlkv", "mean"),
                                        ("gqa", "mean"), ("uniattn", "mean")])
def test_auto_kv_pool_keeps_a_cla_producers_own_kv_and_averages_otherwise(kind, pool):
  for overrides, expected in (((), pool), (("train.init_kv_pool=mean",), "mean")):
    cfg = tiny_config(f"schedule.kind={kind}", *overrides)
    assert InitRules.of(cfg.train, cfg.schedule.kind).kv_pool == expected


class _ReachedData(Exception):
  """Raised where the start goes on to open the data: the recipe was accepted."""


@pytest.mark.parametrize("kind, refused", [("dense", True), ("cla", True), ("uniattn", False), ("cla+uniattn", False)])
def test_the_two_stage_recipe_needs_uniattn_in_the_kind(kind, refused, monkeypatch):
  def reached(mesh):
    raise _ReachedData
  monkeypatch.setattr("jaxshare.parallel.batch_sharding", reached)
  cfg = tiny_config(f"schedule.kind={kind}", "train.recipe=uniattn_two_stage")
  with pytest.raises(ConfigError if refused else _ReachedData, match="needs a uniattn schedule" if refused else None):
    _open_data(cfg, None)
