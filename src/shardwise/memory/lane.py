"""The side stream that moves tensors between host and device memory while the compute stream works.

Both offloads that overlap their copies with compute use it: the streamed optimizer
(`memory.streamed_optimizer`) and the activation offload (`memory.offload.ActivationOffload`). On a CPU
the stream is a CPU stream and every event is already complete, so the same calls run and order nothing.
"""

from __future__ import annotations

from typing import Any

import torch


class Lane:
    """The side stream that copies tensors between host and device, and the events that order it against
    the compute stream. On a CPU the stream is a CPU stream and every event is already complete."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.accelerated = device.type != "cpu"
        self.stream = torch.Stream(device=device)

    def mark(self, stream: Any = None) -> Any:
        """An event at the current end of `stream` (default: the side stream); None on a CPU."""
        if not self.accelerated:
            return None
        return (stream or self.stream).record_event()

    def compute_stream(self) -> Any:
        """The stream the model's and the optimizer's kernels run on (None on a CPU)."""
        return torch.accelerator.current_stream(self.device) if self.accelerated else None

    def wait(self, stream: Any, event: Any) -> None:
        """Make `stream` wait for `event` (nothing to wait for on a CPU)."""
        if event is not None:
            stream.wait_event(event)

    def used_on(self, tensors: list[torch.Tensor], stream: Any) -> None:
        """Tell the caching allocator that `tensors` (allocated on another stream) are used on `stream`."""
        if self.accelerated:
            for t in tensors:
                t.record_stream(stream)

    def landed(self, event: Any) -> None:
        """Wait on the host until `event` has passed (nothing to wait for on a CPU)."""
        if event is not None:
            event.synchronize()

    def synchronize(self) -> None:
        """Wait on the host for every copy queued so far (before the host reads or writes the state)."""
        if self.accelerated:
            self.stream.synchronize()
