"""bitsandbytes' paged AdamW (train.optimizer: paged_adamw_8bit / paged_adamw), on CUDA where it is installed.

The optimizer state lives in CUDA unified memory ("paged"): it stays on the GPU while there is room and
the driver moves pages of it to host memory when the GPU runs short, bringing them back when the update
touches them. It is allocated outside torch's caching allocator, so `torch.cuda.max_memory_allocated`
never shows it, and the 8-bit variant keeps both moments block-wise quantised (a byte per element plus
an fp32 scale per block of 256). It is what torchtune's single-GPU full fine-tune uses. The estimator
counts the state in host memory and the step-time model the pages that must cross the bus when the
device is short of room (`step_time`).

bitsandbytes keeps each parameter's step count as a Python int; the checkpointer saves tensors only, so
between steps the count is a 0-dim CPU tensor (read back into an int, without a device sync, before each
step) and a resume continues Adam's bias correction where it was.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ConfigError

PAGED_OPTIMIZERS = {"paged_adamw_8bit": "PagedAdamW8bit", "paged_adamw": "PagedAdamW32bit"}
PAGED_EXTRA = "pip install bitsandbytes (CUDA builds; see https://github.com/bitsandbytes-foundation/bitsandbytes)"


def paged_available() -> bool:
    """Whether bitsandbytes can be imported."""
    try:
        import bitsandbytes.optim  # noqa: F401
    except Exception:  # noqa: BLE001 - missing, or built for another CUDA: either way not usable
        return False
    return True


def paged_problem(name: str, device_type: str, dp: int, zero_stage: int, offloads: bool) -> str | None:
    """Why train.optimizer `name` (a paged one) cannot run here (None: it can)."""
    if device_type != "cuda":
        return (f"train.optimizer {name} pages its state through CUDA unified memory, and this run is on "
                f"{device_type}; use train.optimizer adamw with optimize.offload_optimizer: stream (state in host "
                "memory, the update on the device) or train.optimizer_state_dtype bf16")
    if not paged_available():
        return f"train.optimizer {name} needs bitsandbytes: {PAGED_EXTRA}; or use adamw with offload_optimizer: stream"
    if dp > 1 and zero_stage >= 1:
        return (f"train.optimizer {name} with zero_stage {zero_stage}: bitsandbytes steps whole tensors, not ZeRO's "
                "shards; use zero_stage 0, or train.optimizer adamw (with optimize.offload_optimizer: stream)")
    if offloads:
        return (f"train.optimizer {name} already keeps its state in paged (host-backed) memory; turn "
                "optimize.offload_optimizer / offload_params off")
    return None


def paged_adamw(groups: list[dict], name: str, lr: float, betas: tuple[float, float], eps: float
                ) -> torch.optim.Optimizer:
    """bitsandbytes' PagedAdamW8bit or PagedAdamW32bit over the weight-decay groups."""
    try:
        import bitsandbytes.optim as bnb_optim
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"train.optimizer {name} needs bitsandbytes ({PAGED_EXTRA}); it could not be imported "
                          f"({type(e).__name__}: {e})") from None
    base = getattr(bnb_optim, PAGED_OPTIMIZERS[name])

    class ShardwisePagedAdamW(base):  # type: ignore[misc, valid-type]
        """bitsandbytes' paged AdamW whose step counts are tensors between steps (see the module docstring)."""

        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:  # noqa: D102
            stepped = [self.state[p] for g in self.param_groups for p in g["params"] if p in self.state]
            for st in stepped:
                if torch.is_tensor(st.get("step")):
                    st["step"] = int(st["step"])  # a CPU tensor: no device sync
            try:
                return super().step(closure)
            finally:
                for g in self.param_groups:
                    for p in g["params"]:
                        st = self.state.get(p)
                        if st and isinstance(st.get("step"), int):
                            st["step"] = torch.tensor(st["step"], dtype=torch.int64)

    return ShardwisePagedAdamW(groups, lr=lr, betas=betas, eps=eps)
