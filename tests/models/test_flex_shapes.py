"""Compiled flex attention over changing batch shapes: few compiles, the explicit mask's results.

On this CPU torch 2.13 has no flex backward, and an inductor compile of flex costs ~20 s a shape, so
the compiles are counted with a backend that runs dynamo's graph as it is (the guards and so the
recompiles are dynamo's; measured by hand, inductor compiled the same number of graphs for these
shapes). bench/gpu_checks.sh runs the inductor kernels, backward included.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.torch_version import TorchVersion

from shardwise.models import ModelConfig, build_model
from shardwise.models.attention import document_mask, flex_available, flex_kernels

pytestmark = pytest.mark.skipif(not flex_available(), reason="this torch build has no flex attention")

HEADS, KV_HEADS, HEAD_DIM = 2, 1, 8
BUDGET = 384  # tokens a dynamic SFT batch holds: rows x width
# Widths of dynamic SFT batches rounded to multiples of 64, rows = BUDGET // width, in the order a
# shuffled loader meets them, and a short last batch of fewer rows (as evaluation ends).
SHAPES = [(BUDGET // w, w) for w in (192, 64, 320, 128, 256, 384, 192, 128)] + [(2, 320), (1, 64)]
MAX_GRAPHS = 3  # per compiled function
# torch 2.11 also specialises two sizes inside create_block_mask's dense-to-block conversion: a batch of one
# row and a width of one flex block (guards `size(0) == 1` and `(width + 127) // 128 == 1`). The mask builder
# then compiles one graph per combination after its static first one, five at most, however many shapes
# follow. torch 2.13 (the pinned version) needs none of these.
MAX_MASK_GRAPHS = MAX_GRAPHS if TorchVersion(torch.__version__) >= (2, 13) else 5


class CountingBackend:
    """A torch.compile backend that counts the graphs it is given, by function, and runs them as traced."""

    def __init__(self) -> None:
        self.graphs = {"mask": 0, "flex": 0}

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs["flex" if "flex_attention" in gm.code else "mask"] += 1
        return gm.forward


def documents(rows: int, width: int, seed: int) -> torch.Tensor:
    """document_ids [rows, width]: each row one sample and its padding (a document of its own)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(width // 2, width + 1, (rows,), generator=gen)
    return (torch.arange(width)[None, :] >= lengths[:, None]).long()


def test_changing_batch_shapes_compile_a_bounded_number_of_times() -> None:
    backend = CountingBackend()
    build, flex = flex_kernels(backend)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # no flex backward on the CPU
        for k, (rows, width) in enumerate(SHAPES):
            doc = documents(rows, width, k)
            q = torch.randn(rows, HEADS, width, HEAD_DIM, generator=gen)
            kv = torch.randn(2, rows, KV_HEADS, width, HEAD_DIM, generator=gen)
            out = flex(q, kv[0], kv[1], block_mask=build(doc), enable_gqa=True)
            reference = F.scaled_dot_product_attention(q, kv[0].repeat_interleave(HEADS // KV_HEADS, 1),
                                                       kv[1].repeat_interleave(HEADS // KV_HEADS, 1),
                                                       attn_mask=document_mask(doc))
            torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
    assert len(set(SHAPES)) >= 8
    assert 1 <= backend.graphs["mask"] <= MAX_MASK_GRAPHS and 1 <= backend.graphs["flex"] <= MAX_GRAPHS, backend.graphs


def test_compiled_blocks_with_flex_inside_compile_a_bounded_number_of_times() -> None:
    """run.compile compiles each block, flex attention traced inside it (Transformer.forward's flex_shapes)."""
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48,
                      max_position_embeddings=BUDGET)
    torch.manual_seed(0)
    model = build_model(cfg, device="cpu").eval()
    backend = CountingBackend()
    for block in model.layers.values():
        block.compile(backend=backend)  # as parallelize.compile_blocks does, with the counting backend
    shapes = [(2, 192), (6, 64), (1, 320), (3, 128), (1, 384), (2, 320)]
    with torch.no_grad():
        for k, (rows, width) in enumerate(shapes):
            doc = documents(rows, width, k)
            ids = torch.randint(0, cfg.vocab_size, (rows, width), generator=torch.Generator().manual_seed(k))
            model.document_attention = "flex"
            flex = model(ids, document_ids=doc)
            model.document_attention = "mask"
            explicit = model(ids, document_ids=doc)
            torch.testing.assert_close(flex, explicit, atol=1e-5, rtol=1e-5)
    # One block graph serves both blocks; the explicit-mask calls compile graphs of their own (counted as "mask").
    assert 1 <= backend.graphs["flex"] <= MAX_GRAPHS, backend.graphs
