"""shardwise: PyTorch-native pre-training and fine-tuning of LLMs under compute and memory limits.

The public Python API keeps the names of the source documents (MindSpore Transformers'
`AutoModelForCausalLM`, `TrainingArguments`, `Trainer`, `LLMArguments`, `LLMTrainer`,
`AutoTokenizer`, `TextDataset`, `InstructionDataset`, `create_dataset`), so their scripts run after
changing the import. `load_config(path)` reads, validates and resolves a run config as `shardwise
train` does.
"""

from . import torch_support  # noqa: F401 - first: refuses an untested torch before anything else imports it
from .api import AutoModelForCausalLM, LLMArguments, LLMTrainer, Trainer, TrainingArguments
from .config import RunConfig
from .data.build import TextDataset
from .data.instruction import InstructionDataset
from .data.loader import StatefulLoader, create_dataset
from .data.tokenizer import AutoTokenizer
from .errors import ShardwiseError
from .models import ModelConfig, register_preset
from .resolve import load_run_config as load_config

__version__ = "0.1.0"

__all__ = [
    "AutoModelForCausalLM", "AutoTokenizer", "InstructionDataset", "LLMArguments", "LLMTrainer", "ModelConfig",
    "RunConfig", "ShardwiseError", "StatefulLoader", "TextDataset", "Trainer", "TrainingArguments", "create_dataset",
    "load_config", "register_preset", "__version__",
]
