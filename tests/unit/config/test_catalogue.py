"""The schedule catalogue (configs/schedule_catalogue.yaml): every variant is described once, every matrix entry
is one of them, and every variant the tests run is a valid schedule of the tiny model."""

from __future__ import annotations

import pytest
import yaml

from conftest import tiny_config
from jaxshare.config import ConfigError
from jaxshare.config.catalogue import CATALOGUE, schedule_matrix, schedule_variants
from jaxshare.plan import plan_of

MATRICES = list(yaml.safe_load(CATALOGUE.read_text())["matrices"])
# Matrices of the tiny model (scripts' matrices of larger models are compiled by those scripts' own tests), and the
# depth a matrix's variants are written for where the tiny model's 4 layers are too few (the presets' default layers).
TINY_MATRICES = [m for m in MATRICES if not m.startswith("script_")] + ["script_aot_compile", "script_bench_train"]
DEPTH = {"depth_presets": 12}


def test_each_variant_is_described_once():
  variants = schedule_variants()
  described = [tuple(v) for v in variants.values()]
  assert len(set(described)) == len(described), "two variant names describe the same overrides"


@pytest.mark.parametrize("matrix", MATRICES)
def test_every_matrix_entry_is_a_variant(matrix):
  variants = {tuple(v) for v in schedule_variants().values()}
  strays = {k: v for k, v in schedule_matrix(matrix).items() if tuple(v) not in variants}
  assert not strays, f"matrix {matrix} writes overrides out instead of naming a variant: {strays}"


def test_every_variant_is_in_a_matrix():
  used = {tuple(v) for m in MATRICES for v in schedule_matrix(m).values()}
  unused = [name for name, v in schedule_variants().items() if tuple(v) not in used]
  assert not unused, f"variants no matrix runs: {unused}"


@pytest.mark.parametrize("matrix", TINY_MATRICES)
def test_the_tiny_models_variants_compile(matrix):
  depth = [f"model.num_layers={DEPTH[matrix]}"] if matrix in DEPTH else []
  for name, overrides in schedule_matrix(matrix).items():
    plan = plan_of(tiny_config(*depth, *overrides))
    assert len(plan.schedule.layers) == plan.model.num_layers, name


def test_an_unknown_matrix_is_refused_with_the_known_ones():
  with pytest.raises(ConfigError, match="no matrix 'nope'.*families"):
    schedule_matrix("nope")


@pytest.mark.parametrize("text", ["variants: {}\n", "[1, 2]\n", "variants: {a: [\n"])
def test_a_malformed_catalogue_is_refused(tmp_path, text):
  path = tmp_path / "catalogue.yaml"
  path.write_text(text)
  with pytest.raises(ConfigError, match="catalogue"):
    schedule_variants(path)
