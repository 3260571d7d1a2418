"""Typed configuration: the schema (dataclasses), loading (YAML composition and overrides), validation and the
generated reference, each in its own module; this package hands their public names on."""

from jaxshare.config.choices import (INTEGRATORS, LISA_PRESETS, AttentionImpl, HeadPreset, Integrator, KVPool,
                                     KVPreset, LisaStart, MLPWiden, ScorePreset, ScoreReuse, ScoreSharing, WcFit)
from jaxshare.config.load import (INHERITED, apply_overrides, config_from_yaml_text, get_field, load_config,
                                  to_yaml)
from jaxshare.config.reference import describe_fields, documented_fields
from jaxshare.config.schema import (CONFIGS_DIR, DATA_DIR_ENV, FLAVORS, REPO_ROOT, TOKEN_CACHE_ENV, AttentionConfig,
                                    Config, ConfigError, DataConfig, DistributedConfig, Features, HeadwiseConfig,
                                    LisaConfig, LisaGroupConfig, MeshConfig, ModelConfig, SAConfig, ScheduleConfig,
                                    TrainConfig, UniAttnConfig, mixture_name)
from jaxshare.config.validate import validate
