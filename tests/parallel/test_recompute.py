import pytest
import torch

from shardwise.models import build_model, resolve_model_config
from shardwise.parallel.recompute import apply_recompute, canonical_name


def _grads_and_calls(mode: str, every: int = 1):
    torch.manual_seed(0)
    model = build_model(resolve_model_config({"preset": "tiny_llama", "num_layers": 4}))
    calls = {name: 0 for name in model.layers}
    for name, block in model.layers.items():
        block.feed_forward.w1.register_forward_hook(lambda *a, n=name: calls.__setitem__(n, calls[n] + 1))
    wrapped = apply_recompute(model, mode, every)
    tokens = torch.randint(0, 512, (2, 16))
    loss = model(tokens).logsumexp(-1).mean()
    loss.backward()
    grads = {canonical_name(n): p.grad.clone() for n, p in model.named_parameters()}
    return loss.item(), grads, calls, wrapped


def test_recompute_modes_keep_gradients_and_recompute_what_they_say():
    ref_loss, ref_grads, calls, wrapped = _grads_and_calls("none")
    assert wrapped == [] and set(calls.values()) == {1}
    for mode, every, expected_wrapped in (("full", 1, ["0", "1", "2", "3"]), ("full", 2, ["0", "2"]),
                                          ("selective", 1, ["0", "1", "2", "3"])):
        loss, grads, calls, wrapped = _grads_and_calls(mode, every)
        assert wrapped == expected_wrapped
        assert loss == pytest.approx(ref_loss, abs=1e-6)
        assert grads.keys() == ref_grads.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-6, rtol=1e-5)
        for name, n in calls.items():
            # a recomputed block runs its forward again in backward
            assert n == (2 if name in wrapped else 1), (mode, every, name)


def test_recompute_keeps_state_dict_names():
    model = build_model(resolve_model_config({"preset": "tiny_llama"}))
    names = set(model.state_dict())
    apply_recompute(model, "full")
    assert set(model.state_dict()) == names
