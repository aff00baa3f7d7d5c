"""Host <-> device copies for the step loop that never wait for the device's queued work.

``torch.tensor(values, device="cuda")`` copies from pageable memory and then synchronizes the
stream: the host waits until every kernel queued before it has run. With async scheduling the
next step's inputs are built while the previous step still runs, so such a call would wait for
that whole step. ``upload`` and ``upload_many`` build the tensor on the host, in pinned memory,
and copy it without blocking (PyTorch's pinned-memory allocator keeps the buffer until the copy
has run). ``HostCopy`` goes the other way: a device tensor copied into pinned memory behind the
queued work, with an event to wait on when the host needs the values.

Off CUDA every function is the plain synchronous form (the CPU runs each op as it is issued).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upload(
    values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``values`` as a 1-D ``dtype`` tensor on ``device``, copied without a stream sync."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    host = torch.tensor(values, dtype=dtype, pin_memory=True)
    return host.to(device, non_blocking=True)


# Each part starts 16 bytes into the buffer from the last (two int64s): Triton specialises a
# kernel on whether a pointer argument is 16-byte aligned, so parts at odd offsets would make
# kernels compile again while serving for what the warm-up compiled aligned.
_ALIGN = 2


def upload_many(parts: Sequence[Sequence[int]], device: torch.device) -> list[torch.Tensor]:
    """Several int lists as int64 tensors on ``device`` in one copy: views of one buffer, in
    order (each contiguous, each starting 16-byte aligned)."""
    flat: list[int] = []
    starts = []
    for p in parts:
        starts.append(len(flat))
        flat.extend(p)
        flat.extend([0] * (-len(flat) % _ALIGN))
    buf = upload(flat, torch.int64, device)
    return [buf[s : s + len(p)] for s, p in zip(starts, parts, strict=True)]


class HostCopy:
    """A device tensor's copy to the host, queued behind the work that produces it.

    ``wait()`` blocks until the copy has landed (on CUDA: an event recorded after it) and
    returns the host tensor; ``ready()`` asks without blocking. On the CPU the tensor itself
    is returned."""

    def __init__(self, src: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if src.device.type != "cuda":
            self._host = src
            return
        self._host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        self._host.copy_(src, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def wait(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
        return self._host


def mark(device: torch.device) -> torch.cuda.Event | None:
    """An event recorded behind the work queued on ``device`` so far; None off CUDA (there
    the work is done when it returns). ``torch.cuda.Event.synchronize`` waits for it."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event
