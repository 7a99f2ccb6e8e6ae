"""A model to generate from: a shardwise checkpoint or run directory, or a Hugging Face model
directory, optionally with a LoRA adapter in peft's format, and its tokenizer; and whether the weights
are instruction-tuned, so that prompts get the chat template they were trained with."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
from tokenizers import Tokenizer as HFTokenizer

from .checkpoint.storage import find_checkpoint
from .checkpoint.weights import load_model
from .config import read_yaml
from .data.chat import chat_stop_ids, render_generation_prompt, resolve_template
from .data.tokenizer import Tokenizer, load_tokenizer
from .errors import CheckpointError, ConfigError
from .models.hf import from_hf
from .models.transformer import Transformer
from .peft.lora import is_lora_name, load_adapter, merge_lora

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
_ADAPTER_CONFIG = "adapter_config.json"


@dataclass
class GenerationModel:
    """A model ready to generate from, with its tokenizer and how its prompts are built.

    `tuned_template` is the chat template the weights were instruction-tuned with (a `template=`
    option of data/chat.py), or None when they are not known to be instruction-tuned. Plain prompts
    (no chat template) are `plain_prefix + encode(text)`. `stop_ids` end generation in both modes.
    """

    model: Transformer
    tokenizer: Tokenizer
    kind: str  # "checkpoint" (shardwise) or "hf"
    tuned_template: Any = None
    tuned_because: str = ""
    plain_prefix: list[int] = field(default_factory=list)
    stop_ids: list[int] = field(default_factory=list)

    def chat_template(self, chat: Optional[bool] = None) -> Any:
        """The template to render prompts with, None for plain text: chat=None decides, True/False force."""
        if chat is False:
            return None
        if self.tuned_template is not None:
            return self.tuned_template
        # Forced on a model not known to be tuned: the tokenizer's template if any, else [INST] form.
        return "auto" if chat else None

    def prompt_ids(self, prompts: Sequence[str], template: Any = None, system: Optional[str] = None) -> list[list[int]]:
        """Token ids of each prompt: plain text, or (with a template) one user turn after an optional system."""
        if template is None:
            return [self.plain_prefix + self.tokenizer.encode(p) for p in prompts]
        renderer = resolve_template(template, self.tokenizer)
        head = [{"role": "system", "content": system}] if system else []
        return [render_generation_prompt(renderer, self.tokenizer, [*head, {"role": "user", "content": p}])
                for p in prompts]

    def stop_ids_for(self, template: Any = None) -> list[int]:
        """Ids that end a row: eos and the model's own, plus a chat template's end-of-turn token(s)."""
        stops = list(self.stop_ids)
        if template is not None:
            stops += [t for t in chat_stop_ids(template, self.tokenizer) if t not in stops]
        return stops


def generation_source(source: Union[str, os.PathLike]) -> tuple[str, Path]:
    """("hf", directory) for a Hugging Face model directory, else ("checkpoint", its checkpoint directory)."""
    path = Path(source).expanduser()
    if not path.exists():
        raise CheckpointError(
            f"{path} does not exist; give a shardwise checkpoint or run directory, or a Hugging Face model "
            "directory (config.json + *.safetensors)"
        )
    if (path / "config.json").is_file():
        return "hf", path
    if (path / _ADAPTER_CONFIG).is_file():
        raise ConfigError(f"{path} is a LoRA adapter, not a model: give its base model and the adapter as "
                          f"`shardwise generate BASE --adapter {path}`")
    try:
        return "checkpoint", find_checkpoint(path)
    except CheckpointError as e:
        raise CheckpointError(f"{path} is neither a Hugging Face model directory (it has no config.json) nor a "
                              f"shardwise checkpoint: {e}") from None


def _adapter_dir(adapter: Union[str, os.PathLike]) -> Path:
    """The peft adapter directory: `adapter` itself, or the adapter/ of a LoRA run's (newest) checkpoint."""
    path = Path(adapter).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"--adapter {path} does not exist; give a LoRA adapter directory "
                              f"({_ADAPTER_CONFIG} + adapter_model.safetensors)")
    if (path / _ADAPTER_CONFIG).is_file():
        return path
    # A LoRA run's checkpoints each hold their adapter in adapter/: accept the checkpoint or run too.
    try:
        inside = find_checkpoint(path) / "adapter"
    except CheckpointError:
        inside = path / "adapter"
    if (inside / _ADAPTER_CONFIG).is_file():
        return inside
    raise CheckpointError(f"--adapter {path} holds no {_ADAPTER_CONFIG}; give a LoRA adapter directory as peft "
                          "or shardwise saves it (adapter_config.json + adapter_model.safetensors)")


def _run_data(checkpoint_dir: Path) -> Optional[dict]:
    """The data section of the shardwise run that wrote `checkpoint_dir`, or None when it is not one."""
    if not (checkpoint_dir / "config.yaml").is_file():
        return None
    return dict(read_yaml(checkpoint_dir / "config.yaml").get("data") or {})


def _instruction_template(data: Optional[dict]) -> Any:
    """The chat template a run trained with, or None when it did not train on instruction data."""
    if not data or data.get("kind", "pretrain") != "instruction":
        return None
    return data.get("template", "auto")


def _json_object(file: Path) -> dict:
    """A model directory's JSON settings file; CheckpointError naming it when it is not a JSON object."""
    try:
        doc = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, or nested too deep
        raise CheckpointError(f"{file} is not valid JSON ({e}); fix it or copy the model directory again") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{file} holds a JSON {type(doc).__name__}, not an object; fix it or copy the model "
                              "directory again")
    return doc


def _has_tokenizer(directory: Path) -> bool:
    return any((directory / name).is_file() for name in _TOKENIZER_FILES)


def _adds_bos(tokenizer: Any, config_dir: Path) -> bool:
    """Whether the tokenizer puts bos before a text by default, as transformers' tokenizer(text) does."""
    if tokenizer.bos_id is None:
        return False
    config_file = config_dir / "tokenizer_config.json"
    if config_file.is_file():
        flag = _json_object(config_file).get("add_bos_token")
        if isinstance(flag, bool):
            return flag
    if isinstance(tokenizer.backend, HFTokenizer):  # tokenizer.json: its post-processor says (LLaMA 3 adds)
        ids = tokenizer.backend.encode("a", add_special_tokens=True).ids
        return bool(ids) and ids[0] == tokenizer.bos_id
    return True  # a SentencePiece model (LLaMA-1/2): transformers' LlamaTokenizer adds bos by default


def _hf_eos_ids(directory: Path, vocab_size: int) -> list[int]:
    """eos_token_id of generation_config.json (else config.json): one id or a list (LLaMA 3 has three)."""
    for name in ("generation_config.json", "config.json"):
        file = directory / name
        if file.is_file():
            value = _json_object(file).get("eos_token_id")
            if value is not None:
                ids = value if isinstance(value, list) else [value]
                return [i for i in ids if isinstance(i, int) and 0 <= i < vocab_size]
    return []


def load_for_generation(
    source: Union[str, os.PathLike],
    tokenizer: Union[str, os.PathLike, None] = None,
    adapter: Union[str, os.PathLike, None] = None,
    device: Union[str, torch.device] = "cpu",
    dtype: torch.dtype = torch.float32,
) -> GenerationModel:
    """Load a shardwise checkpoint/run directory or a Hugging Face model directory, optionally with a
    peft-format LoRA adapter, and its tokenizer; and find out whether it is instruction-tuned.

    The tokenizer is `tokenizer`, else one saved with the adapter (in its directory, or its LoRA run's
    tokenizer/), else the source's. The weights count as instruction-tuned (so prompts get the chat
    template) when the run that saved the adapter or checkpoint trained on instruction data (its
    data.template is used, as training rendered conversations), or when a Hugging Face model or an
    adapter from elsewhere comes with a tokenizer that has a chat template.
    """
    # Every path is checked, and the tokenizer read, before the (possibly large) model is loaded.
    kind, path = generation_source(source)
    source_data = _run_data(path) if kind == "checkpoint" else None
    adapter_path = _adapter_dir(adapter) if adapter is not None else None
    adapter_data = _run_data(adapter_path.parent) if adapter_path is not None else None
    tokenizer_dir = Path(tokenizer).expanduser() if tokenizer is not None else None
    if tokenizer_dir is None and adapter_path is not None:  # fine-tuning tools save the tokenizer they used
        if _has_tokenizer(adapter_path):
            tokenizer_dir = adapter_path
        elif adapter_data is not None and (adapter_path.parent / "tokenizer").is_dir():
            tokenizer_dir = adapter_path.parent / "tokenizer"
    if tokenizer_dir is None:
        tokenizer_dir = path if kind == "hf" else path / "tokenizer"
        if not (_has_tokenizer(tokenizer_dir) if kind == "hf" else tokenizer_dir.is_dir()):
            what = (f"Hugging Face directory {path} holds no {' or '.join(_TOKENIZER_FILES)}" if kind == "hf"
                    else f"checkpoint {path} holds no tokenizer/ (the run was given none)")
            raise ConfigError(f"{what}; pass the tokenizer directory the model was trained with: --tokenizer DIR")
    tok = load_tokenizer(tokenizer_dir)

    if kind == "hf":
        model = from_hf(path, device=device, dtype=dtype)
    else:
        model, _ = load_model(path, device=device, dtype=dtype)
    if adapter_path is not None:
        if any(is_lora_name(n) for n, _ in model.named_parameters()):
            merge_lora(model)  # the checkpoint's own adapters become base weights; the new one goes on top
        load_adapter(model, adapter_path)
        model.eval()
    if tok.vocab_size > model.cfg.vocab_size:
        raise ConfigError(
            f"tokenizer {tokenizer_dir} has {tok.vocab_size} tokens but the model only {model.cfg.vocab_size}; "
            "pass the tokenizer the model was trained with (--tokenizer DIR)"
        )

    tuned, because = None, ""
    if adapter_data is not None:  # an adapter saved by a shardwise run: that run knows how it trained
        tuned, because = _instruction_template(adapter_data), "the adapter's run trained on instruction data"
    elif _instruction_template(source_data) is not None:
        tuned, because = _instruction_template(source_data), "the checkpoint's run trained on instruction data"
    elif (kind == "hf" or adapter_path is not None) and tok.chat_template is not None:
        tuned, because = "tokenizer", "its tokenizer has a chat template"

    if kind == "hf":
        # Continue plain text as transformers would feed it: with bos when the tokenizer adds one.
        tok_config_dir = tokenizer_dir if tokenizer_dir.is_dir() else tokenizer_dir.parent
        prefix = [tok.bos_id] if _adds_bos(tok, tok_config_dir) else []
        extra = _hf_eos_ids(path, model.cfg.vocab_size)
    else:
        # Pre-training separates documents with EOS and never feeds BOS: the model learned that a new
        # document starts after EOS.
        prefix, extra = [tok.eos_id], []
    stops = [tok.eos_id] + [i for i in extra if i != tok.eos_id]
    return GenerationModel(model, tok, kind, tuned, because, prefix, list(dict.fromkeys(stops)))
