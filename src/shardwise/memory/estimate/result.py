"""What the estimator returns: `MemoryEstimate`, the bytes of one device by part (parameters, gradients,
optimizer state, activations, buffers, allocator overhead) and by phase of a step (`PHASES`), the host
memory beside them, the details each part was counted from, and its table in GiB."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...units import gib

PHASES = ("forward", "backward", "optimizer", "checkpoint")


@dataclass
class MemoryEstimate:
    """Bytes for one device (the busiest of its kind); phases are totals of the device at their peak."""

    params: int
    grads: int
    optimizer: int  # includes fp32 master copies
    activations: int  # at the peak: saved for backward over the in-flight micro-batches
    buffers: int  # at the peak: communication buffers, logits/loss temporaries, transients
    overhead: int  # allocator rounding/fragmentation (CUDA/NPU); 0 on CPU
    peak: int  # the largest phase total
    phases: dict[str, int]  # "forward", "backward", "optimizer", "checkpoint" -> total bytes
    detail: dict[str, Any] = field(default_factory=dict)
    host: int = 0  # bytes kept in host memory by CPU offload at most (not on an accelerator's figures)
    host_phases: dict[str, int] = field(default_factory=dict)  # host bytes by phase (the CPU's own: see below)

    @property
    def peak_phase(self) -> str:
        """The phase with the largest total."""
        return max(self.phases, key=self.phases.get)

    def table(self) -> str:
        """A human-readable breakdown in GiB."""
        d = self.detail
        rows = [
            ("parameters", self.params), ("gradients", self.grads),
            ("optimizer state (+ fp32 masters)", self.optimizer),
            (f"activations ({d.get('in_flight', 1)} micro-batch(es) in flight)", self.activations),
            ("buffers (comm, logits/loss, transients)", self.buffers), ("allocator overhead", self.overhead),
        ]
        width = max(len(r[0]) for r in rows) + 2
        where = d.get("rank_role", "")
        lines = [f"memory per device{f' ({where})' if where else ''}, at the {self.peak_phase} peak:"]
        lines += [f"  {name:<{width}}{gib(n, 3):>10}" for name, n in rows]
        lines.append(f"  {'peak':<{width}}{gib(self.peak, 3):>10}")
        lines.append("  by phase: " + ", ".join(f"{p} {gib(self.phases[p], 3)}" for p in PHASES))
        per_layer = d.get("layer_activation_bytes")
        if per_layer:
            lines.append(f"  activations per layer and micro-batch: {gib(per_layer, 3)} "
                         f"(no recompute: {gib(d['layer_activation_bytes_no_recompute'], 3)}, "
                         f"full recompute: {gib(d['layer_activation_bytes_full_recompute'], 3)}); "
                         f"{d.get('layers_on_rank')} layers on this device")
        cp = d.get("layout", {}).get("cp", 1)
        if cp > 1:
            lines.append(f"  context parallel {cp}: {d['layout']['seq'] // cp} of every {d['layout']['seq']} tokens on "
                         f"this device; all-to-all buffers around attention "
                         f"{gib(d.get('context_parallel_exchange_bytes', 0), 3)}")
        if d.get("approximate"):
            lines.append(f"  approximate: {d['approximate']}")
        if self.host:
            by = ", ".join(f"{p} {gib(self.host_phases[p], 3)}" for p in PHASES if p in self.host_phases)
            staged = d.get("async_save_host_bytes", 0)
            what = "CPU offload" + (f" and the async save's copy, {gib(staged, 3)}" if staged else "")
            lines.append(f"  in host memory ({what}): {gib(self.host, 3)}" + (f" (by phase: {by})" if by else ""))
            if d.get("device") == "cpu":
                lines.append("  (a CPU run: host memory is the device's, so the figures above include it)")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "buffers": self.buffers, "overhead": self.overhead,
                "peak": self.peak, "peak_phase": self.peak_phase, "phases": dict(self.phases), "host": self.host,
                "host_phases": dict(self.host_phases),
                "detail": self.detail}
