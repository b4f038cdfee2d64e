"""``mjp train``: the DeiT recipe with MJP on timm's components (config, data, loop, checkpoints).

from mjp_fast.train import load_config, train
result = train(load_config("digits", ["epochs=5", "compare=false"]))
"""

from mjp_fast.train.config import PRESETS, ConfigError, TrainConfig, bundled_configs, load_config
from mjp_fast.train.loop import train
from mjp_fast.train.outcome import RunResult, TrainingDiverged

__all__ = [
    "PRESETS",
    "ConfigError",
    "RunResult",
    "TrainConfig",
    "TrainingDiverged",
    "bundled_configs",
    "load_config",
    "train",
]
