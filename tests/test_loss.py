"""The token-loss sum: the chunked path (`chunked_token_loss_sum`, the model's forward with labels)
against the plain one (full logits, then `token_loss_sum`), and that it never holds the logits.

The layouts (TP, PP, ZeRO-3, tied embeddings through the Trainer) are in tests/parallel/test_chunked_loss.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from shardwise.loss import IGNORE_INDEX, chunked_token_loss_sum, token_loss_sum
from shardwise.memory.measure import MemoryTracker
from shardwise.models.config import ModelConfig
from shardwise.models.registry import get_preset
from shardwise.models.transformer import build_model

from .parallel.harness import GRAD_RTOL, assert_tensors_close, make_steps, tiny_config

LOSS_RTOL = 1e-6  # the bar for the loss of the same maths in fp32


def _head_inputs(n: int = 300, hidden: int = 32, vocab: int = 97, dtype: torch.dtype = torch.float32,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(3, n // 3, hidden, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.3).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (3, n // 3), generator=g)
    labels[0, :10] = IGNORE_INDEX  # ignored positions carry no loss and no gradient
    labels[2, -3:] = IGNORE_INDEX
    return h, w, labels


def _grads(loss: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, tensors))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


BOTH_BACKWARDS = pytest.mark.parametrize("in_forward", [True, False], ids=["gradients_in_forward", "recomputed"])


@pytest.mark.parametrize("chunk", [1, 7, 64, 100, 300, 4096])
@BOTH_BACKWARDS
def test_chunked_loss_equals_the_plain_loss_and_gradients_in_fp32(chunk: int, in_forward: bool) -> None:
    h, w, labels = _head_inputs()
    ref = token_loss_sum(h @ w.t(), labels)
    ref_h, ref_w = _grads(ref, h, w)
    got = chunked_token_loss_sum(h, w, labels, chunk, gradients_in_forward=in_forward)
    got_h, got_w = _grads(got, h, w)
    assert abs(float(got) - float(ref)) <= LOSS_RTOL * abs(float(ref))
    assert _rel(got_h, ref_h) <= GRAD_RTOL and _rel(got_w, ref_w) <= GRAD_RTOL
    # Ignored positions get exactly no gradient.
    assert not got_h[0, :10].any() and not got_h[2, -3:].any()


@BOTH_BACKWARDS
def test_the_compiled_chunks_give_the_plain_loss_and_gradients_in_fp32(in_forward: bool) -> None:
    # run.compile: each chunk's forward and backward work through torch.compile (a last chunk of another size
    # compiles once more); fused kernels reorder the sums, so the bar is the gradients' one.
    h, w, labels = _head_inputs()
    ref = token_loss_sum(h @ w.t(), labels)
    ref_h, ref_w = _grads(ref, h, w)
    got = chunked_token_loss_sum(h, w, labels, 64, compiled=True, gradients_in_forward=in_forward)
    got_h, got_w = _grads(got, h, w)
    assert abs(float(got) - float(ref)) <= GRAD_RTOL * abs(float(ref))
    assert _rel(got_h, ref_h) <= GRAD_RTOL and _rel(got_w, ref_w) <= GRAD_RTOL
    assert not got_h[0, :10].any() and not got_h[2, -3:].any()


@BOTH_BACKWARDS
def test_all_labels_ignored_gives_zero_loss_and_gradient(in_forward: bool) -> None:
    h, w, labels = _head_inputs()
    labels[:] = IGNORE_INDEX
    loss = chunked_token_loss_sum(h, w, labels, 16, gradients_in_forward=in_forward)
    gh, gw = _grads(loss, h, w)
    assert float(loss) == 0.0 and not gh.any() and not gw.any()


@BOTH_BACKWARDS
def test_the_loss_scales_with_its_upstream_gradient(in_forward: bool) -> None:
    """backward multiplies by the incoming gradient (the trainer's 1 / n_tokens and fp16 loss scale)."""
    h, w, labels = _head_inputs()
    g1 = _grads(chunked_token_loss_sum(h, w, labels, 32, gradients_in_forward=in_forward), h, w)
    g2 = _grads(chunked_token_loss_sum(h, w, labels, 32, gradients_in_forward=in_forward) * 0.125 * 1024.0, h, w)
    for a, b in zip(g1, g2):
        assert _rel(b, a * 128.0) <= 1e-6


@pytest.mark.parametrize("chunk", [1, 7, 64, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_per_row_sums_and_their_gradients_equal_the_plain_per_row_losses(chunk: int, dtype: torch.dtype) -> None:
    """per_row (preference tuning): each row's sum, and in backward each token's gradient scaled by its
    row's upstream gradient (here a different weight per row, as DPO's are); against torch's cross-entropy
    per token on the whole logits, summed per row. A chunk that spans rows (7, 64) scales token by token."""
    h, w, labels = _head_inputs(dtype=dtype)
    weights = torch.tensor([0.5, -2.0, 3.0])
    ref = torch.nn.functional.cross_entropy((h @ w.t()).float().flatten(0, 1), labels.flatten(),
                                            reduction="none").view(3, -1).sum(dim=1)
    ref_h, ref_w = _grads((ref * weights).sum() / 50.0, h, w)
    got = chunked_token_loss_sum(h, w, labels, chunk, per_row=True)
    got_h, got_w = _grads((got * weights).sum() / 50.0, h, w)
    assert got.shape == (3,) and got.dtype == torch.float32
    assert torch.allclose(got, ref, rtol=LOSS_RTOL, atol=0)
    # fp16: the weight's gradient accumulates chunk by chunk in fp16 (1.8e-3 relative measured with chunks of 1)
    bar_h, bar_w = (GRAD_RTOL, GRAD_RTOL) if dtype == torch.float32 else (1e-4, 5e-3)
    assert _rel(got_h, ref_h) <= bar_h and _rel(got_w, ref_w) <= bar_w, (_rel(got_h, ref_h), _rel(got_w, ref_w))
    assert not got_h[0, :10].any() and not got_h[2, -3:].any()


def test_16_bit_weights_give_the_plain_loss_and_close_gradients() -> None:
    """bf16 / fp16 weights (precision O2/O3): the logits are computed and upcast as the plain path
    does, so the loss is the plain one. The gradients: bf16 scales them by the upstream gradient after
    their rounding to 16 bits (one rounding more than the plain path for the hidden states', measured
    3.2e-3 relative, as in Liger; the weight's accumulates chunk by chunk in bf16, measured 3.9e-3);
    fp16 always recomputes and scales each chunk before its cast, where small values would underflow
    (measured 5e-6 and 4e-4 relative)."""
    for dtype, bar_h, bar_w in ((torch.bfloat16, 5e-3, 1e-2), (torch.float16, 1e-5, 1e-3)):
        for in_forward in (True, False):
            h, w, labels = _head_inputs(dtype=dtype)
            ref = token_loss_sum(h @ w.t(), labels)
            ref_h, ref_w = _grads(ref / 50.0, h, w)
            got = chunked_token_loss_sum(h, w, labels, 64, gradients_in_forward=in_forward)
            got_h, got_w = _grads(got / 50.0, h, w)
            assert got.dtype == torch.float32
            assert abs(float(got) - float(ref)) <= LOSS_RTOL * abs(float(ref)), dtype
            assert got_h.dtype == dtype and _rel(got_h, ref_h) <= bar_h, (dtype, in_forward, _rel(got_h, ref_h))
            assert got_w.dtype == dtype and _rel(got_w, ref_w) <= bar_w, (dtype, in_forward, _rel(got_w, ref_w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_backwards_give_the_same_gradients_bit_for_bit(dtype: torch.dtype) -> None:
    """Recomputing the logits in backward (pipelines, tensor parallelism) makes each chunk's softmax and
    scales the gradients exactly as making them in forward does, so a pipeline's head computes what one
    device's does, to the bit; the same loss too."""
    h, w, labels = _head_inputs(dtype=dtype)
    results = []
    for in_forward in (True, False):
        loss = chunked_token_loss_sum(h, w, labels, 64, gradients_in_forward=in_forward)
        results.append([loss.detach(), *_grads(loss / 37.0, h, w)])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@BOTH_BACKWARDS
def test_under_autocast_the_loss_computes_like_the_autocast_matmul(in_forward: bool) -> None:
    """Precision O1: fp32 weights and hidden states, cast to bf16 as autocast's matmul would; the
    gradients come back in fp32."""
    h, w, labels = _head_inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = token_loss_sum(torch.nn.functional.linear(h, w), labels)
        got = chunked_token_loss_sum(h, w, labels, 64, gradients_in_forward=in_forward)
    ref_h, ref_w = _grads(ref, h, w)
    got_h, got_w = _grads(got, h, w)
    assert abs(float(got) - float(ref)) <= LOSS_RTOL * abs(float(ref))
    assert got_h.dtype == got_w.dtype == torch.float32
    assert _rel(got_h, ref_h) <= 1e-2 and _rel(got_w, ref_w) <= 1e-2


class _MatmulFlops(TorchDispatchMode):
    """2 x m x k x n of every mm, addmm and in-place addmm_ (torch's FlopCounterMode skips addmm_)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, D105
        packet = func.overloadpacket
        if packet is torch.ops.aten.mm:
            a, b = args[0], args[1]
        elif packet in (torch.ops.aten.addmm, torch.ops.aten.addmm_):
            a, b = args[1], args[2]
        else:
            a = None
        if a is not None:
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return func(*args, **(kwargs or {}))


def _head_flops(in_forward: bool, dtype: torch.dtype = torch.float32, weight_trains: bool = True) -> int:
    h, w, labels = _head_inputs(dtype=dtype)
    w.requires_grad_(weight_trains)
    with _MatmulFlops() as counter:
        chunked_token_loss_sum(h, w, labels, 64, gradients_in_forward=in_forward).backward()
    return counter.flops


def test_gradients_in_forward_run_three_matmuls_of_the_head_not_four() -> None:
    """Made in forward, the gradients need no second logits matmul: 6 x tokens x hidden x vocab FLOPs
    for the forward and backward together, against 8 when backward recomputes the logits; fp16 keeps
    recomputing; a frozen weight (LoRA) needs one matmul less either way."""
    h, w, _ = _head_inputs()
    n, hidden, vocab = h.shape[0] * h.shape[1], h.shape[2], w.shape[0]
    head = 2 * n * hidden * vocab
    assert _head_flops(in_forward=True) == 3 * head
    assert _head_flops(in_forward=False) == 4 * head
    assert _head_flops(in_forward=True, dtype=torch.float16) == 4 * head
    assert _head_flops(in_forward=True, weight_trains=False) == 2 * head


def test_gradients_in_forward_are_handed_over_once_and_not_kept() -> None:
    """The loss's node drops its gradients in backward (a loss kept for logging holds no [vocab, hidden]
    buffer afterwards); a second backward says why it cannot run. Under no_grad nothing is made."""
    h, w, labels = _head_inputs()
    loss = chunked_token_loss_sum(h, w, labels, 64)
    assert [g.shape for g in loss.grad_fn.gradients] == [h.reshape(-1, h.shape[-1]).shape, w.shape]
    loss.backward(retain_graph=True)
    assert loss.grad_fn.gradients is None
    with pytest.raises(RuntimeError, match="once"):
        loss.backward()
    with torch.no_grad():
        assert chunked_token_loss_sum(h, w, labels, 64).grad_fn is None


def test_a_frozen_weight_gets_no_gradient_and_the_hidden_states_the_plain_one() -> None:
    h, w, labels = _head_inputs()
    w.requires_grad_(False)
    ref_h, = _grads(token_loss_sum(h @ w.t(), labels), h)
    loss = chunked_token_loss_sum(h, w, labels, 64)
    assert loss.grad_fn.gradients[1] is None
    got_h, = _grads(loss, h)
    assert _rel(got_h, ref_h) <= GRAD_RTOL


def test_a_bad_chunk_size_is_refused() -> None:
    h, w, labels = _head_inputs()
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_token_loss_sum(h, w, labels, 0)


# --- through the model ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "gpt2_tied"])
def test_the_model_with_labels_returns_the_plain_loss_sum(name: str) -> None:
    """Transformer.forward(tokens, labels=...) is token_loss_sum(forward(tokens), labels), with the
    same gradient for every parameter (GPT-2's tied embedding matrix included), chunk by chunk."""
    cfg = tiny_config() if name == "llama" else ModelConfig(**{**get_preset("tiny_gpt2"), "vocab_size": 64})
    assert (name == "gpt2_tied") == cfg.tie_embeddings
    torch.manual_seed(0)
    plain = build_model(cfg)
    chunked = copy.deepcopy(plain)
    chunked.tie_weights()
    for mb in make_steps(2, vocab=cfg.vocab_size)[0] + make_steps(1, vocab=cfg.vocab_size, seed=5)[0]:
        ref = token_loss_sum(plain(mb["input_ids"]), mb["labels"])
        got = chunked(mb["input_ids"], labels=mb["labels"], loss_chunk_tokens=5)
        assert abs(float(got) - float(ref)) <= LOSS_RTOL * abs(float(ref))
        ref.backward()
        got.backward()
    assert_tensors_close({n: p.grad for n, p in chunked.named_parameters()},
                         {n: p.grad for n, p in plain.named_parameters()}, label=name)
    with torch.no_grad():  # evaluation: the loss only, nothing kept for a backward
        mb = make_steps(1, vocab=cfg.vocab_size)[0][0]
        assert float(chunked(mb["input_ids"], labels=mb["labels"])) == pytest.approx(
            float(token_loss_sum(plain(mb["input_ids"]), mb["labels"])), rel=LOSS_RTOL)


# --- the logits are never held -----------------------------------------------------------------------

# A vocabulary-dominated model: its logits [B*T, V] dwarf everything else of a step.
VOCAB_HEAVY = dict(vocab_size=4096, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                   intermediate_size=64, max_position_embeddings=128)
ROWS, SEQ, CHUNK = 4, 128, 64


class _LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, D105
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _step(model: torch.nn.Module, batch: dict[str, torch.Tensor], chunked: bool) -> None:
    if chunked:
        loss = model(batch["input_ids"], labels=batch["labels"], loss_chunk_tokens=CHUNK)
    else:
        loss = token_loss_sum(model(batch["input_ids"]), batch["labels"])
    loss.backward()


def test_no_tensor_of_tokens_times_vocab_is_ever_made() -> None:
    cfg = ModelConfig(**VOCAB_HEAVY)
    torch.manual_seed(0)
    model = build_model(cfg)
    batch = make_steps(1, batch=ROWS, seq=SEQ, vocab=cfg.vocab_size)[0][0]
    n, v = ROWS * SEQ, cfg.vocab_size
    seen = {}
    for chunked in (False, True):
        with _LargestTensor() as mode:
            _step(model, batch, chunked)
        seen[chunked] = mode.largest
    assert seen[False] >= n * v  # the plain path holds the logits (the check can fail)
    assert seen[True] == CHUNK * v  # one chunk's block is the largest tensor of the step


def test_the_peak_of_a_step_drops_by_the_logits_and_their_gradients() -> None:
    """Measured exactly (MemoryTracker): the plain path's backward holds the fp32 log-softmax and
    two fp32 [N, V] gradients at once; the chunked one one [chunk, V] block, the output weight's
    gradient and the hidden states' (plus every token's log-sum-exp)."""
    cfg = ModelConfig(**VOCAB_HEAVY)
    torch.manual_seed(0)
    batch = make_steps(1, batch=ROWS, seq=SEQ, vocab=cfg.vocab_size)[0][0]
    n, v, h = ROWS * SEQ, cfg.vocab_size, cfg.hidden_size
    peaks = {}
    for chunked in (False, True):
        model = build_model(cfg)
        with MemoryTracker() as tracker:
            tracker.track_existing(list(model.parameters()))
            tracker.start_recording()
            _step(model, batch, chunked)
        peaks[chunked] = tracker.peak
    drop = peaks[False] - peaks[True]
    expected = 3 * n * v * 4 - (CHUNK * v * 4 + v * h * 4 + n * h * 4 + n * 4)
    assert drop >= 0.99 * expected, (peaks, drop, expected)
    assert peaks[True] < peaks[False] / 4
