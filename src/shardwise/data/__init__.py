"""Data: tokenizers, corpus preparation into token shards, packed pre-training samples, instruction
(SFT) samples, and the exact, resumable data-parallel loader.

One concept per module, imported bottom-up: files (finding, inspecting, cache keys) <- sources (reading
documents) <- tokenizer <- prepare; shards <- packing; tokenizer <- chat <- instruction; build ties
them to a config's data section; loader stands alone."""

from .build import TextDataset, build_data
from .files import default_cache_dir, expand_files
from .instruction import InstructionDataset
from .loader import StatefulLoader, create_dataset
from .packing import ArrayTokens, PackedDataset
from .prepare import prepare_cached, prepare_corpus
from .shards import TokenShards, token_dtype
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
