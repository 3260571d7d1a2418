"""The train setup's head-wise ties: given, chosen afresh by default, and None refused where the schedule ties heads
(None once meant both "no ties" and "not given", and a head-wise run handed None trained on fresh ties)."""

import pytest

from conftest import tiny_config
from jaxshare.init.headwise import fresh_ties
from jaxshare.plan import plan_of
from jaxshare.train.state import FRESH_TIES, setup_training

HEADWISE = ("schedule.kind=headwise", "schedule.headwise.ratio=0.5")


def test_default_ties_are_chosen_afresh_and_given_ones_are_kept():
  cfg = tiny_config(*HEADWISE)
  fresh = fresh_ties(plan_of(cfg), cfg.train.seed)
  assert fresh is not None and setup_training(cfg).ties == fresh
  other = fresh_ties(plan_of(cfg), cfg.train.seed + 1)
  assert setup_training(cfg, ties=other).ties == other


def test_no_ties_for_a_schedule_that_ties_heads_is_refused():
  with pytest.raises(ValueError, match=r"schedule.kind=.headwise. ties \d+ heads, but ties=None"):
    setup_training(tiny_config(*HEADWISE), ties=None)
  with pytest.raises(ValueError, match="pass HeadTies, None or FRESH_TIES"):
    setup_training(tiny_config(*HEADWISE), ties="old")


def test_a_schedule_without_ties_takes_none_either_way():
  assert setup_training(tiny_config(), ties=None).ties is None
  assert setup_training(tiny_config(), ties=FRESH_TIES).ties is None
