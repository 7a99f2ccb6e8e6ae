"""Weighted mixtures of pre-training sources (data.sources): the blend against the maths at every prefix,
schedules, per-source epochs, the read position across resumes, rank counts and weight changes, the run's
tokens_by_source, and bad sources stopped before any work."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shardwise.config import DataConfig
from shardwise.data.build import build_data, check_data_files
from shardwise.data.loader import StatefulLoader
from shardwise.data.mixture import Mixture, MixtureDataset
from shardwise.data.packing import PackedDataset
from shardwise.errors import DataError
from shardwise.report import write_report
from shardwise.report.plots import source_shares
from shardwise.report.runs import read_run
from shardwise.train.trainer import Trainer

from ..train.conftest import read_metrics, tiny_config, with_changes
from .conftest import write_corpus


@pytest.mark.parametrize("seed", range(6))
def test_every_prefix_of_the_stream_follows_the_weights(seed: int) -> None:
    """After any p positions each source s has had w_s x p samples within 1/2 + w_s x S / 2 (S sources: the
    bound of the ideal-time merge), and counts, windows and the whole stream agree."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 6))
    weights = rng.random(n) + 0.01
    mixture = Mixture([f"s{i}" for i in range(n)], list(rng.integers(1, 300, n)), seed, [(0, list(weights))])
    src, nth = mixture.sources(0, 4000)
    shares = weights / weights.sum()
    seen = np.cumsum(np.eye(n, dtype=np.int64)[src], axis=0)  # [p, source]: samples after p + 1 positions
    assert (np.abs(seen - np.outer(np.arange(1, 4001), shares)) <= 0.5 + shares * n / 2 + 1e-9).all()
    for p in (0, 1, 17, 999, 4000):
        assert (mixture.counts(p) == np.bincount(src[:p], minlength=n)).all()
    a, _ = mixture.sources(123, 2000)
    b, _ = mixture.sources(2000, 3001)
    assert (np.concatenate([a, b]) == src[123:3001]).all()
    for s in range(n):  # each source's samples numbered in order
        assert (nth[src == s] == np.arange((src == s).sum())).all()


def test_a_schedule_changes_the_weights_from_its_step_and_sources_repeat_or_are_read_in_part() -> None:
    mixture = Mixture(["books", "web"], [10, 1000], 3, [(0, [1, 1]), (100, [1, 3]), (300, [0, 1])])
    src, _ = mixture.sources(0, 400)
    assert np.bincount(src[:100]).tolist() == [50, 50]
    assert np.bincount(src[100:300]).tolist() == [50, 150]
    assert np.bincount(src[300:], minlength=2).tolist() == [0, 100]  # weight 0: none
    assert mixture.counts(400).tolist() == [100, 300]
    assert mixture.epochs(400) == {"books": 10.0, "web": 0.3}
    indices = mixture.indices(0, 400)
    books = indices[src == 0]
    for epoch in range(10):  # each of the small source's epochs reads all its samples once, in a new order
        assert sorted(books[epoch * 10:(epoch + 1) * 10]) == list(range(10))
    assert not all((books[e * 10:(e + 1) * 10] == books[:10]).all() for e in range(1, 10))
    web = indices[src == 1] - 10
    assert len(set(web.tolist())) == 300  # 300 of the large source's 1000, none twice


def _mixture_dataset(schedule: list = ()) -> MixtureDataset:
    small = PackedDataset(np.arange(41) % 50, 4)  # 10 samples, tokens 0..40
    large = PackedDataset(np.arange(1000, 1401), 4)  # 100 samples, tokens 1000..1400
    return MixtureDataset(["small", "large"], [small, large], [1, 3], schedule=schedule)


def _firsts(batches: list[dict]) -> list[int]:
    return [int(t) for b in batches for t in b["input_ids"][:, 0]]


def _global_steps(loader_args: list[tuple[int, int, int]], steps: int, ds: MixtureDataset, state=None):  # noqa: ANN001
    """The first tokens of every sample each step reads, over all ranks (rank order), and the end state."""
    loaders = [StatefulLoader(ds, mbs, accum, seed=5, dp_rank=r, dp_size=dp) for mbs, accum, dp in loader_args
               for r in range(dp)]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    out = []
    for _ in range(steps):
        out.append(sorted(t for loader in loaders for t in _firsts(loader.next_step())))
    return out, loaders[0].state_dict()


def test_the_read_position_survives_resume_on_other_ranks_and_a_weight_change() -> None:
    ds = _mixture_dataset(schedule=[(3, [3, 1])])
    whole, _ = _global_steps([(2, 2, 2)], 8, ds)  # 8 samples a step, over two ranks
    first, state = _global_steps([(2, 2, 2)], 4, ds)
    # steps 1-2 at 1:3, then from the schedule's step 3 on 3:1
    assert state["sources"] == {"small": {"read": 16, "samples": 10}, "large": {"read": 16, "samples": 100}}
    rest, _ = _global_steps([(4, 1, 2)], 4, ds, state)  # resumed on another split of the same global batch
    assert first + rest == whole
    one_rank, _ = _global_steps([(8, 1, 1)], 4, ds, state)
    assert one_rank == rest
    # Resumed with other weights: the blend continues from each source's position, reading nothing twice
    # that the first part read in the same source epoch.
    changed = MixtureDataset(ds.names, ds.datasets, [1, 1])
    after, end = _global_steps([(2, 2, 2)], 4, changed, state)
    assert end["sources"]["small"]["read"] + end["sources"]["large"]["read"] == 64
    assert end["sources"]["small"]["read"] - 16 == end["sources"]["large"]["read"] - 16 == 16


def test_a_run_logs_tokens_by_source_and_resumes_its_mixture(tmp_path: Path) -> None:
    web, books = write_corpus(tmp_path / "web", 3, 80), write_corpus(tmp_path / "books", 2, 40)
    sources = [{"name": "web", "train_files": web, "weight": 3.0}, {"name": "books", "train_files": books,
                                                                   "weight": 1.0}]
    base = tiny_config(tmp_path, max_steps=6, micro_batch_size=2, decay_style="constant")  # a shorter run: same lr
    data = {"train_files": [], "sources": sources, "cache_dir": str(tmp_path / "cache"),
            "mixture_schedule": [{"step": 4, "weights": {"web": 1.0, "books": 1.0}}]}
    cfg = with_changes(base, data=data, model={"vocab_size": 300}, optimize={"gradient_accumulation_steps": 4})
    whole = Trainer(cfg).train().losses
    records = read_metrics(Path(cfg.train.output_dir))
    per_step = [r["tokens_by_source"] for r in records]
    seq = cfg.data.seq_length
    assert per_step[2] == {"web": 18 * seq, "books": 6 * seq}  # steps 1-3, 8 samples each, at 3:1
    assert per_step[5] == {"web": 30 * seq, "books": 18 * seq}  # then steps 4-6 at 1:1
    run = read_run(cfg.train.output_dir)
    assert any("a mixture of 2 sources" in note for note in run.notes)
    shares = source_shares(run)  # the report's mixture plot
    assert shares["web"][1] == [0.75] * 3 + [0.5] * 3 and shares["books"][0] == [1, 2, 3, 4, 5, 6]
    assert (write_report([cfg.train.output_dir], tmp_path / "report").parent / "mixture.png").is_file()
    half = with_changes(cfg, train={"output_dir": str(tmp_path / "half"), "max_steps": 3})
    Trainer(half).train()
    resumed = with_changes(cfg, train={"output_dir": str(tmp_path / "half"), "micro_batch_size": 1},
                           optimize={"gradient_accumulation_steps": 8})  # the same 8 samples a step
    rest = Trainer(resumed).train(resume="auto").losses
    assert sorted(rest) == [4, 5, 6] and all(rest[s] == pytest.approx(whole[s], rel=1e-5) for s in rest)


def test_evaluation_reports_each_sources_loss(tmp_path: Path) -> None:
    """Sources with held-out files: every evaluation record carries each one's loss, equal to the loss of
    that held-out set alone, and the overall loss lies between them."""
    web, books = write_corpus(tmp_path / "web", 3, 60), write_corpus(tmp_path / "books", 3, 30)
    sources = [{"name": "web", "train_files": web[:2], "eval_files": web[2:], "weight": 1.0},
               {"name": "books", "train_files": books[:2], "eval_files": books[2:], "weight": 1.0}]
    cfg = with_changes(tiny_config(tmp_path, max_steps=2, micro_batch_size=2, eval_steps=2),
                       data={"train_files": [], "sources": sources, "cache_dir": str(tmp_path / "cache")},
                       model={"vocab_size": 300})
    trainer = Trainer(cfg)
    trainer.train()
    record = [r for r in read_metrics(Path(cfg.train.output_dir)) if "eval_loss" in r][-1]
    by_source = record["eval_loss_by_source"]
    assert set(by_source) == {"web", "books"}
    assert min(by_source.values()) <= record["eval_loss"] <= max(by_source.values())
    held_out = trainer.eval_dataset
    trainer.eval_dataset = held_out["books"]  # that set alone, through the plain evaluation
    assert trainer.evaluate()["loss"] == pytest.approx(by_source["books"], rel=1e-6)


def test_bad_sources_stop_before_any_work_naming_the_source(tmp_path: Path) -> None:
    files = write_corpus(tmp_path / "ok", 1, 20)
    with pytest.raises(DataError, match=r"data.sources 'code': .*matches no file"):
        check_data_files(DataConfig(sources=[{"name": "web", "train_files": files, "weight": 1},
                                             {"name": "code", "train_files": [str(tmp_path / "none/*.txt")],
                                              "weight": 1}]))
    for sources, message in (
            ([{"name": "web", "train_files": files, "weight": -1}], "weight -1.0: a source's weight must be positive"),
            ([{"name": "web", "train_files": files, "weight": 1}] * 2, "two sources named 'web'")):
        with pytest.raises(ValueError, match=message):
            DataConfig(sources=sources)
    with pytest.raises(ValueError, match=r"mixture_schedule\[0\] \(step 5\): give a weight for every source"):
        DataConfig(sources=[{"name": "web", "train_files": files, "weight": 1}],
                   mixture_schedule=[{"step": 5, "weights": {"books": 1}}])
    with pytest.raises(ValueError, match="data.sources and data.train_files are both set"):
        DataConfig(train_files=files, sources=[{"name": "web", "train_files": files, "weight": 1}])


def test_a_prepared_source_of_another_tokenizer_is_named(tmp_path: Path, tiny_tokenizer_dir: Path,
                                                         corpus_files: list[str]) -> None:
    from shardwise.data import prepare_corpus
    from shardwise.data.tokenizer import load_tokenizer, train_bpe_tokenizer

    prepared = tmp_path / "prepared"
    prepare_corpus(corpus_files, load_tokenizer(tiny_tokenizer_dir), prepared)
    other = tmp_path / "other_tok"
    train_bpe_tokenizer(corpus_files[:1], 280, other)
    data = DataConfig(seq_length=16, tokenizer=str(other), cache_dir=str(tmp_path / "cache"),
                      sources=[{"name": "web", "train_files": corpus_files, "weight": 1},
                               {"name": "curated", "train_files": [str(prepared)], "weight": 1}])
    with pytest.raises(DataError, match=r"data.sources 'curated': .*tokenizer"):
        build_data(data, vocab_size=400)


def test_prefetch_thread_and_worker_processes_read_the_same_blend() -> None:
    ds = _mixture_dataset(schedule=[(3, [3, 1])])

    def steps(**kwargs: object) -> list[list[int]]:
        loader = StatefulLoader(ds, 2, 2, seed=3, dp_rank=1, dp_size=2, **kwargs)
        try:
            return [_firsts(loader.next_step()) for _ in range(6)]
        finally:
            loader.close()

    plain = steps()
    assert steps(prefetch=True) == plain and steps(num_workers=2) == plain
