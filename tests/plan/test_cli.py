"""`shardwise plan` from the command line: the report, custom hardware, and user mistakes (exit 2)."""

from __future__ import annotations

import pytest

from shardwise.cli import main


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_prints_the_top_layouts_and_why(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = run(capsys, "--model", "tiny_llama", "--devices", "4", "--hardware", "cpu", "--seq-length", "64",
                       "--global-batch", "8", "--top", "3")
    assert code == 0
    assert "limit      " in out and "tokens/s per device at 100% MFU" in out
    table = [line for line in out.splitlines() if line[:2].strip() in ("1", "2", "3")]
    assert len(table) == 3 and "why #1" in out
    assert "fp32 O0" in out  # a CPU plans in fp32


def test_custom_hardware_and_a_target(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = run(capsys, "--model", "llama_7b", "--devices", "8", "--memory-gb", "80", "--tflops", "400",
                       "--bandwidth-gbps", "100", "--seq-length", "2048", "--global-batch", "16", "--top", "2",
                       "--tp", "1", "--pp", "1", "--target-tokens-per-s", "20000")
    assert code == 0
    assert "400 TFLOP/s bf16" in out
    assert "IMPOSSIBLE" in " ".join(out.split())


def test_list_hardware(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = run(capsys, "--list-hardware")
    assert code == 0 and "Ascend910B4" in out and "A100-40GB" in out


@pytest.mark.parametrize("argv, message", [
    (["--model", "llama_9b", "--devices", "8", "--hardware", "H100"], "llama_7b"),
    (["--model", "llama_7b", "--devices", "8", "--hardware", "X1"], "Known: H100"),
    (["--model", "llama_7b", "--devices", "8"], "--hardware NAME"),
    (["--model", "llama_7b", "--devices", "8", "--memory-gb", "80"], "add --tflops, --bandwidth-gbps"),
    (["--model", "llama_7b", "--hardware", "H100"], "--devices N is required"),
    (["--model", "llama_7b", "--devices", "8", "--hardware", "H100", "--tp", "3"], "--tp 3 does not divide 8"),
    (["--model", "llama_7b", "--devices", "8", "--hardware", "H100", "--zero", "x"], "--zero 'x'"),
])
def test_mistakes_exit_2_with_a_message(capsys: pytest.CaptureFixture, argv: list[str], message: str) -> None:
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert message in err and "Traceback" not in err


def test_a_config_that_starts_from_weights_is_planned_with_their_architecture(capsys: pytest.CaptureFixture,
                                                                              tmp_path) -> None:  # noqa: ANN001
    """model.init_from: the plan reads the weights' architecture as `shardwise train` and `estimate` do (it
    stopped asking for a Python function before)."""
    import transformers
    import yaml

    hf_cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    transformers.LlamaForCausalLM(hf_cfg).save_pretrained(tmp_path / "weights", safe_serialization=True)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": {"init_from": str(tmp_path / "weights")},
                                      "train": {"output_dir": str(tmp_path / "run"), "max_steps": 1,
                                                "micro_batch_size": 1}}), encoding="utf-8")
    code, out, err = run(capsys, str(config), "--devices", "2", "--hardware", "cpu", "--seq-length", "64",
                         "--global-batch", "4", "--top", "1")
    assert code == 0, err
    assert "why #1" in out
