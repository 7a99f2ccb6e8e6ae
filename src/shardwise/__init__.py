"""shardwise: PyTorch-native pre-training and fine-tuning of LLMs under compute and memory limits.

The public Python API keeps the names of the source documents (MindSpore Transformers'
`AutoModelForCausalLM`, `TrainingArguments`, `Trainer`, `LLMArguments`, `LLMTrainer`,
`AutoTokenizer`, `TextDataset`, `InstructionDataset`, `create_dataset`), so their scripts run after changing the import.
"""

from .api import AutoModelForCausalLM, LLMArguments, LLMTrainer, Trainer, TrainingArguments
from .config import RunConfig, load_config
from .data.loader import StatefulLoader, create_dataset
from .data.pretrain import TextDataset
from .data.sft import InstructionDataset
from .data.tokenizer import AutoTokenizer
from .errors import ShardwiseError
from .models import ModelConfig, register_preset

__version__ = "0.1.0"

__all__ = [
    "AutoModelForCausalLM", "AutoTokenizer", "InstructionDataset", "LLMArguments", "LLMTrainer", "ModelConfig", "RunConfig",
    "ShardwiseError", "StatefulLoader", "TextDataset", "Trainer", "TrainingArguments", "create_dataset",
    "load_config", "register_preset", "__version__",
]
