"""HostGate: the device's stream waits for the host, so that work needing data the host has not produced yet can be
queued before the data exists.

The step's sampler needs the grammar masks of its filtered rows, and the host makes those on its worker thread
while the device runs the forward (folio.constrain.masks). Without a gate the host must wait for the masks before
it can queue the sampler, so the sampler's host work (its settings, its launches) adds to every step. With one,
the host queues a wait, the masks' copy to the device and the sampler at once, hands the previous step's tokens to
their jobs meanwhile, then writes the masks into pinned memory and opens the gate: the device copies and samples
right away.

`arm()` queues the wait on the device's current stream (folio.ops' wait_host_value: one thread polling a pinned
int64) and returns the value that opens it; `open(value)` writes it. The masks' worker thread opens it
(folio.constrain.masks), never the thread that queued the wait, which may meanwhile queue more work and wait on the
device: nothing the worker does waits on either. The kernel traps after TIMEOUT_S (a CUDA error the next
synchronising call reports) rather than let the queued work read masks never written.
"""

from __future__ import annotations

import threading

import torch

from folio.ops import OpSet

TIMEOUT_S = 120.0  # far beyond any mask (llguidance bounds each one's work); only a host that died reaches it


class HostGate:
    def __init__(self, ops: OpSet, device: torch.device):
        self._ops = ops
        self._on_device = torch.empty(1, device=device)  # which device's stream waits (the op's dispatch argument)
        self._flag = torch.zeros(1, dtype=torch.int64).pin_memory()
        self._flag_view = self._flag.numpy()
        self._armed = 0
        # A lock's acquire is a full memory barrier: the data the gate guards is visible before the flag is, also
        # on hosts that reorder stores (Arm).
        self._barrier = threading.Lock()

    @classmethod
    def for_device(cls, ops: OpSet, device: torch.device) -> HostGate | None:
        """A gate on `device`, or None where there is no native wait (CPU, a CUDA module without the kernel)."""
        if device.type != "cuda" or ops.native("wait_host_value", "cuda") is None:
            return None
        return cls(ops, device)

    @property
    def num_armed(self) -> int:
        return self._armed

    def arm(self) -> int:
        """Queue a wait on the device's current stream; returns the value that opens it."""
        self._armed += 1
        self._ops.wait_host_value(self._on_device, self._flag, self._armed, int(TIMEOUT_S * 1e9))
        return self._armed

    def open(self, value: int) -> None:
        self._barrier.acquire()  # (the fence: see __init__)
        self._barrier.release()
        self._flag_view[0] = value
