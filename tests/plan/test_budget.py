"""Budget planning: Hoffmann et al. 2022's compute-optimal sizing, Muennighoff et al. 2023's repeated data,
and `shardwise plan --budget-hours/--budget-flops/--tokens` against the planner's own throughput."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from shardwise.cli import main
from shardwise.config import validate
from shardwise.errors import ConfigError
from shardwise.hardware import get_hardware
from shardwise.models import ModelConfig, count_parameters
from shardwise.plan import PlanRequest, plan, workload_config
from shardwise.plan.budget import (
    EXTRAPOLATION_WARNING,
    HOFFMANN_2022,
    R_STAR,
    check_budget,
    constrained_loss,
    constrained_optimum,
    default_global_batch,
    effective_params,
    effective_tokens,
    family_model,
    isoflop_curve,
    plan_budget,
    rule_of_20,
    size_budget,
)

GOPHER_FLOPS = 5.76e23  # Gopher's and Chinchilla's budget (Hoffmann et al. 2022, Table 3)


def brute_force_optimum(flops: float, unique: float | None = None) -> float:
    """N minimising the loss on 6 N D = flops by a fine log grid (no closed form, no golden section)."""
    grid = [10 ** (6 + 8 * i / 40000) for i in range(40001)]  # 1e6 .. 1e14, 0.02% steps
    return min(grid, key=lambda n: constrained_loss(HOFFMANN_2022, n, flops, unique))


@pytest.mark.parametrize("flops", [1e18, 1e21, GOPHER_FLOPS, 1e26])
def test_the_optimum_spends_the_budget_and_minimises_the_loss(flops: float) -> None:
    n, d = HOFFMANN_2022.optimum(flops)
    assert 6 * n * d == pytest.approx(flops, rel=1e-12)
    assert n == pytest.approx(brute_force_optimum(flops), rel=1e-3)


@pytest.mark.parametrize("flops", [1e19, GOPHER_FLOPS])
def test_the_optimum_meets_the_lagrange_condition(flops: float) -> None:
    """On 6 N D = C the minimum has alpha A / N^alpha = beta B / D^beta (d/dN of A N^-a + B (C/6N)^-b = 0),
    written from the fit's form, not from the closed-form solution; and it beats its neighbours on the curve."""
    n, d = HOFFMANN_2022.optimum(flops)
    assert 0.34 * 406.4 / n ** 0.34 == pytest.approx(0.28 * 410.7 / d ** 0.28, rel=1e-9)
    for step in (0.99, 1.01):
        assert HOFFMANN_2022.loss(n * step, d / step) > HOFFMANN_2022.loss(n, d)


def test_gopher_budget_against_the_paper() -> None:
    """Approach 3 with the published (rounded) constants: ~32B parameters on ~3.0T tokens at Gopher's budget,
    fewer parameters than Approach 1's 67B and Chinchilla's 70B (the rounding biases it: Besiroglu et al.
    2024); the 20-tokens-per-parameter rule gives Chinchilla's 70B on 1.4T."""
    n, d = HOFFMANN_2022.optimum(GOPHER_FLOPS)
    assert n == pytest.approx(32.19e9, rel=2e-3) and d == pytest.approx(2.982e12, rel=2e-3)
    assert 25e9 < n < 45e9
    n20, d20 = rule_of_20(GOPHER_FLOPS)
    assert n20 == pytest.approx(70e9, rel=0.02) and d20 == pytest.approx(1.4e12, rel=0.02)
    # The exponents: N_opt ~ C^0.452, D_opt ~ C^0.548 (the paper's Table 2 gives 0.46 / 0.54 from unrounded fits).
    n2, d2 = HOFFMANN_2022.optimum(10 * GOPHER_FLOPS)
    assert math.log10(n2 / n) == pytest.approx(0.28 / 0.62, abs=1e-9)
    assert math.log10(d2 / d) == pytest.approx(0.34 / 0.62, abs=1e-9)
    assert abs(math.log10(n2 / n) - 0.46) < 0.01 and abs(math.log10(d2 / d) - 0.54) < 0.01
    # Chinchilla's predicted loss by the fit: 1.69 + 406.4 / 70e9^0.34 + 410.7 / 1.4e12^0.28
    assert HOFFMANN_2022.loss(70e9, 1.4e12) == pytest.approx(1.9366, abs=1e-4)


def test_tokens_per_parameter_grow_with_the_budget() -> None:
    ratios = [d / n for n, d in (HOFFMANN_2022.optimum(c) for c in (1e19, 1e21, 1e23, 1e25))]
    assert ratios == sorted(ratios)
    assert ratios[-1] / ratios[0] == pytest.approx(1e6 ** ((0.34 - 0.28) / 0.62), rel=1e-9)


def test_flops_for_tokens_inverts_d_opt() -> None:
    flops = HOFFMANN_2022.flops_for_tokens(2e11)
    assert HOFFMANN_2022.optimum(flops)[1] == pytest.approx(2e11, rel=1e-12)


def test_repeated_tokens_lose_value() -> None:
    """Muennighoff et al. 2023, eq. 5: D' = U + U R* (1 - exp(-(D/U - 1) / R*)), R* = 15.4."""
    u = 1e10
    assert effective_tokens(0.5 * u, u) == 0.5 * u and effective_tokens(u, u) == u
    four = effective_tokens(4 * u, u)
    assert four == pytest.approx(u * (1 + 15.4 * (1 - math.exp(-3 / 15.4))), rel=1e-12)
    assert 0.9 < four / (4 * u) < 0.95  # four epochs are worth ~93% of fresh data: "little loss"
    assert effective_tokens(1e4 * u, u) == pytest.approx(u * (1 + R_STAR), rel=1e-6)  # the ceiling
    assert effective_tokens(4 * u, None) == 4 * u


def muennighoff_loss(n: float, flops: float, unique: float) -> float:
    """Muennighoff et al. 2023, eqs. 5-6, written out here: L(N', D') with the Hoffmann constants, D = C / 6N,
    R_D = D/U - 1, U_N = min(N, N_opt of the budget whose D_opt is U), R_N = N/U_N - 1, R_D* 15.4, R_N* 5.3."""
    d = flops / (6 * n)
    g = (0.34 * 406.4 / (0.28 * 410.7)) ** (1 / 0.62)
    u_n = min(n, g * (g * unique) ** (0.28 / 0.34))  # N_opt = G (C/6)^(b/(a+b)) with (C/6) = (G U)^(0.62/0.34)
    d_eff = d if d <= unique else unique + unique * 15.4 * (1 - math.exp(-(d / unique - 1) / 15.4))
    n_eff = u_n + u_n * 5.3 * (1 - math.exp(-(n / u_n - 1) / 5.3))
    return 1.69 + 406.4 / n_eff ** 0.34 + 410.7 / d_eff ** 0.28


def test_excess_parameters_lose_value() -> None:
    """Muennighoff et al.'s eq. 6: parameters beyond U_N (the fit's optimum for one pass over U) count at a value
    decaying with R_N* = 5.3, so with scarce data the spare compute goes mostly into epochs."""
    u = 1e9
    u_n = HOFFMANN_2022.optimum(HOFFMANN_2022.flops_for_tokens(u))[0]
    assert effective_params(0.5 * u_n, u, HOFFMANN_2022) == pytest.approx(0.5 * u_n, rel=1e-12)
    assert effective_params(3 * u_n, u, HOFFMANN_2022) == pytest.approx(u_n * (1 + 5.3 * (1 - math.exp(-2 / 5.3))))
    assert effective_params(3 * u_n, None, HOFFMANN_2022) == 3 * u_n
    flops = 1e22
    d_opt = HOFFMANN_2022.optimum(flops)[1]
    for n in (1e9, 1e10, 1e11):
        assert constrained_loss(HOFFMANN_2022, n, flops, d_opt / 10) == pytest.approx(
            muennighoff_loss(n, flops, d_opt / 10), rel=1e-12)


def test_scarce_data_buys_epochs_not_parameters() -> None:
    """Muennighoff et al.'s data-constrained frontier: with a tenth of D_opt the best model is smaller than the
    unconstrained optimum (excess parameters lose value faster than repeated tokens) but larger than U_N."""
    flops = 1e22
    n_opt, d_opt = HOFFMANN_2022.optimum(flops)
    n, d = constrained_optimum(HOFFMANN_2022, flops, d_opt / 10)
    assert 6 * n * d == pytest.approx(flops, rel=1e-9)
    assert HOFFMANN_2022.optimum(HOFFMANN_2022.flops_for_tokens(d_opt / 10))[0] < n < n_opt
    assert n == pytest.approx(brute_force_optimum(flops, d_opt / 10), rel=2e-3)
    grid = [10 ** (8 + 4 * i / 20000) for i in range(20001)]  # against eqs. 5-6 as written in this file
    assert n == pytest.approx(min(grid, key=lambda m: muennighoff_loss(m, flops, d_opt / 10)), rel=2e-3)
    assert d / (d_opt / 10) > 4  # the data is repeated more than 4 times rather than the model grown 10x
    # Data enough: the closed form; barely short of it: hardly different (the search is continuous there).
    assert constrained_optimum(HOFFMANN_2022, flops, 2 * d_opt) == HOFFMANN_2022.optimum(flops)
    assert constrained_optimum(HOFFMANN_2022, flops, 0.999 * d_opt)[0] == pytest.approx(n_opt, rel=0.01)


def test_sizing_and_the_isoflop_curve() -> None:
    s = size_budget(1e21, unique_tokens=1e10)
    assert s.data_bound and s.epochs > 1 and s.params == s.n_best
    assert s.loss == pytest.approx(s.loss_best, rel=1e-12) and s.loss_best > s.loss_opt
    curve = isoflop_curve(HOFFMANN_2022, 1e21)
    lowest = min(curve, key=lambda p: p[1])
    assert lowest[1] >= s.loss_opt - 1e-12 and lowest[0] == pytest.approx(s.n_opt, rel=0.06)


def test_the_family_reaches_llama_7b() -> None:
    fields = family_model(6.74e9)
    assert count_parameters(ModelConfig(**fields)) == 6_738_415_616  # LLaMA-7B: 4096 wide, 32 layers
    for n in (5e7, 3e8, 2e9, 3e10, 7e10, 3e11):
        fields = family_model(n)
        assert abs(math.log(count_parameters(ModelConfig(**fields)) / n)) < 0.05
        if fields["hidden_size"] >= 8192:  # tensor parallelism of 8 divides the heads of wide models
            assert fields["num_heads"] % 8 == 0 and fields["intermediate_size"] % 8 == 0


def test_the_family_takes_the_vocabulary_given() -> None:
    fields = family_model(1e9, vocab_size=128256)
    assert fields["vocab_size"] == 128256
    assert abs(math.log(count_parameters(ModelConfig(**fields)) / 1e9)) < 0.05


def test_the_default_batch_follows_deepseeks_rule() -> None:
    """DeepSeek LLM (arXiv:2401.02954, eq. 1): B_opt = 0.2920 C^0.3271 tokens, capped at 16M tokens (LLaMA 3 405B),
    in samples rounded to a multiple of the devices."""
    tokens = 0.2920 * 1e21 ** 0.3271  # ~2.2M tokens
    assert default_global_batch(1e21, 2048, 8) == 8 * round(tokens / 2048 / 8)
    assert default_global_batch(1e27, 4096, 64) == 16 * 2 ** 20 // 4096  # the cap: 4096 samples of 4096
    assert default_global_batch(1e12, 4096, 16) == 16  # at least one sample per device


@pytest.mark.parametrize("kwargs, message", [
    (dict(hours=1.0, flops=1e20), "not both"), (dict(), "needs --budget-hours"), (dict(hours=-1.0), "positive"),
    (dict(flops=0.0), "positive"), (dict(unique_tokens=-5.0), "--tokens"),
    (dict(flops=1e20, price_per_device_hour=-1.0), "price"),
])
def test_budget_mistakes(kwargs: dict, message: str) -> None:
    args = {**dict(hours=None, flops=None, unique_tokens=None, price_per_device_hour=None), **kwargs}
    with pytest.raises(ConfigError, match=message):
        check_budget(**args)


# --- against the planner ---------------------------------------------------------------------------

HW = get_hardware("A100-40GB")
DEVICES = 2


def plan_model(fields: dict, flops: float = 0.0) -> object:
    cfg = workload_config(config=validate({"model": fields, "train": {"max_steps": 1},
                                           "optimize": {"mixed_precision": "bf16"}}), devices=DEVICES, hardware=HW,
                          seq_length=1024, global_batch=8)
    return plan(PlanRequest(cfg=cfg, devices=DEVICES, hardware=HW, top=2))


def test_hours_agree_with_the_planners_throughput() -> None:
    hours = 0.5
    peak = HW.tflops_16 * 1e12 * DEVICES * HW.compute_efficiency
    bp = plan_budget(plan_model, peak, hours=hours, price_per_device_hour=3.0)
    s = bp.sizing
    params = count_parameters(bp.model)
    again = plan_model(bp.model.model_dump(mode="json")).best.step.tokens_per_s  # a fresh plan of the model taken
    assert bp.tokens_per_s == pytest.approx(again, rel=1e-12)
    assert s.params == params and s.flops == pytest.approx(6 * params * again * hours * 3600, rel=1e-9)
    assert s.tokens == pytest.approx(again * hours * 3600, rel=1e-9) and bp.hours == hours
    assert abs(math.log(params / s.n_best)) < 0.1  # the family's shape nearest the best size
    assert bp.cost == pytest.approx(DEVICES * hours * 3.0)


def stub_planner(flops_per_s: float, cliff: float = math.inf, slower: float = 30.0, limit: float = math.inf):
    """A planner whose best layout runs `flops_per_s` model FLOPs (6 N per token), `slower` times slower above
    `cliff` parameters (offload), and fits nothing above `limit`; it records the sizes planned."""
    planned, sized_for = [], []

    def plan_model(fields: dict, flops: float) -> SimpleNamespace:
        n = count_parameters(ModelConfig(**fields))
        planned.append(n)
        sized_for.append(flops)
        if n > limit:
            return SimpleNamespace(best=None)
        tps = flops_per_s / (6 * n) / (slower if n > cliff else 1.0)
        return SimpleNamespace(best=SimpleNamespace(step=SimpleNamespace(tokens_per_s=tps)))
    plan_model.sized_for = sized_for
    return plan_model, planned


def test_hours_settle_on_the_optimum_when_compute_bound() -> None:
    plan_model, planned = stub_planner(1e15)
    bp = plan_budget(plan_model, 3e14, hours=10.0)  # first guess 3x too low
    n_opt = HOFFMANN_2022.optimum(1e15 * 36000)[0]
    assert bp.sizing.flops == pytest.approx(1e15 * 36000, rel=1e-9)
    assert abs(math.log(bp.sizing.params / n_opt)) < 0.1 and len(planned) <= 3
    # Each model is planned (its batch chosen) for the FLOPs it was sized for: the guess, then the last spent.
    assert plan_model.sized_for[0] == 3e14 * 36000 and plan_model.sized_for[-1] == pytest.approx(1e15 * 36000)


def test_hours_of_a_given_model_plan_it_at_the_flops_it_spends() -> None:
    """A fixed model: the first plan (at the peak-based guess) gives its throughput; it is planned again with the
    FLOPs that throughput spends, so its batch is that budget's, and those FLOPs are the sizing's."""
    plan_model, planned = stub_planner(1e15)
    fields = family_model(1e9)
    bp = plan_budget(plan_model, 3e14, hours=10.0, model=fields)
    assert plan_model.sized_for == [3e14 * 36000, pytest.approx(1e15 * 36000)]
    assert bp.sizing.flops == pytest.approx(1e15 * 36000) and not bp.family and bp.hours == 10.0


def test_hours_with_a_throughput_cliff_take_the_lowest_loss() -> None:
    """Above 1e9 parameters the stub's throughput falls 30x: no size agrees with its throughput, and the
    answer is the shape just under the cliff (the best loss of those planned), not a swing between two."""
    plan_model, planned = stub_planner(1e15, cliff=1e9, limit=2e10)
    bp = plan_budget(plan_model, 1e15, hours=2000.0)
    assert HOFFMANN_2022.optimum(1e15 * 2000 * 3600)[0] > 1e9  # the optimum lies beyond the cliff
    assert bp.sizing.params <= 1e9 and bp.fits
    losses = {n: size_budget(6 * n * 1e15 / (6 * n) / (30 if n > 1e9 else 1) * 2000 * 3600, None, n).loss
              for n in planned if n <= 2e10}
    assert bp.sizing.loss == pytest.approx(min(losses.values()), rel=1e-12)
    assert len(planned) == len(set(planned))  # no size planned twice


def test_flops_give_the_wall_time() -> None:
    bp = plan_budget(plan_model, 1.0, flops=3e18)
    assert bp.hours == pytest.approx(bp.sizing.tokens / bp.tokens_per_s / 3600, rel=1e-12)
    assert 6 * bp.sizing.params * bp.sizing.tokens == pytest.approx(3e18, rel=1e-12)


def run(capsys: pytest.CaptureFixture, *argv: str) -> str:
    assert main(["plan", *argv]) == 0
    return " ".join(capsys.readouterr().out.split())


def test_cli_budget_hours(capsys: pytest.CaptureFixture, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    out = run(capsys, "--budget-hours", "0.5", "--devices", "2", "--hardware", "A100-40GB", "--seq-length", "1024",
              "--global-batch", "8", "--top", "2", "--price-per-device-hour", "3", "--report", str(tmp_path))
    assert "budget 0.5 h on 2 x A100-40GB" in out and "arXiv:2203.15556" in out
    assert "N_opt" in out and "rule of 20" in out and "cost 1 device-hours x 3 = 3" in out
    assert " ".join(EXTRAPOLATION_WARNING.split()) in out
    assert "why #1" in out  # the plan of the model taken follows
    assert (tmp_path / "budget_isoflop.png").stat().st_size > 0 and (tmp_path / "index.html").exists()
    page = (tmp_path / "index.html").read_text()
    shown = json.loads((tmp_path / "budget.json").read_text())
    assert "extrapolation" in page and f"{shown['params']:.4g}" in page and shown["hours"] == 0.5
    assert shown["cost"] == pytest.approx(2 * 0.5 * 3)


def test_cli_tokens_cap_the_data(capsys: pytest.CaptureFixture) -> None:
    out = run(capsys, "--budget-flops", "1e19", "--tokens", "1e8", "--devices", "2", "--hardware", "A100-40GB",
              "--seq-length", "1024", "--global-batch", "8", "--top", "1")
    assert "100M unique tokens, fewer than D_opt" in out and "arXiv:2305.16264" in out and "epochs worth" in out
    s = size_budget(1e19, 1e8)
    assert s.n_best < s.n_opt and s.epochs > 4


def test_cli_tokens_alone_and_a_fixed_model(capsys: pytest.CaptureFixture) -> None:
    out = run(capsys, "--tokens", "2e9", "--devices", "2", "--hardware", "A100-40GB", "--seq-length", "1024",
              "--global-batch", "8", "--top", "1")
    assert f"budget {HOFFMANN_2022.flops_for_tokens(2e9):.3g} FLOPs" in out and "one pass over the 2B tokens" in out
    out = run(capsys, "--model", "qwen2_0.5b", "--budget-flops", "1e19", "--devices", "2", "--hardware",
              "A100-40GB", "--seq-length", "1024", "--global-batch", "8", "--top", "1")
    assert "model qwen2_0.5b" in out


@pytest.mark.parametrize("argv, message", [
    (["--budget-hours", "1", "--budget-flops", "1e20"], "not both"),
    (["--model", "tiny_llama", "--price-per-device-hour", "2"], "prices a budget"),
    (["--model", "tiny_llama", "--vocab-size", "50000"], "shapes the model a budget sizes"),
    (["--budget-flops=-1e20"], "positive number of FLOPs"), (["--budget-hours", "0"], "positive number of hours"),
])
def test_cli_budget_mistakes(capsys: pytest.CaptureFixture, argv: list, message: str) -> None:
    code = main(["plan", "--devices", "2", "--hardware", "A100-40GB", *argv])
    assert code == 2 and message in capsys.readouterr().err


def test_cli_default_batch_vocabulary_and_cost(capsys: pytest.CaptureFixture) -> None:
    """Without --global-batch the budget's runs get DeepSeek's batch for the budget (not 4 x devices); the family
    takes --vocab-size; a cost under 100 keeps its decimals (2.5 device-hours is not "2")."""
    out = run(capsys, "--budget-flops", "1e19", "--devices", "2", "--hardware", "A100-40GB", "--seq-length", "1024",
              "--top", "1", "--vocab-size", "128256")
    samples = 2 * round(0.2920 * 1e19 ** 0.3271 / 1024 / 2)  # 468 samples of 1024 tokens
    assert f"batch {samples:,} samples x 1,024 tokens" in out and "arXiv:2401.02954" in out
    assert f"global batch {samples} " in out  # the plan printed below is the one made at that batch
    assert "vocabulary 128,256" in out
    assert "the fit's runs spanned 70M-16B parameters and 5B-500B tokens: this optimum lies inside them" in out
    out = run(capsys, "--budget-flops", "1e12", "--devices", "2", "--hardware", "A100-40GB", "--top", "1")
    assert "this optimum lies OUTSIDE them, a further extrapolation" in out  # N_opt ~ 100k parameters
    out = run(capsys, "--budget-hours", "1.25", "--devices", "2", "--hardware", "A100-40GB", "--seq-length", "1024",
              "--global-batch", "8", "--top", "1", "--price-per-device-hour", "1")
    assert "batch 8 samples" in out and "(--global-batch)" in out and "cost 2.5 device-hours x 1 = 2.5" in out


def test_cli_refuses_a_budget_for_a_fine_tune(capsys: pytest.CaptureFixture, tmp_path) -> None:
    """6ND sizes a model pre-trained from scratch: LoRA, frozen layers and fine-tune configs are refused, the
    option or field named, before any planning."""
    for extra, named in ((["--model", "tiny_llama", "--lora"], "--lora"),
                         (["--freeze-layers", "2"], "--freeze-layers")):
        code = main(["plan", "--budget-flops", "1e19", "--devices", "2", "--hardware", "A100-40GB", *extra])
        err = capsys.readouterr().err
        assert code == 2 and named in err and "pre-trained from scratch" in err
    config = tmp_path / "lora.yaml"
    config.write_text("model: {preset: tiny_llama}\ntrain: {max_steps: 1}\nlora: {r: 4}\n")
    code = main(["plan", str(config), "--budget-flops", "1e19", "--devices", "2", "--hardware", "A100-40GB"])
    assert code == 2 and "lora makes this a fine-tune: remove lora" in capsys.readouterr().err
    code = main(["plan", "--model", "tiny_llama", "--vocab-size", "128256", "--budget-flops", "1e19", "--devices",
                 "2", "--hardware", "A100-40GB"])
    assert code == 2 and "drop --vocab-size" in capsys.readouterr().err
