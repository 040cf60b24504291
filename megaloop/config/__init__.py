"""One typed config tree (model, parallel, data, optim, train, checkpoint): YAML + overrides, validated up front."""
from megaloop.config.errors import ConfigError
from megaloop.config.load import from_dict, load_config
from megaloop.config.model import ModelConfig
from megaloop.config.sections import CheckpointConfig, DataConfig, ParallelConfig, TrainConfig
from megaloop.config.tree import Config

__all__ = ["Config", "ConfigError", "ModelConfig", "ParallelConfig", "DataConfig", "TrainConfig",
           "CheckpointConfig", "load_config", "from_dict"]
