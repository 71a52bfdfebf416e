"""The all-reduce of a tensor-parallel replica's partial sums through the peers' memory (native/cuda/
peer_all_reduce.cu): one kernel reads the other ranks' copies over NVLink (CUDA IPC), instead of an NCCL collective.

Decode sends two small messages a layer ([batch, hidden]: 8 KiB a token for an 8B model), 64 a token for 32 layers;
there NCCL's fixed cost per collective, not the bytes, is the time. The peer kernel's cost is one copy, one signal
and one wait per call. Messages over `max_bytes` (long prompt chunks) still go through NCCL, whose ring moves large
messages at the links' bandwidth with less traffic per GPU.

`connect(tp, device, mode)` is a collective: every rank of the group calls it at the same point (building the model
does, with the same EngineOptions on every rank). Every rank then takes the same path for every message (the choice
depends on the message's size and dtype only), as the collectives must pair up.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from folio import ops

if TYPE_CHECKING:
    from folio.model.tensor_parallel import TensorParallel

# Two staging slots of this size per GPU (calls alternate between them). 8 MiB holds a decode step's message up to
# 1,024 rows of hidden 4096 in bf16; longer prefill chunks go to NCCL. Between two ranks the slots hold 32 MiB: a
# prompt step's 2,304 rows (a 2,048-token chunk beside 256 decode rows) of hidden 4096, whose NCCL calls cost rank 0's
# host more than the step's kernels (a profile of a served replica). Each rank reads every other rank's slot, so with
# more ranks the bytes each one reads grow with their number, and large messages stay with NCCL's ring.
MAX_BYTES = 8 << 20
MAX_BYTES_TWO_RANKS = 32 << 20


def max_bytes_for(world_size: int) -> int:
    """The largest message (bytes) the peers' memory takes in a group of world_size ranks."""
    return MAX_BYTES_TWO_RANKS if world_size == 2 else MAX_BYTES
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class PeerAllReduceUnavailable(RuntimeError):
    """EngineOptions(tp_all_reduce="peer") on ranks that cannot use it (no native module, no peer access)."""


class PeerAllReduce:
    """One rank's connected side (folio.ops' native class) and the rule for which messages it takes."""

    def __init__(self, native: Any, max_bytes: int) -> None:
        self.native = native
        self.max_bytes = max_bytes

    def takes(self, x: torch.Tensor) -> bool:
        """Whether x goes through the peers' memory: the same answer on every rank for the same message (its size
        and dtype, never its address or layout: a view is summed through a copy)."""
        return x.is_cuda and fits(x.numel() * x.element_size(), x.dtype, self.max_bytes)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (`takes(x)` must hold)."""
        y = _aligned(x)
        self.native.all_reduce(y)
        return x if y is x else x.copy_(y)

    def broadcast(self, x: torch.Tensor) -> bool:
        """Rank 0's x into every rank's x, in place, where the kernel takes it (bytes of any type, whole 16-byte
        vectors, at most max_bytes: the same answer on every rank for the same message, its size), and True;
        otherwise nothing is done, and False."""
        num_bytes = x.numel() * x.element_size()
        if not (x.is_cuda and 0 < num_bytes <= self.max_bytes and num_bytes % 16 == 0):
            return False
        y = _aligned(x)
        self.native.broadcast(y)
        if y is not x:
            x.copy_(y)
        return True

    def takes_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether `all_reduce_add_rms_norm` takes these: what `takes` asks, and [rows, hidden] operands of one
        dtype with whole 16-byte rows (again the same answer on every rank: sizes and dtypes only)."""
        return (self.takes(x) and x.dim() == 2 and residual.shape == x.shape and residual.dtype == x.dtype
                and weight.shape == (x.shape[1],) and weight.dtype == x.dtype and residual.is_cuda
                and (x.shape[1] * x.element_size()) % 16 == 0)

    def all_reduce_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> torch.Tensor:
        """x summed over the ranks, residual += it, then x = RMSNorm(residual) * weight, in one kernel (the
        layer's sum and the fused add-and-norm after it; `takes_add_rms_norm` must hold). Returns x."""
        views = [_aligned(t) for t in (x, residual, weight)]
        self.native.all_reduce_add_rms_norm(*views, eps)
        for original, used in zip((x, residual), views):
            if used is not original:
                original.copy_(used)
        return x


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t where the kernels take it as it is (dense, 16-byte aligned); else a fresh copy (a view's), to copy back."""
    return t if t.is_contiguous() and t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)


def fits(num_bytes: int, dtype: torch.dtype, max_bytes: int) -> bool:
    """Whether the kernel takes a message of num_bytes of dtype: whole 16-byte vectors, at most max_bytes."""
    return 0 < num_bytes <= max_bytes and num_bytes % 16 == 0 and dtype in _DTYPES


def connect(tp: TensorParallel, device: torch.device, mode: str, max_bytes: int | None = None) -> PeerAllReduce | None:
    """This rank's PeerAllReduce, connected to the other ranks', or None where NCCL (gloo on the CPU) sums instead.

    mode: "auto" (the peers' memory where every rank has the native module and peer access to every other rank's GPU),
    "peer" (that, or PeerAllReduceUnavailable saying why), "nccl" (never; no collective runs). A collective on CUDA
    unless mode is "nccl"; on the CPU nothing runs (the same on every rank). max_bytes: the largest message it takes
    (None: max_bytes_for the group's size)."""
    if mode == "nccl" or tp.world_size < 2:
        return None
    max_bytes = max_bytes_for(tp.world_size) if max_bytes is None else max_bytes
    if device.type != "cuda":
        if mode == "peer":
            raise PeerAllReduceUnavailable(f"tp_all_reduce='peer' needs CUDA devices, the model is on {device}")
        return None
    native_class = ops.peer_all_reduce_class()
    index = device.index if device.index is not None else torch.cuda.current_device()
    native, why_not = None, None
    if native_class is None:
        why_not = f"the native CUDA module is not built or has no PeerAllReduce ({ops.BUILD_HINT})"
    elif tp.world_size > native_class.max_ranks:
        why_not = f"{tp.world_size} ranks, the kernel takes at most {native_class.max_ranks}"
    else:
        try:  # (a rank that raised here would leave the others waiting in the gather below)
            native = native_class(index, max_bytes)
        except RuntimeError as error:
            why_not = f"its shared region: {error}"
    mine = (index, why_not, None if native is None else native.handle())
    everyone: list[Any] = [None] * tp.world_size
    dist.all_gather_object(everyone, mine, group=tp.group)
    reasons = [f"rank {r}: {why}" for r, (_, why, _) in enumerate(everyone) if why]
    indices = [i for i, _, _ in everyone]
    if not reasons and len(set(indices)) < len(indices):
        reasons.append(f"the ranks' devices {indices} are not distinct as this process sees them")
    if not reasons:
        reasons += [f"cuda:{index} has no peer access to cuda:{other}" for other in indices
                    if other != index and not torch.cuda.can_device_access_peer(index, other)]
    reasons = _agreed(tp, reasons)  # every rank must agree: one that lacks peer access tells the others
    if not reasons:
        try:
            native.connect(tp.rank, [handle for _, _, handle in everyone])
        except RuntimeError as error:  # (a container without a shared IPC namespace, say)
            reasons = [f"rank {tp.rank} cannot map the other ranks' memory: {error}"]
        # a gather, not a raise here: a rank that failed alone would leave the others waiting in the first sum
        reasons = _agreed(tp, reasons)
    if not reasons:
        peer = PeerAllReduce(native, max_bytes)
        reasons = _agreed(tp, _first_sum(peer, tp, device))
    if reasons:
        if mode == "peer":
            raise PeerAllReduceUnavailable("tp_all_reduce='peer' is not possible here: " + "; ".join(reasons))
        return None
    return peer


def _agreed(tp: TensorParallel, reasons: list[str]) -> list[str]:
    """Every rank's reasons not to use the peers' memory, on every rank (a collective)."""
    everyone: list[Any] = [None] * tp.world_size
    dist.all_gather_object(everyone, reasons, group=tp.group)
    return sorted({reason for rank_reasons in everyone for reason in rank_reasons})


def _first_sum(peer: PeerAllReduce, tp: TensorParallel, device: torch.device) -> list[str]:
    """One sum now, checked (why not, if it is wrong): the kernel's module is loaded while nothing else runs (a kernel
    loaded lazily while another waits for a peer can stall the device), and a mapping that does not work shows."""
    x = torch.full((16,), float(tp.rank + 1), device=device)
    peer.all_reduce(x)
    want = tp.world_size * (tp.world_size + 1) / 2
    if bool((x == want).all()):
        return []
    return [f"rank {tp.rank}: the first sum through the peers' memory gave {x[0].item()}, not {want}"]


def attach(tp: TensorParallel | None, device: torch.device, mode: str) -> TensorParallel | None:
    """tp with the all-reduce `mode` asks for: its own PeerAllReduce where it has one already and mode allows it
    (a model built again over the same ranks, e.g. `Model.with_options`, runs no collective), a new one otherwise."""
    if tp is None or tp.world_size < 2:
        return None
    if mode == "nccl":
        return dataclasses.replace(tp, peer=None) if tp.peer is not None else tp
    if tp.peer is not None:
        return tp
    peer = connect(tp, device, mode)
    return tp if peer is None else dataclasses.replace(tp, peer=peer)
