"""Compute-optimal sizing: how large a model, and how many tokens, a compute budget buys.

The loss model is the parametric fit of Hoffmann et al. 2022, "Training Compute-Optimal Large
Language Models" (arXiv:2203.15556), Approach 3 (section 3.3, equation 2 and its constants):

    L(N, D) = E + A / N^alpha + B / D^beta,   E = 1.69, A = 406.4, B = 410.7, alpha = 0.34, beta = 0.28

with N parameters, D training tokens and training compute C ~ 6 N D FLOPs. Minimising L on C = 6 N D
gives (their equation 4)

    N_opt = G (C/6)^(beta/(alpha+beta)),  D_opt = G^-1 (C/6)^(alpha/(alpha+beta)),
    G = (alpha A / (beta B))^(1/(alpha+beta)).

The fit is an EXTRAPOLATION: it was made on models of 70M to 16B parameters trained on 5B to 500B
tokens of MassiveText with its tokenizer, so absolute losses do not carry over to other data, and
budgets far beyond theirs extrapolate further still. The constants are published rounded; Besiroglu et
al. 2024 ("Chinchilla Scaling: A replication attempt", arXiv:2404.10102) show the rounding biases the
optimum toward more tokens per parameter than the paper's Approaches 1 and 2, which put it near 20
tokens per parameter (Chinchilla: 70B parameters, 1.4T tokens at Gopher's 5.76e23 FLOPs). Both are
reported (`rule_of_20`).

When the unique tokens U are fewer than the budget would use, the data-constrained variant of
Muennighoff et al. 2023, "Scaling Data-Constrained Language Models" (arXiv:2305.16264, equation 5)
counts repeated tokens at a decaying value: D tokens seen out of U unique are worth

    D' = U + U R_D* (1 - exp(-R_D / R_D*)),   R_D = D / U - 1 (repetitions after the first epoch),  R_D* = 15.4

and parameters beyond U_N, the compute-optimal size for U tokens, at a faster-decaying value (their
equation 6; R_N* = 5.3 below R_D* = 15.4, so with scarce data spare compute goes mostly into epochs):

    N' = U_N + U_N R_N* (1 - exp(-R_N / R_N*)),   R_N = N / U_N - 1,   U_N = min(N, N_opt for D_opt = U)

and the model size minimising L(N', D') on C = 6 N D is searched numerically. (Their R* were fitted with
their own loss fit, R_D* = 15.387756 and R_N* = 5.309743 in their appendix A; using them with Hoffmann's
is an approximation. They say about 4 epochs cost little: 4U seen are worth 3.7U.)

The default global batch of a budget's runs is DeepSeek-AI 2024, "DeepSeek LLM" (arXiv:2401.02954,
section 3.1, equation 1): B_opt = 0.2920 C^0.3271 tokens, fitted on 1e17-2e19 FLOPs. It overshoots the
batches large runs used (LLaMA-2 7B at 8.4e22: 9.2M against 4M), so it is capped at LLaMA 3 405B's
16M tokens (Llama Team 2024, arXiv:2407.21783, section 3.4.1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..errors import ConfigError
from ..models import ModelConfig, count_parameters, get_preset
from .search import PlanResult

FLOPS_PER_PARAMETER_TOKEN = 6.0  # C ~ 6 N D (forward 2, backward 4)
TOKENS_PER_PARAMETER = 20.0  # Hoffmann et al.'s Approaches 1 and 2, roughly: Chinchilla 70B on 1.4T tokens
R_STAR = 15.4  # Muennighoff et al. 2023 (15.387756): repetitions at which repeated data has lost 1 - 1/e of its value
R_STAR_PARAMS = 5.3  # and (5.309743) excess parameters, in multiples of U_N beyond it, likewise
BATCH_TOKENS_COEF, BATCH_TOKENS_EXP = 0.2920, 0.3271  # DeepSeek LLM's B_opt = 0.2920 C^0.3271 tokens
MAX_BATCH_TOKENS = 16 * 2 ** 20  # LLaMA 3 405B's largest batch: 16M tokens
BATCH_RULE = "DeepSeek LLM's B_opt = 0.2920 C^0.3271 tokens (arXiv:2401.02954), at most 16M (LLaMA 3 405B's)"
VOCAB_SIZE = 32000  # the family's default vocabulary (LLaMA's tokenizer)
SEARCH_DECADES = 4.0  # the data-constrained search spans N_opt / 10^4 .. N_opt x 10^4
FIT_PARAMS = (70e6, 16e9)  # the sizes and tokens of Hoffmann et al.'s runs (their section 3)
FIT_TOKENS = (5e9, 500e9)
EXTRAPOLATION_WARNING = (
    "The fit is an extrapolation: Hoffmann et al. fitted it on models of 70M-16B parameters and up to 500B "
    "tokens of their MassiveText data and tokenizer, so the absolute losses do not carry over to your data "
    "or tokenizer; the balance of parameters and tokens is the robust part, and the published constants are "
    "rounded (Besiroglu et al. 2024), which shifts the optimum toward more tokens per parameter than the "
    "paper's other approaches (~20 tokens per parameter).")


@dataclass(frozen=True)
class ScalingFit:
    """L(N, D) = E + A / N^alpha + B / D^beta, a loss against parameters N and training tokens D."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    source: str

    def loss(self, params: float, tokens: float) -> float:
        """Predicted loss (nats per token on the fit's data) of `params` parameters trained on `tokens` tokens."""
        return self.E + self.A / params ** self.alpha + self.B / tokens ** self.beta

    @property
    def G(self) -> float:
        """(alpha A / (beta B))^(1 / (alpha + beta)): N_opt = G (C/6)^a, D_opt = (C/6)^b / G."""
        return (self.alpha * self.A / (self.beta * self.B)) ** (1 / (self.alpha + self.beta))

    @property
    def a(self) -> float:
        """Exponent of N_opt in C: beta / (alpha + beta)."""
        return self.beta / (self.alpha + self.beta)

    @property
    def b(self) -> float:
        """Exponent of D_opt in C: alpha / (alpha + beta)."""
        return self.alpha / (self.alpha + self.beta)

    def optimum(self, flops: float) -> tuple[float, float]:
        """(N_opt, D_opt) minimising the loss at `flops` = 6 N D."""
        c6 = flops / FLOPS_PER_PARAMETER_TOKEN
        return self.G * c6 ** self.a, c6 ** self.b / self.G

    def flops_for_tokens(self, tokens: float) -> float:
        """The budget whose D_opt is `tokens` (the compute that one pass over that data deserves)."""
        return FLOPS_PER_PARAMETER_TOKEN * (self.G * tokens) ** (1 / self.b)


HOFFMANN_2022 = ScalingFit(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28,
                           source="Hoffmann et al. 2022 (arXiv:2203.15556), Approach 3")


def rule_of_20(flops: float) -> tuple[float, float]:
    """(N, D) at TOKENS_PER_PARAMETER tokens per parameter for `flops` = 6 N D (Approaches 1 and 2)."""
    n = math.sqrt(flops / (FLOPS_PER_PARAMETER_TOKEN * TOKENS_PER_PARAMETER))
    return n, TOKENS_PER_PARAMETER * n


def effective_tokens(seen: float, unique: Optional[float], r_star: float = R_STAR) -> float:
    """What `seen` tokens drawn from `unique` distinct ones are worth (Muennighoff et al. 2023, eq. 5):
    all of it within the first epoch, then repetitions R = seen / unique - 1 at a value decaying with R*."""
    if unique is None or seen <= unique:
        return seen
    repeats = seen / unique - 1
    return unique + unique * r_star * (1 - math.exp(-repeats / r_star))


def effective_params(params: float, unique: Optional[float], fit: ScalingFit, r_star: float = R_STAR_PARAMS) -> float:
    """What `params` parameters are worth on `unique` distinct tokens (Muennighoff et al. 2023, eq. 6): all
    of them up to U_N, the fit's compute-optimal size for one pass over the data, then the excess
    R_N = params / U_N - 1 at a value decaying with R_N*."""
    if unique is None:
        return params
    u_n = min(params, fit.optimum(fit.flops_for_tokens(unique))[0])
    repeats = params / u_n - 1
    return u_n + u_n * r_star * (1 - math.exp(-repeats / r_star))


def constrained_loss(fit: ScalingFit, params: float, flops: float, unique: Optional[float]) -> float:
    """The loss of `params` parameters trained with `flops` (6 N D) on data of `unique` distinct tokens:
    L(N', D') with the excess parameters and the repeated tokens discounted (Muennighoff et al. 2023)."""
    return trained_loss(fit, params, flops / (FLOPS_PER_PARAMETER_TOKEN * params), unique)


def trained_loss(fit: ScalingFit, params: float, seen: float, unique: Optional[float]) -> float:
    """The loss of `params` parameters after `seen` tokens drawn from `unique` distinct ones."""
    return fit.loss(effective_params(params, unique, fit), effective_tokens(seen, unique))


def constrained_optimum(fit: ScalingFit, flops: float, unique: Optional[float]) -> tuple[float, float]:
    """(N, D seen) minimising `constrained_loss`: the closed form when the data does not bind (unique >=
    D_opt), else a log-spaced scan refined by golden-section search (the loss is unimodal in log N)."""
    n_opt, d_opt = fit.optimum(flops)
    if unique is None or unique >= d_opt:
        return n_opt, d_opt

    def f(log_n: float) -> float:
        return constrained_loss(fit, math.exp(log_n), flops, unique)

    lo, hi = math.log(n_opt) - SEARCH_DECADES * math.log(10), math.log(n_opt) + SEARCH_DECADES * math.log(10)
    steps = 400
    grid = [lo + (hi - lo) * i / steps for i in range(steps + 1)]
    best = min(range(len(grid)), key=lambda i: f(grid[i]))
    a, b = grid[max(best - 1, 0)], grid[min(best + 1, steps)]
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(80):
        c, d = b - ratio * (b - a), a + ratio * (b - a)
        if f(c) < f(d):
            b = d
        else:
            a = c
    n = math.exp((a + b) / 2)
    return n, flops / (FLOPS_PER_PARAMETER_TOKEN * n)


def isoflop_curve(fit: ScalingFit, flops: float, unique: Optional[float] = None, points: int = 61,
                  decades: float = 1.5) -> list[tuple[float, float]]:
    """(N, predicted loss) at `flops` for N from N_opt / 10^decades to N_opt x 10^decades (log-spaced)."""
    n_opt, _ = fit.optimum(flops)
    out = []
    for i in range(points):
        n = n_opt * 10 ** (decades * (2 * i / (points - 1) - 1))
        out.append((n, constrained_loss(fit, n, flops, unique)))
    return out


@dataclass
class Sizing:
    """What a budget buys under a fit: the optimum, the data-constrained choice and the model taken."""

    flops: float  # the budget, 6 N D FLOPs
    fit: ScalingFit
    n_opt: float  # unconstrained compute-optimal parameters
    d_opt: float  # and tokens
    unique_tokens: Optional[float]  # --tokens: distinct tokens available
    n_best: float  # the best size with the data as it is (n_opt when the data does not bind)
    d_best: float  # tokens seen at that size
    params: float  # the model taken (a shape of the family near n_best, or the user's model)
    tokens: float  # tokens it sees within the budget

    @property
    def data_bound(self) -> bool:
        """Whether the unique tokens are fewer than the optimum would use."""
        return self.unique_tokens is not None and self.unique_tokens < self.d_opt

    @property
    def epochs(self) -> float:
        """Passes over the unique data (1 when unbounded)."""
        return self.tokens / self.unique_tokens if self.unique_tokens else 1.0

    @property
    def effective_tokens(self) -> float:
        """The tokens seen, repeated ones discounted."""
        return effective_tokens(self.tokens, self.unique_tokens)

    @property
    def loss_opt(self) -> float:
        """Predicted loss at the unconstrained optimum."""
        return self.fit.loss(self.n_opt, self.d_opt)

    @property
    def loss_best(self) -> float:
        """Predicted loss at the best size for the data."""
        return constrained_loss(self.fit, self.n_best, self.flops, self.unique_tokens)

    @property
    def loss(self) -> float:
        """Predicted loss of the model taken."""
        return trained_loss(self.fit, self.params, self.tokens, self.unique_tokens)


def size_budget(flops: float, unique_tokens: Optional[float] = None, params: Optional[float] = None,
                fit: ScalingFit = HOFFMANN_2022) -> Sizing:
    """The sizing of `flops`: the optimum, the data-constrained best, and `params` (default: the best)."""
    if not flops > 0 or math.isinf(flops):
        raise ConfigError(f"the compute budget must be a positive number of FLOPs, not {flops}")
    if unique_tokens is not None and not unique_tokens > 0:
        raise ConfigError(f"--tokens {unique_tokens}: give the number of distinct training tokens, e.g. 2e11")
    n_opt, d_opt = fit.optimum(flops)
    n_best, d_best = constrained_optimum(fit, flops, unique_tokens)
    taken = n_best if params is None else params
    return Sizing(flops=flops, fit=fit, n_opt=n_opt, d_opt=d_opt, unique_tokens=unique_tokens, n_best=n_best,
                  d_best=d_best, params=taken, tokens=flops / (FLOPS_PER_PARAMETER_TOKEN * taken))


def batch_tokens(flops: float) -> float:
    """The default global batch in tokens of a run of `flops` (6ND): DeepSeek LLM's B_opt = 0.2920 C^0.3271
    (their C counts non-embedding FLOPs, near 6ND), capped at MAX_BATCH_TOKENS."""
    return min(MAX_BATCH_TOKENS, BATCH_TOKENS_COEF * flops ** BATCH_TOKENS_EXP)


def default_global_batch(flops: float, seq_length: int, devices: int) -> int:
    """`batch_tokens(flops)` in samples of `seq_length`, rounded to a multiple of `devices` (at least one
    sample each) so that every data-parallel degree splits it."""
    return devices * max(1, round(batch_tokens(flops) / seq_length / devices))


# --- a model of a given size, and the hours it takes on given devices ------------------------------

FAMILY_BASE = "llama_7b"  # the family's norm, MLP and positions; its vocabulary is VOCAB_SIZE unless given


def width_step(hidden: int) -> int:
    """The family's width grid: steps of 64 below 1024, then 128, 256 from 2048, 512 from 4096 and 1024
    from 8192, so that wide models have head counts that tensor parallelism of 4 or 8 divides."""
    return 64 if hidden < 1024 else 128 if hidden < 2048 else 256 if hidden < 4096 else 512 if hidden < 8192 else 1024


def family_aspect(hidden: int) -> float:
    """Width per layer: 64 up to 1024 wide, 128 from 4096 (LLaMA-7B: 4096 x 32), in between as sqrt."""
    return min(128.0, max(64.0, 64.0 * math.sqrt(hidden / 1024)))


def family_shape(hidden: int, layers: int) -> dict[str, int]:
    """A LLaMA-like shape: heads of 64 (128 from 2048 wide), a gated MLP 8/3 as wide rounded up to 256."""
    head_dim = 128 if hidden >= 2048 else 64
    intermediate = 256 * math.ceil(8 * hidden / 3 / 256)
    return {"hidden_size": hidden, "num_layers": layers, "num_heads": hidden // head_dim,
            "num_kv_heads": hidden // head_dim, "intermediate_size": intermediate}


def family_model(params: float, max_positions: int = 2048, vocab_size: int = VOCAB_SIZE) -> dict[str, Any]:
    """The model fields (a FAMILY_BASE-like model with `vocab_size` tokens) nearest `params` parameters: for
    each width of the grid the layer count nearest the target, then the width whose count misses least,
    with an aspect (width per layer) near `family_aspect` as the lesser concern."""
    base = {k: v for k, v in get_preset(FAMILY_BASE).items() if k != "preset"}
    base.update(max_position_embeddings=max_positions, vocab_size=vocab_size)
    vocab = vocab_size
    # Widths whose shape at the family's aspect is within 3x of the target (~12 w^2 per layer, embeddings).
    widths = [w for w in range(128, 65537, 64) if w % width_step(w) == 0
              and 1 / 3 < (12 * w ** 3 / family_aspect(w) + 2 * vocab * w) / params < 3] or [128]

    def count(width: int, layers: int) -> int:
        return count_parameters(ModelConfig(**{**base, **family_shape(width, layers)}))

    best: tuple[float, dict[str, Any]] = (math.inf, {})
    for width in widths:
        one, two = count(width, 1), count(width, 2)
        layers = max(2, round((params - (2 * one - two)) / (two - one)))
        score = 4 * abs(math.log(count(width, layers) / params)) + abs(math.log(width / layers / family_aspect(width)))
        if score < best[0]:
            best = (score, {**base, **family_shape(width, layers)})
    return best[1]


@dataclass
class BudgetPlan:
    """A budget sized and timed: the sizing, the model taken, its best layout, the wall time and cost."""

    sizing: Sizing
    given: str  # "hours", "flops" or "tokens": what the user fixed
    model: ModelConfig  # the model taken
    result: PlanResult  # the plan of that model on the devices (`result.best` None: it fits no layout)
    hours: Optional[float]  # wall time to train it on `sizing.tokens` tokens (None when nothing fits)
    price_per_device_hour: Optional[float] = None
    rounds: int = 1  # plans made to agree the size with the throughput (hours given)
    batch_source: str = ""  # where the global batch planned came from (said in the output)
    family: bool = False  # the model is the family's shape near the best size (not one the user gave)

    @property
    def fits(self) -> bool:
        """Whether the model taken fits some layout of the devices."""
        return self.result.best is not None

    @property
    def tokens_per_s(self) -> float:
        """The best layout's predicted tokens/s over all devices."""
        return self.result.best.step.tokens_per_s

    @property
    def device_hours(self) -> Optional[float]:
        """Devices x wall hours."""
        return None if self.hours is None else self.result.request.devices * self.hours

    @property
    def cost(self) -> Optional[float]:
        """Device hours x --price-per-device-hour, when given."""
        hours = self.device_hours
        return None if self.price_per_device_hour is None or hours is None else hours * self.price_per_device_hour


PlanModel = Callable[[dict[str, Any], float], PlanResult]  # (model fields, FLOPs it is sized for) -> its plan


def _shape(fields: dict[str, Any]) -> tuple[int, int]:
    return fields["hidden_size"], fields["num_layers"]


MAX_ROUNDS = 8
CONVERGED = 0.02  # the best size moved less than this between rounds: finer than the family's shapes


def check_budget(hours: Optional[float], flops: Optional[float], unique_tokens: Optional[float],
                 price_per_device_hour: Optional[float]) -> str:
    """Refuse contradictory or impossible budget options; say which the user fixed."""
    if hours is not None and flops is not None:
        raise ConfigError("give --budget-hours or --budget-flops, not both (the hours give the FLOPs on the devices)")
    if hours is None and flops is None and unique_tokens is None:
        raise ConfigError("a budget needs --budget-hours H, --budget-flops F or --tokens T")
    if hours is not None and not 0 < hours < math.inf:
        raise ConfigError(f"--budget-hours {hours}: give a positive number of hours")
    if flops is not None and not 0 < flops < math.inf:
        raise ConfigError(f"--budget-flops {flops}: give a positive number of FLOPs, e.g. 1e21")
    if unique_tokens is not None and not 0 < unique_tokens < math.inf:
        raise ConfigError(f"--tokens {unique_tokens}: give the number of distinct training tokens, e.g. 2e11")
    if price_per_device_hour is not None and not 0 <= price_per_device_hour < math.inf:
        raise ConfigError(f"--price-per-device-hour {price_per_device_hour}: give a price of at least 0")
    return "hours" if hours is not None else "flops" if flops is not None else "tokens"


def plan_budget(plan_model: PlanModel, peak_flops: float, hours: Optional[float] = None,
                flops: Optional[float] = None, unique_tokens: Optional[float] = None,
                model: Optional[dict[str, Any]] = None, price_per_device_hour: Optional[float] = None,
                fit: ScalingFit = HOFFMANN_2022, max_positions: int = 2048,
                vocab_size: int = VOCAB_SIZE) -> BudgetPlan:
    """Size a budget (`hours` on the devices `plan_model` plans for, `flops`, or only `unique_tokens`: the
    compute one pass over them deserves) and time the model taken with its best layout. `model` fixes the
    model (ModelConfig fields) instead of the family's shape nearest the best size; `max_positions` (at
    least the sequence planned) and `vocab_size` shape the family.

    With hours, the FLOPs follow from the predicted throughput, which follows from the size: start from
    `peak_flops` (all devices, at the hardware's compute efficiency), size, plan that model, take the
    FLOPs its tokens/s give (6 N x tokens/s x seconds), and repeat until the best size for those FLOPs is
    within CONVERGED of the model's (MAX_ROUNDS plans at most; see `_search_hours`)."""
    given = check_budget(hours, flops, unique_tokens, price_per_device_hour)

    def shape_for(params: float) -> dict[str, Any]:
        return family_model(params, max_positions, vocab_size)

    if given == "tokens":
        flops = fit.flops_for_tokens(unique_tokens)
    if given != "hours":
        fields = model or shape_for(size_budget(flops, unique_tokens, None, fit).n_best)
        sizing = size_budget(flops, unique_tokens, count_parameters(ModelConfig(**fields)), fit)
        result = plan_model(fields, flops)
        wall = None if result.best is None else sizing.tokens / result.best.step.tokens_per_s / 3600
        return BudgetPlan(sizing, given, ModelConfig(**fields), result, wall, price_per_device_hour,
                          family=model is None)
    seconds = hours * 3600
    guess = peak_flops * seconds  # the first guess: the devices at the hardware's compute efficiency
    if model is not None:  # the size is fixed: a plan gives the throughput, hence the FLOPs (and its batch)
        result = plan_model(model, guess)
        n = count_parameters(ModelConfig(**model))
        spent = _spent(n, result, seconds)
        if spent is not None:  # plan again at the batch of the FLOPs spent, not of the first guess
            again = plan_model(model, spent)
            result, spent = (again, _spent(n, again, seconds)) if again.best is not None else (result, spent)
        return BudgetPlan(size_budget(spent or guess, unique_tokens, n, fit), given, ModelConfig(**model), result,
                          hours if spent else None, price_per_device_hour)
    tried = _search_hours(plan_model, shape_for, guess, seconds, unique_tokens, fit)
    fitting = [t for t in tried if t.spent is not None]
    if not fitting:  # no shape tried fits a layout: show the last with the plan's advice
        last = tried[-1]
        return BudgetPlan(size_budget(guess, unique_tokens, last.params, fit), given, ModelConfig(**last.fields),
                          last.result, None, price_per_device_hour, len(tried), family=True)
    best = min(fitting, key=lambda t: size_budget(t.spent, unique_tokens, t.params, fit).loss)
    return BudgetPlan(size_budget(best.spent, unique_tokens, best.params, fit), given, ModelConfig(**best.fields),
                      best.result, hours, price_per_device_hour, len(tried), family=True)


@dataclass
class _Tried:
    """One size planned in the hours search."""

    fields: dict[str, Any]
    result: PlanResult
    params: int
    spent: Optional[float]  # 6 N x tokens/s x seconds; None: it fits no layout


def _spent(params: int, result: PlanResult, seconds: float) -> Optional[float]:
    """The FLOPs (6ND) `params` parameters get through in `seconds` at the plan's best layout."""
    return FLOPS_PER_PARAMETER_TOKEN * params * result.best.step.tokens_per_s * seconds if result.best else None


def _search_hours(plan_model: PlanModel, shape_for: Callable[[float], dict[str, Any]], guess: float,
                  seconds: float, unique_tokens: Optional[float], fit: ScalingFit) -> list[_Tried]:
    """The sizes planned to find N with N = n_best(6 N x tokens/s(N) x seconds), in order.

    Above the answer the right side is below N and below it above, so each plan narrows a bracket [low,
    high]; the next N is the right side when it falls inside the bracket on a shape not tried yet, else
    the bracket's geometric middle. Throughput can fall steeply with size (a larger model that needs
    offload) and leave no such N: the caller takes, of the shapes tried, the one with the lowest predicted
    loss at its own throughput. Each model is planned with the FLOPs it was sized for (its batch)."""
    tried: dict[tuple[int, int], _Tried] = {}
    low, high = 0.0, math.inf
    flops = guess
    target = size_budget(flops, unique_tokens, None, fit).n_best
    for _ in range(MAX_ROUNDS):
        fields = shape_for(target)
        if _shape(fields) in tried:
            break
        result = plan_model(fields, flops)
        n = count_parameters(ModelConfig(**fields))
        spent = _spent(n, result, seconds)
        tried[_shape(fields)] = _Tried(fields, result, n, spent)
        wanted = None
        if spent is None:  # too large for the devices
            high = min(high, n)
        else:
            flops = spent
            wanted = size_budget(spent, unique_tokens, None, fit).n_best
            if abs(wanted / n - 1) < CONVERGED or shape_for(wanted) == fields:
                break  # agreed, to within the family's steps
            low, high = (max(low, n), high) if wanted > n else (low, min(high, n))
        if wanted is None or not low < wanted < high or _shape(shape_for(wanted)) in tried:
            wanted = math.sqrt(low * high) if 0 < low and high < math.inf else high / 4 if low == 0 else low * 4
        if wanted < 1e6:  # nothing that small fits either
            break
        target = wanted
    return list(tried.values())
