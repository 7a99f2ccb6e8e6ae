"""A model to generate from: a shardwise checkpoint or run directory, or a Hugging Face model
directory, optionally with a LoRA adapter in peft's format, and its tokenizer; and whether the weights
are instruction-tuned, so that prompts get the chat template they were trained with."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch
from tokenizers import Tokenizer as HFTokenizer

from .checkpoint.storage import CHECKSUMS_FILE, find_checkpoint, skipped_verification, verify_checkpoint
from .checkpoint.weights import load_model
from .data.chat import chat_stop_ids, render_generation_prompt, resolve_template
from .data.tokenizer import Tokenizer, load_tokenizer
from .errors import CheckpointError, ConfigError
from .models.hf import from_hf
from .models.transformer import Transformer
from .peft.lora import is_lora_name, load_adapter, merge_lora
from .untrusted import read_json_object, read_yaml

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
    config = path / "config.json"
    if config.exists() or config.is_symlink():  # a config.json that is no regular file is refused when read
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


def run_config_doc(checkpoint_dir: Path) -> Optional[dict]:
    """The config.yaml a shardwise run saved in `checkpoint_dir` (None when there is none), read as a
    file from elsewhere: bounded, without aliases, a mapping; CheckpointError naming it otherwise."""
    path = checkpoint_dir / "config.yaml"
    if not path.exists() and not path.is_symlink():
        return None
    doc = read_yaml(path, CheckpointError, advice="the checkpoint's config is damaged; restore it from the run")
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path}: holds a YAML {type(doc).__name__}, not a mapping of sections; the "
                              "checkpoint's config is damaged")
    return doc


def _section(doc: Optional[dict], name: str, path: Path) -> Optional[dict]:
    if doc is None:
        return None
    value = doc.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise CheckpointError(f"{path / 'config.yaml'}: the {name} section is a {type(value).__name__}, not a "
                              "mapping; the checkpoint's config is damaged")
    return dict(value)


def _run_data(checkpoint_dir: Path) -> Optional[dict]:
    """The data section of the shardwise run that wrote `checkpoint_dir`, or None when it is not one; its
    chat template checked as the run config's schema has it (a name or a dict of texts)."""
    data = _section(run_config_doc(checkpoint_dir), "data", checkpoint_dir)
    template = (data or {}).get("template", "auto")
    if not (template in ("auto", "default", "tokenizer") or (
            isinstance(template, dict) and all(isinstance(k, str) and isinstance(v, str) and len(v) <= 100_000
                                               for k, v in template.items()))):
        raise CheckpointError(f"{checkpoint_dir / 'config.yaml'}: data.template is {type(template).__name__}, not "
                              "'auto', 'default', 'tokenizer' or a dict of texts; the checkpoint's config is damaged")
    return data


def _saved_by_a_run(adapter_path: Optional[Path]) -> list[Path]:
    """The shardwise checkpoint an adapter directory lies in (its adapter/), if any."""
    if adapter_path is None or not (adapter_path.parent / CHECKSUMS_FILE).is_file():
        return []
    return [adapter_path.parent]


def _instruction_template(data: Optional[dict]) -> Any:
    """The chat template a run trained with, or None when it did not train on conversations (instruction or
    preference data)."""
    if not data or data.get("kind", "pretrain") not in ("instruction", "preference"):
        return None
    return data.get("template", "auto")


def _json_object(file: Path) -> dict:
    """A model directory's JSON settings file; CheckpointError naming it when it is not a JSON object."""
    return read_json_object(file, CheckpointError, advice="fix it or copy the model directory again")


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
                return [i for i in ids if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size]
    return []


@torch.no_grad()
def _check_finite(model: Transformer, source: Path, which: Callable[[str], bool] = lambda name: True) -> None:
    """Every weight (of those `which` names) a finite number: a NaN or an infinity would make every
    sampled token garbage (and sampling fail), so the file is named here instead."""
    for name, param in model.named_parameters():
        if which(name) and param.is_floating_point() and not bool(torch.isfinite(param).all()):
            raise CheckpointError(f"{source}: the weight {name} holds NaN or infinite values (in "
                                  f"{str(param.dtype).removeprefix('torch.')}), so the model cannot generate; the "
                                  "weights are damaged, a diverged run saved them, or they overflow a 16-bit --dtype")


def load_for_generation(
    source: Union[str, os.PathLike],
    tokenizer: Union[str, os.PathLike, None] = None,
    adapter: Union[str, os.PathLike, None] = None,
    device: Union[str, torch.device] = "cpu",
    dtype: torch.dtype = torch.float32,
    verify: bool = True,
) -> GenerationModel:
    """Load a shardwise checkpoint/run directory or a Hugging Face model directory, optionally with a
    peft-format LoRA adapter, and its tokenizer; and find out whether it is instruction-tuned.

    The tokenizer is `tokenizer`, else one saved with the adapter (in its directory, or its LoRA run's
    tokenizer/), else the source's. The weights count as instruction-tuned (so prompts get the chat
    template) when the run that saved the adapter or checkpoint trained on instruction data (its
    data.template is used, as training rendered conversations), or when a Hugging Face model or an
    adapter from elsewhere comes with a tokenizer that has a chat template.

    A shardwise checkpoint's files (the source's, and an adapter's when a shardwise run saved it) are
    checked against its checksums before any of them is read (`verify`; False skips that, saying so).
    """
    # Every path is checked, and the tokenizer read, before the (possibly large) model is loaded.
    kind, path = generation_source(source)
    adapter_path = _adapter_dir(adapter) if adapter is not None else None
    for checkpoint in ([path] if kind == "checkpoint" else []) + _saved_by_a_run(adapter_path):
        if verify:
            verify_checkpoint(checkpoint, no_dist=True)
        else:
            skipped_verification(checkpoint, "--no-verify")
    source_data = _run_data(path) if kind == "checkpoint" else None
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
        model, _ = load_model(path, device=device, dtype=dtype, verify=False)  # verified above
    _check_finite(model, path)
    if adapter_path is not None:
        if any(is_lora_name(n) for n, _ in model.named_parameters()):
            merge_lora(model)  # the checkpoint's own adapters become base weights; the new one goes on top
        load_adapter(model, adapter_path)
        model.eval()
        _check_finite(model, adapter_path, is_lora_name)
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
