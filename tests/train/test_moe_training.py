"""Training a mixture-of-experts model: the load per block in the step records, the auxiliary-loss-free bias
moving and resuming exactly, and what a MoE model does not run with yet refused before any work."""

from __future__ import annotations

import pytest
import torch

from shardwise.errors import ConfigError
from shardwise.models.moe import moe_layers
from shardwise.train.trainer import Trainer

from .conftest import read_metrics, tiny_config, with_changes

MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense": 1,
       "router_score": "sigmoid", "router_bias": True, "moe_bias_update_rate": 0.05, "moe_aux_loss_coef": 0.01}


def _cfg(root, steps: int = 4, **model):  # noqa: ANN001, ANN202
    return with_changes(tiny_config(root, max_steps=steps, decay_style="constant"), model={**MOE, **model})


def _biases(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: m.router.expert_bias.clone() for name, m in moe_layers(trainer.model).items()}


def test_a_moe_model_trains_and_logs_each_blocks_load(tmp_path, dataset):
    trainer = Trainer(_cfg(tmp_path, steps=5), train_dataset=dataset)  # odd: sign steps cannot cancel out
    result = trainer.train()
    losses = [result.losses[s] for s in sorted(result.losses)]
    assert losses[-1] < losses[0]
    records = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(records) == 5
    for r in records:  # block 0 is dense; block 1's busiest expert over the mean, between even and all on 2
        assert set(r["expert_load"]) == {"1"} and 1.0 <= r["expert_load"]["1"] <= 4 / 2
    biases = _biases(trainer)["1"]
    assert biases.dtype == torch.float32 and biases.abs().max() > 0  # the balancing moved them
    assert torch.allclose(biases / 0.05, (biases / 0.05).round())  # whole steps of the rate


def test_resuming_a_moe_run_continues_it_exactly(tmp_path, dataset):
    full = Trainer(_cfg(tmp_path / "full"), train_dataset=dataset)
    expected = full.train().losses
    Trainer(_cfg(tmp_path / "half", steps=2), train_dataset=dataset).train()
    resumed = Trainer(_cfg(tmp_path / "half"), train_dataset=dataset)
    got = resumed.train(resume="auto").losses
    assert sorted(got) == [3, 4] and all(got[s] == expected[s] for s in (3, 4))
    for name, bias in _biases(full).items():
        assert torch.equal(_biases(resumed)[name], bias), name  # the router biases are in the checkpoint


@pytest.mark.parametrize("change, message", [
    ({"parallel": {"tensor_parallel": 2, "data_parallel": 4, "expert_parallel": 2}},
     "parallel.expert_parallel 2 below data_parallel 4 with tensor_parallel 2"),
    ({"parallel": {"context_parallel": 2, "data_parallel": 2, "expert_parallel": 2}},
     "parallel.context_parallel 2 with expert_parallel 2 on a mixture-of-experts model"),
    ({"optimize": {"float8": True, "mixed_precision": "bf16"}}, "optimize.float8 converts nn.Linear layers"),
])
def test_what_a_moe_model_does_not_run_with_yet_is_refused(tmp_path, change, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        with_changes(_cfg(tmp_path), **change)
