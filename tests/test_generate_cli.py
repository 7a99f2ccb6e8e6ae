"""`shardwise generate`: Hugging Face directories match transformers' greedy generate, LoRA adapters
equal their merged model, chat prompts are rendered exactly as training rendered them (default, dict and
Jinja templates, and transformers' apply_chat_template), batches equal single prompts, streamed output,
and clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import shardwise.cli
from shardwise.data import load_tokenizer, train_bpe_tokenizer
from shardwise.data.chat import chat_stop_ids, encode_conversation, render_generation_prompt
from shardwise.errors import DataError
from shardwise.inference import load_for_generation
from shardwise.models import generate
from tests.data.conftest import write_corpus
from tests.test_cli import assert_user_error, logging_restored, run_cli

transformers = pytest.importorskip("transformers")

VOCAB = 320  # the model's rows; the tokenizer has 300 tokens plus a few added ones
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Answers follow "### A:" and what follows {content} is trained too: a template unlike the default one.
DICT_TEMPLATE = {"user": "### Q: {content}\n", "assistant": "### A: {content}\n", "system": "{content}\n",
                 "bos": "sample", "eos": "turn"}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Who is Jane?"},
    {"role": "assistant", "content": "Her sister."},
    {"role": "user", "content": "And Darcy?"},
    {"role": "assistant", "content": "He was at the ball."},
]


@pytest.fixture(autouse=True)
def _restore_logging():
    with logging_restored():
        yield


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 300-token BPE tokenizer plus ChatML's special tokens (no chat template)."""
    root = tmp_path_factory.mktemp("tok")
    train_bpe_tokenizer(write_corpus(root / "corpus"), 300, root / "tok", show_progress=False)
    tok = load_tokenizer(root / "tok")
    tok.backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(root / "tok")
    return root / "tok"


@pytest.fixture(scope="module")
def chatml_dir(tok_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tokenizer with a ChatML chat template (turns end with <|im_end|>, not eos)."""
    out = tmp_path_factory.mktemp("chatml")
    tok = load_tokenizer(tok_dir)
    tok.chat_template = CHATML
    tok.save(out)
    return out


def _hf_dir(root: Path, tok_dir: Path, family: str, chat_template: str | None = None,
            hidden_size: int = 32) -> tuple[object, Path]:
    """A tiny random transformers model saved with the tokenizer; llama's tokenizer adds bos as LLaMA's does."""
    torch.manual_seed(0)
    ids = dict(bos_token_id=0, eos_token_id=1, pad_token_id=2)
    if family == "llama":
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden_size, intermediate_size=48,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       max_position_embeddings=128,
                                       attn_implementation="eager", **ids)
        hf = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
                                      **ids)
        hf = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():  # peaked logits: greedy choices far from ties
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    path = root / family
    hf.eval().save_pretrained(path, safe_serialization=True)
    tok = load_tokenizer(tok_dir)
    tok.chat_template = chat_template
    tok.save(path)
    if family == "llama":
        spec = json.loads((path / "tokenizer.json").read_text())
        spec["post_processor"] = {"type": "Sequence", "processors": [spec["post_processor"], {
            "type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}},
                                                     {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|bos|>": {"id": "<|bos|>", "ids": [0], "tokens": ["<|bos|>"]}}}]}
        (path / "tokenizer.json").write_text(json.dumps(spec))
    return hf, path


@pytest.fixture(scope="module")
def hf_llama(tok_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    return _hf_dir(tmp_path_factory.mktemp("hf"), tok_dir, "llama")


def _hf_greedy(hf, ids: list[int], steps: int) -> list[int]:
    out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      do_sample=False, max_new_tokens=steps, pad_token_id=2)
    return out[0, len(ids):].tolist()


def _answer_start(trained: list[bool]) -> int:
    """Index of the last assistant answer's first token: the start of the last run of trained tokens."""
    i = len(trained)
    while i > 0 and not trained[i - 1]:
        i -= 1
    while i > 0 and trained[i - 1]:
        i -= 1
    return i


# --- Hugging Face directories ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hf_dir_greedy_equals_transformers(capsys, tok_dir, tmp_path, family) -> None:
    """From an HF directory: the prompt is what transformers' tokenizer makes of it (bos where it adds one),
    the new tokens are transformers' greedy ones, and the CLI streams prompt + continuation."""
    hf, path = _hf_dir(tmp_path, tok_dir, family)
    prompt = "Elizabeth walked to the"
    ids = transformers.AutoTokenizer.from_pretrained(path)(prompt)["input_ids"]
    assert (ids[0] == 0) == (family == "llama")  # bos: as the tokenizer adds it
    expected = _hf_greedy(hf, ids, 8)

    loaded = load_for_generation(path)
    assert loaded.kind == "hf" and loaded.chat_template() is None  # no chat template: plain text
    assert loaded.prompt_ids([prompt]) == [ids]
    assert generate(loaded.model, [ids], 8, eos_id=loaded.stop_ids_for()) == [expected]

    code, out, err = run_cli(capsys, "generate", path, "--prompt", prompt, "--max-new-tokens", "8")
    assert code == 0, err
    assert out == prompt + loaded.tokenizer.decode(expected) + "\n"


def test_batch_of_prompts_of_different_lengths_equals_each_alone(capsys, hf_llama) -> None:
    hf, path = hf_llama
    loaded = load_for_generation(path)
    prompts = ["Jane", "The sister of Elizabeth was at the ball in the"]
    ids = loaded.prompt_ids(prompts)
    assert len(ids[0]) < len(ids[1])
    batch = generate(loaded.model, ids, 6, eos_id=loaded.stop_ids_for())
    assert batch == [generate(loaded.model, [p], 6, eos_id=loaded.stop_ids_for())[0] for p in ids]
    assert batch == [_hf_greedy(hf, p, 6) for p in ids]

    code, out, err = run_cli(capsys, "generate", path, "--prompt", prompts[0], "--prompt", prompts[1],
                             "--max-new-tokens", "6")
    assert code == 0, err
    decode = loaded.tokenizer.decode
    assert out == "".join(f"{p}{decode(b)}\n---\n" for p, b in zip(prompts, batch))


def test_hf_chat_model_uses_its_template_and_stops_at_end_of_turn(capsys, chatml_dir, tmp_path,
                                                                  monkeypatch) -> None:
    """An HF model whose tokenizer has a chat template gets it automatically, with --system, and stops at
    <|im_end|>; --no-chat continues the plain text."""
    _, path = _hf_dir(tmp_path, chatml_dir, "llama", chat_template=CHATML)
    fast = transformers.AutoTokenizer.from_pretrained(path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who is Jane?"}]
    expected = fast.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    im_end = fast.convert_tokens_to_ids("<|im_end|>")

    seen = []
    monkeypatch.setattr(shardwise.cli, "generate", lambda model, prompts, **kw: seen.append((prompts, kw))
                        or generate(model, prompts, **kw))
    code, out, err = run_cli(capsys, "generate", path, "--prompt", "Who is Jane?", "--system", "Be brief.",
                             "--max-new-tokens", "4")
    assert code == 0, err
    (prompts, kw) = seen[-1]
    assert prompts == [expected]
    assert set(kw["eos_id"]) == {1, im_end}
    assert "the tokenizer's chat template" in err

    code, out, err = run_cli(capsys, "generate", path, "--prompt", "Who is Jane?", "--no-chat",
                             "--max-new-tokens", "4")
    assert code == 0, err
    assert seen[-1][0] == [fast("Who is Jane?")["input_ids"]]
    code, _, err = run_cli(capsys, "generate", path, "--prompt", "Hi", "--no-chat", "--system", "x")
    assert_user_error(code, err, "--system", "--chat")


# --- chat prompts exactly as training renders them ----------------------------------------------------------


@pytest.mark.parametrize("template", ["default", "dict", "jinja"])
def test_generation_prompt_is_training_encoding_up_to_the_answer(chatml_dir, template) -> None:
    tok = load_tokenizer(chatml_dir)
    option = {"default": "default", "dict": DICT_TEMPLATE, "jinja": "tokenizer"}[template]
    for conversation in (CONVERSATION[1:3], CONVERSATION[:3], CONVERSATION):
        ids, trained = encode_conversation(conversation, tok, option)
        got = render_generation_prompt(option, tok, conversation[:-1])
        assert got == ids[:_answer_start(trained)]
    stops = chat_stop_ids(option, tok)
    assert stops == ([tok.eos_id, tok.token_to_id("<|im_end|>")] if template == "jinja" else [tok.eos_id])


def test_jinja_generation_prompt_equals_transformers_apply_chat_template(chatml_dir) -> None:
    tok = load_tokenizer(chatml_dir)
    fast = transformers.PreTrainedTokenizerFast.from_pretrained(chatml_dir)
    for messages in (CONVERSATION[1:2], CONVERSATION[:2], CONVERSATION[:4]):
        expected = fast.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
        assert render_generation_prompt("tokenizer", tok, messages) == expected


def test_generation_prompt_must_end_with_a_user_message(chatml_dir) -> None:
    tok = load_tokenizer(chatml_dir)
    with pytest.raises(DataError, match="ending with the user message"):
        render_generation_prompt("default", tok, CONVERSATION[:3])
    with pytest.raises(DataError, match="alternate"):
        render_generation_prompt("default", tok, [CONVERSATION[1], CONVERSATION[1]])


# --- our instruction checkpoints ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def instruction_run(tok_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One training step on chat data with DICT_TEMPLATE: a checkpoint whose config says instruction."""
    from shardwise.train.trainer import Trainer
    from tests.train.conftest import tiny_config, with_changes

    root = tmp_path_factory.mktemp("sft")
    rows = [{"messages": [{"role": "user", "content": f"Who {i}?"}, {"role": "assistant", "content": "Jane"}]}
            for i in range(8)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = with_changes(tiny_config(root, max_steps=1, save_steps=1, micro_batch_size=2),
                       data={"kind": "instruction", "train_files": [str(root / "train.jsonl")],
                             "tokenizer": str(tok_dir), "template": DICT_TEMPLATE,
                             "cache_dir": str(root / "cache")})
    Trainer(cfg).train()
    return root / "run"


def test_instruction_checkpoint_renders_prompts_as_training_did(capsys, instruction_run, monkeypatch) -> None:
    """Auto chat on an instruction checkpoint: the run's own template, the prompt ending where training's
    answers start; the streamed output is the answer alone. --no-chat: EOS + text, as for pre-training."""
    loaded = load_for_generation(instruction_run)
    assert loaded.tuned_template == DICT_TEMPLATE
    tok = loaded.tokenizer
    seen = []
    monkeypatch.setattr(shardwise.cli, "generate", lambda model, prompts, **kw: seen.append(prompts)
                        or generate(model, prompts, **kw))

    conversation = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Who 3?"},
                    {"role": "assistant", "content": "Jane"}]
    ids, trained = encode_conversation(conversation, tok, DICT_TEMPLATE)
    code, out, err = run_cli(capsys, "generate", instruction_run, "--prompt", "Who 3?", "--system", "Be kind.",
                             "--max-new-tokens", "5")
    assert code == 0, err
    assert seen[-1] == [ids[:_answer_start(trained)]]
    (new,) = generate(loaded.model, seen[-1], 5, eos_id=tok.eos_id)
    assert out == tok.decode(new).lstrip() + "\n"

    code, out, err = run_cli(capsys, "generate", instruction_run, "--prompt", "Who 3?", "--no-chat",
                             "--max-new-tokens", "2")
    assert code == 0, err
    assert seen[-1] == [[tok.eos_id, *tok.encode("Who 3?")]]

    # Two prompts: one batch, each answer printed under its prompt.
    code, out, err = run_cli(capsys, "generate", instruction_run, "--prompt", "Who 3?", "--prompt", "Who 12?",
                             "--max-new-tokens", "3")
    assert code == 0, err
    assert len(seen[-1]) == 2 and out.startswith("> Who 3?\n") and "\n---\n> Who 12?\n" in out


# --- LoRA adapters --------------------------------------------------------------------------------------------


def _random_adapter(base: Path, out: Path, seed: int = 0) -> Path:
    """A LoRA adapter for `base` with random non-zero A and B (a fresh adapter would change nothing)."""
    from shardwise.models.hf import from_hf
    from shardwise.peft.lora import apply_lora, lora_state_dict, save_adapter

    model = from_hf(base)
    apply_lora(model, 4, 8.0, 0.0, ["wq", "wv", "w2"])
    g = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(v.shape, generator=g) * 0.3 for k, v in lora_state_dict(model).items()}
    return save_adapter(state, model.cfg, 4, 8.0, 0.0, ["wq", "wv", "w2"], out)


def test_base_plus_adapter_equals_the_merged_model(capsys, hf_llama, tmp_path) -> None:
    from shardwise.peft.lora import merge_lora

    _, base = hf_llama
    adapter = _random_adapter(base, tmp_path / "adapter")
    plain = load_for_generation(base)
    loaded = load_for_generation(base, adapter=adapter)
    prompts = loaded.prompt_ids(["Jane", "Elizabeth walked to the"])
    got = generate(loaded.model, prompts, 8)
    merged = load_for_generation(base, adapter=adapter).model
    merge_lora(merged)
    assert got == generate(merged, prompts, 8)
    assert got != generate(plain.model, prompts, 8)  # the adapter changes the output

    code, out, err = run_cli(capsys, "generate", base, "--adapter", adapter, "--prompt", "Jane",
                             "--max-new-tokens", "8")
    assert code == 0, err
    (new,) = generate(loaded.model, prompts[:1], 8, eos_id=loaded.stop_ids_for())
    assert out == "Jane" + loaded.tokenizer.decode(new) + "\n"


def test_adapter_with_a_chat_tokenizer_turns_chat_on(hf_llama, chatml_dir, tmp_path) -> None:
    """An adapter saved with a tokenizer (as fine-tuning tools do) brings its chat template along."""
    _, base = hf_llama
    adapter = _random_adapter(base, tmp_path / "adapter")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(chatml_dir / name, adapter / name)
    loaded = load_for_generation(base, adapter=adapter)
    assert loaded.chat_template() == "tokenizer"
    assert loaded.prompt_ids(["Hi"])[0][0] != 0  # plain prompts still work; chat ones start at <|im_start|>
    assert loaded.prompt_ids(["Hi"], "tokenizer")[0][0] == loaded.tokenizer.token_to_id("<|im_start|>")


def test_adapter_of_a_shardwise_instruction_run_uses_that_runs_template(hf_llama, instruction_run,
                                                                       tmp_path) -> None:
    """A LoRA run's checkpoint holds adapter/ beside its config.yaml and tokenizer/: the run's template
    and tokenizer are used, and the run (or checkpoint) directory itself is accepted as --adapter."""
    _, base = hf_llama
    run = tmp_path / "lora_run"
    shutil.copytree(instruction_run, run)
    (checkpoint,) = sorted((run / "checkpoints").glob("step_*"))
    _random_adapter(base, checkpoint / "adapter")  # files the checkpoint's checksums do not list: not verified
    for adapter in (checkpoint / "adapter", checkpoint, run):
        loaded = load_for_generation(base, adapter=adapter, verify=False)
        assert loaded.tuned_template == DICT_TEMPLATE and loaded.chat_template() == DICT_TEMPLATE
        assert loaded.tokenizer.fingerprint == load_tokenizer(checkpoint / "tokenizer").fingerprint
    assert load_for_generation(base, adapter=run, verify=False).stop_ids_for(DICT_TEMPLATE) == [1]


def test_generate_mistakes(capsys, hf_llama, tmp_path, tok_dir) -> None:
    """Missing adapter, an adapter of another base, a SOURCE that is no model, an adapter as SOURCE, an HF
    directory without a tokenizer: exit 2 with a message naming the fix."""
    _, base = hf_llama
    code, _, err = run_cli(capsys, "generate", base, "--adapter", tmp_path / "nope", "--prompt", "x")
    assert_user_error(code, err, str(tmp_path / "nope"), "does not exist")

    for family, hidden in (("llama", 48), ("gpt2", 32)):  # a wider LLaMA; another architecture
        root = tmp_path / f"{family}{hidden}"
        root.mkdir()
        _, other = _hf_dir(root, tok_dir, family, hidden_size=hidden)
        wrong = _random_adapter(other, root / "adapter")
        code, _, err = run_cli(capsys, "generate", base, "--adapter", wrong, "--prompt", "x")
        assert_user_error(code, err, str(wrong), *(["has shape", "another base model"] if family == "llama" else
                                                   ["another architecture"]))

    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run_cli(capsys, "generate", empty, "--prompt", "x")
    assert_user_error(code, err, "neither a Hugging Face model directory", "shardwise checkpoint")

    good = _random_adapter(base, tmp_path / "adapter")
    code, _, err = run_cli(capsys, "generate", good, "--prompt", "x")
    assert_user_error(code, err, f"--adapter {good}")

    bare = tmp_path / "bare"
    shutil.copytree(base, bare)
    (bare / "tokenizer.json").unlink()
    code, _, err = run_cli(capsys, "generate", bare, "--prompt", "x")
    assert_user_error(code, err, "--tokenizer")
    code, out, err = run_cli(capsys, "generate", bare, "--prompt", "x", "--tokenizer", base, "--max-new-tokens", "2")
    assert code == 0, err
