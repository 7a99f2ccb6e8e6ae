"""Generation: cached batched decoding equals recomputing the sequence; sampling options; stopping rules."""

import pytest
import torch

from shardwise.errors import ConfigError
from shardwise.models import build_model, generate, resolve_model_config
from shardwise.models.generate import FINISHED

PROMPTS = [[5, 17, 3, 99, 250, 7], [42], [8, 9, 10]]


def _model(preset: str, **overrides):
    # A wide init makes logits peaked, so greedy choices are far from ties.
    cfg = resolve_model_config({"preset": preset, "initializer_range": 0.2, **overrides})
    torch.manual_seed(0)
    return build_model(cfg).eval()


def _greedy_without_cache(model, prompt, steps):
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([seq]))[0, -1]
            seq.append(int(logits.argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("preset", ["tiny_llama", "tiny_gpt2"])
def test_batched_cached_greedy_equals_full_recompute(preset):
    model = _model(preset)
    got = generate(model, PROMPTS, max_new_tokens=12)
    expected = [_greedy_without_cache(model, p, 12) for p in PROMPTS]
    assert got == expected
    assert all(len(row) == 12 for row in got)
    assert len({tuple(row) for row in got}) == 3  # rows really differ


def test_tensor_prompt_and_single_prompt():
    model = _model("tiny_llama")
    batch = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert generate(model, batch, 5) == [_greedy_without_cache(model, p, 5) for p in batch.tolist()]
    assert generate(model, [1, 2, 3], 5) == generate(model, [[1, 2, 3]], 5)


def test_top_k_one_and_tiny_top_p_equal_greedy():
    model = _model("tiny_llama")
    greedy = generate(model, PROMPTS, 10)
    gen = torch.Generator().manual_seed(1)
    assert generate(model, PROMPTS, 10, temperature=1.0, top_k=1, generator=gen) == greedy
    assert generate(model, PROMPTS, 10, temperature=1.0, top_p=1e-6, generator=gen) == greedy


def test_sampling_is_reproducible_with_a_generator_and_differs_from_greedy():
    model = _model("tiny_llama", initializer_range=0.02)  # flat logits: sampling wanders
    def run(seed: int) -> list[list[int]]:
        return generate(model, PROMPTS, 16, temperature=1.0, top_k=50, top_p=0.95,
                        generator=torch.Generator().manual_seed(seed))
    first = run(7)
    assert first == run(7)
    assert first != generate(model, PROMPTS, 16)
    assert all(0 <= t < model.cfg.vocab_size for row in first for t in row)


def test_eos_stops_its_row_and_stream_reports_finished_rows():
    model = _model("tiny_llama")
    greedy = generate(model, PROMPTS, 8)
    eos = greedy[0][2]  # the third token of row 0 becomes the end marker
    stream = []
    got = generate(model, PROMPTS, 8, eos_id=eos, on_token=stream.append)
    assert got[0] == greedy[0][:3]
    for row, full in zip(got[1:], greedy[1:]):
        assert row == (full[: full.index(eos) + 1] if eos in full else full)
    assert all(len(step) == 3 for step in stream)
    assert [step[0] for step in stream][:3] == greedy[0][:3]
    assert all(step[0] == FINISHED for step in stream[3:])
    # The stream, read per row without FINISHED markers, is exactly the result.
    assert [[s[r] for s in stream if s[r] != FINISHED] for r in range(3)] == got


def test_stops_at_max_position_embeddings():
    model = _model("tiny_llama")  # 256 positions
    prompt = [[1] * 250, [2] * 10]
    got = generate(model, prompt, max_new_tokens=50)
    assert [len(r) for r in got] == [6, 6]
    assert generate(model, PROMPTS, 0) == [[], [], []]
    with pytest.raises(ConfigError, match="256 positions"):
        generate(model, [[1] * 256], 1)


def test_restores_training_mode_and_rejects_bad_arguments():
    model = _model("tiny_llama").train()
    generate(model, [[1, 2]], 2)
    assert model.training
    with pytest.raises(ConfigError, match="at least one token"):
        generate(model, [[1], []], 2)
    with pytest.raises(ConfigError, match="temperature"):
        generate(model, [[1]], 2, temperature=-1.0)
    with pytest.raises(ConfigError, match="top_p"):
        generate(model, [[1]], 2, temperature=1.0, top_p=1.5)
    with pytest.raises(ConfigError, match="vocabulary"):
        generate(model, [[100000]], 2)


def test_several_stop_ids_end_a_row_at_the_first_of_them():
    """eos_id may be several ids (eos and a chat template's end-of-turn token): each ends its row."""
    model = _model("tiny_llama")
    greedy = generate(model, PROMPTS, 8)
    first, second = greedy[0][1], greedy[1][3]
    got = generate(model, PROMPTS, 8, eos_id=[first, second])
    for row, full in zip(got, greedy):
        cut = min((full.index(t) + 1 for t in (first, second) if t in full), default=len(full))
        assert row == full[:cut]
    assert got[0] == greedy[0][:2]
    assert generate(model, PROMPTS, 8, eos_id=[]) == greedy
