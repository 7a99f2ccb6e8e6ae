"""Data: tokenizers, corpus preparation into token shards, packed pre-training samples, instruction
(SFT) samples, and the exact, resumable data-parallel loader."""

from .build import build_data
from .loader import StatefulLoader, create_dataset
from .prepare import prepare_cached, prepare_corpus
from .pretrain import ArrayTokens, PackedDataset, TextDataset, default_cache_dir, expand_files, token_dtype
from .sft import InstructionDataset
from .shards import TokenShards
from .tokenizer import (
    AutoTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    load_tokenizer,
    train_bpe_tokenizer,
    train_tokenizer,
)

__all__ = [
    "ArrayTokens",
    "AutoTokenizer",
    "InstructionDataset",
    "PackedDataset",
    "SentencePieceTokenizer",
    "StatefulLoader",
    "TextDataset",
    "TokenShards",
    "Tokenizer",
    "build_data",
    "create_dataset",
    "default_cache_dir",
    "expand_files",
    "load_tokenizer",
    "prepare_cached",
    "prepare_corpus",
    "token_dtype",
    "train_bpe_tokenizer",
    "train_tokenizer",
]
