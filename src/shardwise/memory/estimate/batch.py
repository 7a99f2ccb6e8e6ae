"""The step's input data: the token batches on the device (`batch_bytes`), and what packed documents
bring: an explicit [B, 1, T, T] attention mask where flex attention does not run (`document_mask`),
position ids that restart at each document (`document_positions`)."""

from __future__ import annotations

from typing import Any

from .layout import Layout


def document_mask(cfg: Any, device: str) -> bool:
    """Whether attention gets an explicit [B, 1, T, T] mask (packed documents without flex attention)."""
    if cfg.data.kind == "preference" or (cfg.data.kind != "pretrain" and cfg.data.packing == "pad"):
        return False
    documents = cfg.data.reset_attention_mask and bool(cfg.data.train_files)
    if not documents:
        return False
    flex = device == "cuda" and cfg.model.use_flash_attention and not cfg.model.dropout
    return not flex


def document_positions(cfg: Any) -> bool:
    """Whether batches carry position ids that restart at each document (packed data, not preference pairs)."""
    return cfg.data.reset_position_ids and bool(cfg.data.train_files) and cfg.data.kind != "preference"


def batch_bytes(cfg: Any, lay: Layout, device: str) -> int:
    """The step's token batches (int64): input ids and labels, document and position ids when present;
    under a pipeline also each pipeline step's concatenation of its micro-batches."""
    keys = 4 if document_positions(cfg) or document_mask(cfg, "cpu") else 2
    rows = lay.micro_batch
    if device == "cpu":
        total = lay.accumulation * rows * (lay.seq + 1) * 8  # the loader hands over the whole step at once
        total += lay.accumulation * rows * lay.seq * 8 * (keys - 2)
    else:
        total = rows * lay.seq * 8 * keys  # one micro-batch copied to the device
    if lay.pp > 1:
        total += lay.micro_batch_num * rows * lay.seq * 8 * keys
    return total
