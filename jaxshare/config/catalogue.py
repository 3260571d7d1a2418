"""The catalogue of schedule variants (``configs/schedule_catalogue.yaml``): every variant that tests and benchmark
scripts run, described once, and the named matrices of variants each of them runs."""

from __future__ import annotations

import functools
from pathlib import Path

import yaml

from jaxshare.config.schema import CONFIGS_DIR, ConfigError

CATALOGUE = CONFIGS_DIR / "schedule_catalogue.yaml"


@functools.cache
def _read(path: Path) -> dict:
  try:
    catalogue = yaml.safe_load(path.read_text())
  except (OSError, yaml.YAMLError) as e:
    raise ConfigError(f"schedule catalogue {str(path)!r} cannot be read: {e}") from e
  if not isinstance(catalogue, dict) or set(catalogue) != {"variants", "matrices"}:
    raise ConfigError(f"schedule catalogue {str(path)!r} must hold exactly 'variants' and 'matrices'")
  return catalogue


def schedule_variants(path: Path = CATALOGUE) -> dict[str, list[str]]:
  """Every variant of the catalogue: name -> config overrides (dotted ``key=value`` strings).

  Raises:
    ConfigError: the catalogue is unreadable or malformed.
  """
  return {name: list(overrides) for name, overrides in _read(Path(path))["variants"].items()}


def schedule_matrix(name: str, path: Path = CATALOGUE) -> dict[str, list[str]]:
  """The matrix ``name`` of the catalogue: id (a test id, a benchmark's row) -> config overrides, in file order.

  Raises:
    ConfigError: no matrix of that name (the message lists them), or an unreadable catalogue.
  """
  matrices = _read(Path(path))["matrices"]
  if name not in matrices:
    raise ConfigError(f"schedule catalogue has no matrix {name!r}; it has: {', '.join(matrices)}")
  return {key: list(overrides) for key, overrides in matrices[name].items()}
