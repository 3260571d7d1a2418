"""Loading a config: YAML files composed through their ``includes:``, dotted overrides, a run's saved config.

Resolution order (later wins), as in MaxText:

1. the dataclass defaults (:mod:`jaxshare.config.schema`);
2. every file named in an experiment's ``includes:`` list (paths relative to ``configs/``), in order;
3. the experiment file itself;
4. ``key=value`` overrides from the command line (``train.steps=500 schedule.kind=mlkv``).

Unknown keys, wrongly typed values and invalid combinations raise :class:`ConfigError` before anything is
compiled. A config is a value: the dataclasses are frozen once loaded and validated, and a change (an override,
``dataclasses.replace``) makes a new config.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import typing
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from jaxshare.config.schema import CONFIGS_DIR, Config, ConfigError
from jaxshare.config.validate import validate


def _read_yaml(path: Path) -> Any:
  if not path.is_file():
    raise ConfigError(f"config file {str(path)!r} does not exist")
  try:
    return OmegaConf.load(path)
  except Exception as e:  # yaml.YAMLError and friends
    raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from e


def _expand(path: Path, seen: tuple[Path, ...] = ()) -> list[Any]:
  """A YAML file and, before it, everything its ``includes:`` list names (recursively)."""
  path = path.resolve()
  if path in seen:
    raise ConfigError(f"config include cycle: {' -> '.join(str(p) for p in seen + (path,))}")
  node = _read_yaml(path)
  includes = node.pop("includes", []) if isinstance(node, dict) or OmegaConf.is_dict(node) else []
  out: list[Any] = []
  for inc in includes:
    inc_path = Path(inc)
    if not inc_path.is_absolute():
      inc_path = CONFIGS_DIR / inc if (CONFIGS_DIR / inc).exists() else path.parent / inc
    out.extend(_expand(inc_path, seen + (path,)))
  out.append(node)
  return out


def _friendly(e: OmegaConfBaseException) -> str:
  key = getattr(e, "full_key", None) or getattr(e, "key", None)
  msg = str(e).splitlines()[0]
  return f"field {key!r}: {msg}" if key else msg


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
  return typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}


def _field_type(dotted: str) -> Any:
  """The annotated type of a dotted config field, or None if there is no such field."""
  ftype: Any = Config
  for part in dotted.split("."):
    hints = _type_hints(ftype)
    if part not in hints:
      return None
    ftype = hints[part]
  return ftype


# What a run started from another run (train.init_from) takes from that run's config unless the experiment file or
# an override sets it: the model the weights belong to, its sharing schedule, and the tokenizer its embedding indexes.
INHERITED = ("model", "schedule", "data.tokenizer")


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple[str, ...] = (),
                inherit: Config | None = None) -> Config:
  """Compose a :class:`Config` from a YAML file (with its includes) and dotted overrides, then validate it.

  Args:
    path: experiment YAML file, or None for the defaults.
    overrides: ``["train.steps=500", "schedule.kind=mlkv"]``.
    inherit: a run's config whose :data:`INHERITED` fields come after the defaults and before the file and the
      overrides (the config of a run started from that run: ``train.init_from``).

  Raises:
    ConfigError: unreadable file, unknown key, wrongly typed value or invalid combination.
  """
  merged = _structured(Config)
  try:
    if inherit is not None:
      merged = OmegaConf.merge(merged, _inherited(inherit))
    for node in _expand(Path(path)) if path is not None else []:
      merged = OmegaConf.merge(merged, node)
  except OmegaConfBaseException as e:
    raise ConfigError(_friendly(e)) from None
  return _with_overrides(merged, overrides)


def _inherited(cfg: Config):
  """The :data:`INHERITED` fields of ``cfg`` as a partial config tree."""
  tree: dict = {}
  for dotted in INHERITED:
    *groups, name = dotted.split(".")
    node = tree
    for group in groups:
      node = node.setdefault(group, {})
    node[name] = get_field(cfg, dotted)
  return OmegaConf.create(tree)


def get_field(cfg: Config, dotted: str) -> Any:
  """The value of a dotted field of ``cfg`` (``"data.path"``); a group (``"model"``) as a dict."""
  obj = cfg
  for part in dotted.split("."):
    obj = getattr(obj, part)
  return dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else obj


def apply_overrides(cfg: Config, overrides: list[str] | tuple[str, ...]) -> Config:
  """A new config: ``cfg`` with dotted overrides applied, validated (``cfg`` is a value: unchanged). Raises
  ConfigError as :func:`load_config`."""
  return _with_overrides(_structured(cfg), overrides)


def _structured(cfg: Config | type[Config]):
  """An editable OmegaConf tree of ``cfg`` (the frozen dataclasses make OmegaConf's trees read-only)."""
  if cfg is Config:
    return copy.deepcopy(_defaults_tree())
  return _editable(OmegaConf.structured(cfg))


@functools.cache
def _defaults_tree():
  """The defaults' editable tree, built once: ``OmegaConf.structured`` re-reads every dataclass and its type hints
  (~30 ms a call on these machines), a copy of the tree takes ~4 ms. Never handed out: callers get a copy."""
  return _editable(OmegaConf.structured(Config))


def _editable(node):
  """``node`` made writable, group by group (each group's node carries its own read-only flag)."""

  def writable(n) -> None:
    OmegaConf.set_readonly(n, False)
    for key in n:
      if OmegaConf.is_dict(n._get_node(key)):
        writable(n._get_node(key))

  writable(node)
  return node


def _with_overrides(merged, overrides) -> Config:
  nodes = []  # (override, key, its parsed node)
  for ov in overrides:
    if "=" not in ov:
      raise ConfigError(f"override {ov!r} is not of the form key=value (e.g. train.steps=500)")
    key, value = ov.split("=", 1)
    try:
      if _field_type(key) is str:  # keep e.g. '0_0_2_2' a string: YAML would read it as the integer 22
        OmegaConf.update(merged, key, value, merge=True)
      else:
        nodes.append((ov, key, OmegaConf.from_dotlist([ov])))
    except yaml.YAMLError as e:  # e.g. train.lr=[1 or model.d_model=*a
      raise ConfigError(f"{key}={value!r} is invalid: not a YAML value ({str(e).splitlines()[0]})") from None
    except OmegaConfBaseException as e:
      raise _override_error(ov, key, e) from None
  try:
    merged = OmegaConf.merge(merged, *(node for _, _, node in nodes))
  except (OmegaConfBaseException, TypeError) as e:
    for ov, key, node in nodes:  # merge one at a time to name the override at fault
      try:
        merged = OmegaConf.merge(merged, node)
      except (OmegaConfBaseException, TypeError) as e:
        raise _override_error(ov, key, e) from None
    raise ConfigError(str(e)) from None
  try:
    cfg = OmegaConf.to_object(merged)
  except OmegaConfBaseException as e:  # an interpolation resolved to a wrong type, e.g. schedule.sa=${model.d_model}
    msg, refs = _friendly(e), [ov for ov in overrides if "${" in ov]
    raise ConfigError(f"{msg} (resolving {', '.join(map(repr, refs))})" if refs and "field '" not in msg
                      else msg) from None
  validate(cfg)
  return cfg


def _override_error(ov: str, key: str, e: Exception) -> ConfigError:
  if isinstance(e, TypeError):  # OmegaConf merging a dict into a list: schedule.producers.0=1
    return ConfigError(f"override {ov!r} is invalid: {key} is not a config field ({e}); set a list field whole, "
                       "e.g. schedule.producers=[0,2]")
  msg = _friendly(e)
  return ConfigError(msg if key in msg else f"override {ov!r} is invalid: {msg}")


def to_yaml(cfg: Config) -> str:
  return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def config_from_yaml_text(text: str, where: str = "config.yaml") -> Config:
  """Rebuild a config saved by :func:`to_yaml` (a run directory's ``config.yaml``, named ``where`` in errors).

  Raises:
    ConfigError: empty (a default config would be read instead of the run's), not YAML, or not a valid config.
  """
  if not text.strip():
    raise ConfigError(f"{where} is empty: it should hold the run's resolved config (delete it to resume from the "
                      "checkpoint alone, whose shapes are then checked against the command's config)")
  try:
    node = OmegaConf.create(text)
    if not OmegaConf.is_dict(node):
      raise ConfigError(f"{where} is not a YAML mapping of config groups")
    cfg = OmegaConf.to_object(OmegaConf.merge(_structured(Config), node))
  except OmegaConfBaseException as e:
    raise ConfigError(f"{where}: {_friendly(e)}") from None
  except yaml.YAMLError as e:
    raise ConfigError(f"{where} is not valid YAML ({str(e).splitlines()[0]})") from None
  validate(cfg)
  return cfg
