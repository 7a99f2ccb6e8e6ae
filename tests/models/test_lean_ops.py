"""models/lean_ops: the norm, the gated activation and RoPE give the op-by-op results and save no more."""

import pytest
import torch
import torch.nn.functional as F

from shardwise.models.lean_ops import gated_activation, rms_norm, rotary

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


def plain_rope(x, cos, sin):
    """Hugging Face LLaMA's apply_rotary_pos_emb for one tensor."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_tables(batch, seq, dim, dtype):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    pos = torch.randint(0, 4 * seq, (batch, seq)).float()  # packed documents: positions per row
    emb = torch.cat((pos[..., None] * inv, pos[..., None] * inv), dim=-1)
    return emb.cos()[:, :, None].to(dtype), emb.sin()[:, :, None].to(dtype)


@pytest.mark.parametrize("dtype,table_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.bfloat16, torch.float32)])  # the last: autocast's mix
def test_rotary_is_the_op_by_op_rope_forward_bitwise_and_backward_to_rounding(dtype, table_dtype):
    x, = leaves(((2, 9, 4, 16), dtype))
    x2 = x.detach().clone().requires_grad_()
    cos, sin = rope_tables(2, 9, 16, table_dtype)
    out = rotary(x, cos, sin)
    ref = plain_rope(x2, cos, sin)
    assert out.dtype == ref.dtype and torch.equal(out, ref)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    assert x.grad.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.linalg.vector_norm((x.grad - x2.grad).float()) <= tol * torch.linalg.vector_norm(x2.grad.float())


def test_rotary_gradient_is_the_rotation_transposed():
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64, requires_grad=True)
    cos, sin = rope_tables(2, 5, 8, torch.float64)
    assert torch.autograd.gradcheck(lambda t: rotary(t, cos, sin), (x,))


def test_rotary_saves_only_the_tables():
    x, = leaves(((2, 9, 4, 16), torch.float32))
    cos, sin = rope_tables(2, 9, 16, torch.float32)
    _, lean = saved_bytes(lambda a: rotary(a, cos, sin), x)
    _, plain = saved_bytes(lambda a: plain_rope(a, cos, sin), x)
    assert lean == plain == 2 * cos.numel() * 4
