"""The one config tree of Relax: typed sections, strict checks, presets and overrides.

* ``fields``: how a field is declared (help, choices, range) and read strictly; ``ConfigError``;
* ``model``, ``genrm``, ``data``, ``rollout``, ``algorithm``, ``trainer``, ``runtime``: the sections, each
  with the checks that read it alone; ``cross``: the checks that span sections;
* ``tree``: ``RelaxConfig`` and the order its checks run (``validate``);
* ``loader``: presets, YAML files, ``key=value`` overrides, to and from dicts, a run's saved config;
* ``preflight``: the checks that need the environment (files, packages, GPUs, servers), run before
  anything is written; ``fit``: the checks of a config against what a run built from it.

This is the bottom layer: it imports nothing of Relax but ``relax.objstore``. The names below are
what the rest of Relax imports (``from relax.config import RelaxConfig, load_config, ConfigError``).
"""

from relax.config.algorithm import AlgorithmConfig
from relax.config.data import DataConfig
from relax.config.fields import ConfigError
from relax.config.genrm import GenRMConfig
from relax.config.loader import (
    config_from_dict,
    config_hash,
    config_to_dict,
    config_to_yaml,
    list_presets,
    load_config,
    parse_override,
    saved_config,
)
from relax.config.model import ModelConfig, TeacherConfig
from relax.config.preflight import preflight
from relax.config.rollout import RolloutConfig
from relax.config.runtime import QueueConfig, ResourcesConfig, SupervisorConfig
from relax.config.trainer import TrainerConfig
from relax.config.tree import RelaxConfig, validate

__all__ = ["AlgorithmConfig", "ConfigError", "DataConfig", "GenRMConfig", "ModelConfig", "QueueConfig", "RelaxConfig",
           "ResourcesConfig", "RolloutConfig", "SupervisorConfig", "TeacherConfig", "TrainerConfig",
           "config_from_dict", "config_hash", "config_to_dict", "config_to_yaml", "list_presets", "load_config",
           "parse_override", "preflight", "saved_config", "validate"]
