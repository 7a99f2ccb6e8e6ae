"""Data: tokenizers, packed pretraining samples and the resumable data-parallel loader."""

from .loader import StatefulLoader, create_dataset
from .pretrain import (
    PackedDataset,
    TextDataset,
    build_pretrain_data,
    default_cache_dir,
    expand_files,
    split_tokens,
    token_dtype,
    tokenize_files,
)
from .tokenizer import AutoTokenizer, Tokenizer, load_tokenizer, train_bpe_tokenizer

__all__ = [
    "AutoTokenizer",
    "PackedDataset",
    "StatefulLoader",
    "TextDataset",
    "Tokenizer",
    "build_pretrain_data",
    "create_dataset",
    "default_cache_dir",
    "expand_files",
    "load_tokenizer",
    "split_tokens",
    "token_dtype",
    "tokenize_files",
    "train_bpe_tokenizer",
]
