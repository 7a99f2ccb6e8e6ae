"""The run's configuration: one typed schema (`schema.py`), the source documents' YAML shapes
(`seed_keys.py`), validation with messages in the user's own spelling (`validation.py`), and YAML
files and overrides (`yaml_io.py`). Validation reads no file but the YAML and builds no model; what a
config points at is checked afterwards by `shardwise.resolve`."""

from .schema import (
    FINETUNE_LR_FULL,
    FINETUNE_LR_LORA,
    MAX_SETTING,
    DataConfig,
    FreezeConfig,
    LoraConfig,
    OptimizeConfig,
    ParallelConfig,
    RunConfig,
    RunSection,
    TrainConfig,
    tokens_per_step,
)
from .seed_keys import SEED_000, SEED_002, Spelling, translate_seed_keys, translate_with_origins, zero_stage_from
from .validation import validate
from .yaml_io import apply_overrides, config_reference, load_config, read_config, read_yaml, to_yaml

__all__ = [
    "FINETUNE_LR_FULL", "FINETUNE_LR_LORA", "MAX_SETTING", "DataConfig", "FreezeConfig", "LoraConfig",
    "OptimizeConfig", "ParallelConfig", "RunConfig", "RunSection", "TrainConfig", "tokens_per_step",
    "SEED_000", "SEED_002", "Spelling", "translate_seed_keys", "translate_with_origins", "zero_stage_from",
    "validate", "apply_overrides", "config_reference", "load_config", "read_config", "read_yaml", "to_yaml",
]
