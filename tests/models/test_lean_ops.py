"""models/lean_ops: the norm and the gated activation give the op-by-op results and save less."""

import pytest
import torch
import torch.nn.functional as F

from shardwise.models.lean_ops import gated_activation, rms_norm

ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


def plain_rms_norm(x, weight, eps):
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def saved_bytes(fn, *inputs, weight=None):
    """Bytes of the distinct storages autograd saves for backward while running fn(*inputs), the
    `weight` (a parameter, held anyway) left out."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    skip = weight.untyped_storage().data_ptr() if weight is not None else None
    return out, sum(n for ptr, n in seen.items() if ptr != skip)


def leaves(*shapes_dtypes, grads=None):
    torch.manual_seed(0)
    grads = grads or [True] * len(shapes_dtypes)
    return [torch.randn(*s, dtype=d).requires_grad_(g) for (s, d), g in zip(shapes_dtypes, grads)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grads", [(True, True), (True, False), (False, True)])
def test_rms_norm_matches_the_op_by_op_norm(dtype, grads):
    x, w = leaves(((3, 5, 64), dtype), ((64,), dtype), grads=list(grads))
    x2, w2 = (t.detach().clone().requires_grad_(t.requires_grad) for t in (x, w))
    out = rms_norm(x, w, 1e-6)
    ref = plain_rms_norm(x2, w2, 1e-6)
    assert torch.equal(out, ref)  # the forward bit for bit (Hugging Face logits)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    for a, b in ((x, x2), (w, w2)):
        if not a.requires_grad:
            continue
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        assert torch.linalg.vector_norm((a.grad - b.grad).float()) <= tol * torch.linalg.vector_norm(b.grad.float())


@pytest.mark.parametrize("activation", sorted(ACTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_activation_is_the_op_by_op_product_bitwise(activation, dtype):
    g, u = leaves(((4, 7, 96), dtype), ((4, 7, 96), dtype))
    g2, u2 = (t.detach().clone().requires_grad_() for t in (g, u))
    out = gated_activation(g, u, activation)
    ref = ACTS[activation](g2) * u2
    assert torch.equal(out, ref)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    assert torch.equal(g.grad, g2.grad)  # the same aten backward ops in the same order
    assert torch.equal(u.grad, u2.grad)


def test_they_save_less_than_the_op_by_op_versions():
    bt, h, f = 64, 128, 352
    x, w = leaves(((bt, h), torch.float32), ((h,), torch.float32))
    _, lean = saved_bytes(lambda a, b: rms_norm(a, b, 1e-6), x, w, weight=w)
    _, plain = saved_bytes(lambda a, b: plain_rms_norm(a, b, 1e-6), x, w, weight=w)
    assert lean == bt * h * 4 + bt * 4  # the input and the rsqrt
    assert plain == lean + bt * h * 4  # plus the normalised input for the weight's gradient
    xb, wb = (t.detach().to(torch.bfloat16).requires_grad_() for t in (x, w))
    _, lean16 = saved_bytes(lambda a, b: rms_norm(a, b, 1e-6), xb, wb, weight=wb)
    _, plain16 = saved_bytes(lambda a, b: plain_rms_norm(a, b, 1e-6), xb, wb, weight=wb)
    assert lean16 == bt * h * 2 + bt * 4
    assert plain16 == bt * h * 4 + bt * 4 + bt * h * 2  # the fp32 copy of the input, rsqrt, normalised

    g, u = leaves(((bt, f), torch.float32), ((bt, f), torch.float32))
    _, lean = saved_bytes(lambda a, b: gated_activation(a, b, "silu"), g, u)
    _, plain = saved_bytes(lambda a, b: F.silu(a) * b, g, u)
    assert lean == 2 * bt * f * 4
    assert plain == 3 * bt * f * 4
