"""Document masks: packed documents never see each other, on the explicit-mask and the flex path."""

import pytest
import torch

from shardwise.models import ModelConfig, build_model
from shardwise.models.attention import document_mask, flex_available

CFG = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=48, max_position_embeddings=64)
# Three documents of 5, 7 and 4 tokens packed into one 16-token sample.
LENGTHS = (5, 7, 4)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(CFG, device="cpu")
    model.eval()
    return model


def _packed(tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """document_ids and restarting position_ids for one sample made of LENGTHS."""
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(LENGTHS)])
    pos = torch.cat([torch.arange(n) for n in LENGTHS])
    return {"document_ids": doc[None], "position_ids": pos[None]}


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(seed))


def test_document_mask_is_causal_within_documents() -> None:
    mask = document_mask(torch.tensor([[0, 0, 1, 1, 1, 2]]))[0, 0]
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask, expected)


def test_changing_one_document_leaves_the_others_unchanged() -> None:
    model = _model()
    tokens = _tokens(1)
    changed = tokens.clone()
    changed[0, 5:12] = (changed[0, 5:12] + 7) % CFG.vocab_size  # rewrite the middle document only
    extras = _packed(tokens)
    with torch.no_grad():
        a, b = model(tokens, **extras), model(changed, **extras)
        # Without the document mask the later document does see the earlier ones (the test can fail).
        plain_a, plain_b = model(tokens), model(changed)
    others = torch.tensor([True] * 5 + [False] * 7 + [True] * 4)
    assert torch.equal(a[0, others], b[0, others])
    assert not torch.allclose(a[0, 5:12], b[0, 5:12])
    assert not torch.allclose(plain_a[0, 12:], plain_b[0, 12:])


def test_each_packed_document_equals_the_document_alone() -> None:
    model = _model()
    tokens = _tokens(2)
    with torch.no_grad():
        packed = model(tokens, **_packed(tokens))
        start = 0
        for n in LENGTHS:
            alone = model(tokens[:, start : start + n])
            torch.testing.assert_close(packed[:, start : start + n], alone, atol=1e-5, rtol=1e-5)
            start += n


@pytest.mark.skipif(not flex_available(), reason="this torch build has no flex attention")
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_block_mask_gives_the_same_logits_as_the_explicit_mask() -> None:
    model = _model()
    tokens = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    doc = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 10 + [1] * 6])
    pos = torch.stack([torch.cat([torch.arange(n) for n in lens]) for lens in ((5, 7, 4), (10, 6))])
    with torch.no_grad():
        model.document_attention = "mask"
        explicit = model(tokens, position_ids=pos, document_ids=doc)
        model.document_attention = "flex"  # forward only: flex has no backward on CPU
        flex = model(tokens, position_ids=pos, document_ids=doc)
    torch.testing.assert_close(flex, explicit, atol=1e-5, rtol=1e-5)


def test_auto_uses_the_explicit_mask_on_cpu() -> None:
    model = _model()
    model.train()
    tokens = _tokens(4)
    logits = model(tokens, **_packed(tokens))
    logits.sum().backward()  # the CPU path must be trainable
    assert model.tok_embeddings.weight.grad is not None


def test_document_ids_with_a_kv_cache_are_refused() -> None:
    from shardwise.models import KVCache

    model = _model()
    tokens = _tokens(5)
    with pytest.raises(ValueError, match="document_ids"):
        model(tokens, document_ids=torch.zeros_like(tokens), kv_cache=KVCache.for_model(model, 1))


def test_one_document_per_sample_takes_the_causal_path() -> None:
    model = _model()
    tokens = _tokens(6)
    with torch.no_grad():
        assert torch.equal(model(tokens, document_ids=torch.zeros_like(tokens)), model(tokens))
