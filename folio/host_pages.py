"""HostPages: the device side of the host tier (folio.cache.host_tier): host buffers holding pages' K/V, and the
copies between them and the cache, run on their own CUDA stream.

A plan's transfers run as the bookkeeping requires (see folio.cache.host_tier): `write_back` (GPU -> host: mirror
copies of pages filled by forwards already launched, then the pages evicted without a mirror) before the plan's
slot copies, `fetch_ahead` (host -> GPU: the pages its prefix lookups found on the host) after them, beside the
plan's forward. Each waits on the device, never on the host. The copy stream first waits for the compute stream (the
forwards that filled the pages, and the last readers of pages being overwritten). The compute stream waits for
write-backs at once (nothing writes an evicted page before it is read), for a mirror copy only when the plan evicts
its page (`HostTransfers.wait_ticket`), and for fetches before the next plan's forward (`wait_fetched`: the plan's
own forward reads none of the pages they fill). Mirror copies and fetches otherwise run beside the forwards: that
is what write-through and fetching a step ahead buy. On the CPU the copies are plain, in order.

Host buffers: one per per-page tensor of the cache ([L, P, ...] on the device), [num_host_pages, L, ...] on the
host so a page is one contiguous block there (one DMA per page and tensor); pinned on CUDA so that the copies are
asynchronous.
"""

from __future__ import annotations

import os

import torch

from folio.cache.host_tier import HostTransfers
from folio.kv_cache import Cache

# Default host tier on CUDA: this share of the machine's RAM, at most twice the GPU cache and half of the memory
# available now (pinned memory cannot be swapped out; several replicas on one node should give host_cache_bytes).
DEFAULT_HOST_RAM_FRACTION = 0.25
DEFAULT_HOST_CACHE_MULTIPLE = 2
MAX_AVAILABLE_FRACTION = 0.5


def slot_bytes(cache: Cache) -> list[int]:
    """Bytes of one page of each per-page tensor (one host slot per tensor)."""
    return [t[:, 0].numel() * t.element_size() for t in cache.page_tensors()]


def resolve_num_host_pages(cache: Cache, host_cache_bytes: int | None) -> int:
    """Host slots for `host_cache_bytes` (None: the default on CUDA, see DEFAULT_HOST_RAM_FRACTION; 0 on the CPU).
    On CUDA the pinned allocator rounds each buffer up to a power of two: the count is the largest whose rounded
    buffers fit."""
    on_cuda = cache.page_tensors()[0].device.type == "cuda"
    if host_cache_bytes is None:
        host_cache_bytes = default_host_cache_bytes(cache.bytes) if on_cuda else 0
    if isinstance(host_cache_bytes, bool) or not isinstance(host_cache_bytes, int) or host_cache_bytes < 0:
        raise ValueError(f"host_cache_bytes must be an int >= 0 (0: no host tier), got {host_cache_bytes!r}")
    sizes = slot_bytes(cache)
    num = host_cache_bytes // sum(sizes)
    if on_cuda:
        def pinned_bytes(n: int) -> int:
            return sum(1 << max(0, (n * size - 1).bit_length()) for size in sizes)
        low, high = 0, num  # the largest n with pinned_bytes(n) <= host_cache_bytes
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if pinned_bytes(mid) <= host_cache_bytes else (low, mid - 1)
        num = low
    return num


# Where a container's memory limit is written (cgroup v2, then v1): in a Kubernetes pod the machine's RAM is not
# what this process may use.
CGROUP_MEMORY_LIMIT_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def default_host_cache_bytes(gpu_cache_bytes: int) -> int:
    """DEFAULT_HOST_RAM_FRACTION of the memory this process may use (the machine's RAM, or its container's limit
    when lower), at most DEFAULT_HOST_CACHE_MULTIPLE times the GPU cache and MAX_AVAILABLE_FRACTION of what is
    available now."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = os.sysconf("SC_PHYS_PAGES") * page
    container = container_memory_limit()
    if container is not None:
        total = min(total, container)
    limit = min(int(total * DEFAULT_HOST_RAM_FRACTION), DEFAULT_HOST_CACHE_MULTIPLE * gpu_cache_bytes)
    available = _available_bytes()
    return limit if available is None else min(limit, int(available * MAX_AVAILABLE_FRACTION))


def container_memory_limit(paths: tuple[str, ...] | None = None) -> int | None:
    """The first memory limit found in `paths` (default CGROUP_MEMORY_LIMIT_FILES) in bytes; None where there is
    none ("max", no file, or cgroup v1's "unlimited", a number near 2^63)."""
    for path in CGROUP_MEMORY_LIMIT_FILES if paths is None else paths:
        try:
            with open(path) as limit_file:
                text = limit_file.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            return int(text)
        return None
    return None


def _available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo; None where the kernel does not say (not Linux, or an old kernel)."""
    try:
        with open("/proc/meminfo") as meminfo:
            lines = meminfo.readlines()
    except OSError:
        return None
    found = [int(line.split()[1]) * 1024 for line in lines if line.startswith("MemAvailable:")]
    return found[0] if found else None


class HostPages:
    def __init__(self, cache: Cache, num_host_pages: int) -> None:
        if num_host_pages < 1:
            raise ValueError(f"num_host_pages must be >= 1, got {num_host_pages}")
        self.tensors = cache.page_tensors()
        self.device = self.tensors[0].device
        on_cuda = self.device.type == "cuda"
        self.num_host_pages = num_host_pages
        self.buffers = [torch.zeros((num_host_pages, t.shape[0], *t.shape[2:]), dtype=t.dtype, pin_memory=on_cuda)
                        for t in self.tensors]
        self.stream = torch.cuda.Stream(self.device) if on_cuda else None
        self._marks: dict[int, torch.cuda.Event] = {}  # plan ticket -> reached when its GPU -> host copies are done
        self._fetched: torch.cuda.Event | None = None  # reached when fetch_ahead's copies are done

    @property
    def bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def write_back(self, transfers: HostTransfers) -> None:
        """GPU -> host: the mirror copies, then the pages evicted without a mirror. What the plan writes afterwards
        on the current stream waits for the latter, and for the mirror copies named by `transfers.wait_ticket`."""
        if not transfers:
            return  # (most steps: nothing to copy or wait for)
        copies = [(self._host(slot), self._gpu(page)) for page, slot in transfers.mirror + transfers.to_host]
        if self.stream is None:
            self._run(copies)
            return
        compute = torch.cuda.current_stream(self.device)
        if copies:
            self.stream.wait_stream(compute)
            self._copy(copies)
            mark = torch.cuda.Event()
            mark.record(self.stream)
            self._marks[transfers.ticket] = mark
        if transfers.to_host:
            compute.wait_stream(self.stream)
        elif transfers.wait_ticket in self._marks:  # (a mark no longer kept was reached)
            compute.wait_event(self._marks[transfers.wait_ticket])
        while self._marks and next(iter(self._marks.values())).query():  # (the stream runs its copies in order)
            del self._marks[next(iter(self._marks))]

    def fetch(self, transfers: HostTransfers) -> None:
        """Host -> GPU copies of the pages found on the host; whatever comes next on the current stream waits for
        them."""
        self._run([(self._gpu(page), self._host(slot)) for slot, page in transfers.from_host])

    def fetch_ahead(self, transfers: HostTransfers) -> None:
        """The same copies, run beside what the current stream does next (the plan's forward, which reads none of
        their pages) until `wait_fetched`, which the next forward calls first."""
        if not transfers.from_host:
            return
        copies = [(self._gpu(page), self._host(slot)) for slot, page in transfers.from_host]
        if self.stream is None:
            self._run(copies)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # (the pages' last readers)
        self._copy(copies)
        self._fetched = torch.cuda.Event()
        self._fetched.record(self.stream)

    def wait_fetched(self) -> None:
        """Make the current stream wait for the last fetch_ahead's copies (no wait if there were none since)."""
        if self._fetched is not None:
            torch.cuda.current_stream(self.device).wait_event(self._fetched)
            self._fetched = None

    def _gpu(self, page_id: int) -> list[torch.Tensor]:
        return [t[:, page_id] for t in self.tensors]

    def _host(self, slot: int) -> list[torch.Tensor]:
        return [b[slot] for b in self.buffers]

    def _run(self, copies: list[tuple[list[torch.Tensor], list[torch.Tensor]]]) -> None:
        """Run copies that the compute stream waits for entirely, after everything queued on it."""
        if not copies:
            return
        if self.stream is None:
            for dst, src in copies:
                for d, s in zip(dst, src):
                    d.copy_(s)
            return
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        self._copy(copies)
        compute.wait_stream(self.stream)

    def _copy(self, copies: list[tuple[list[torch.Tensor], list[torch.Tensor]]]) -> None:
        with torch.cuda.stream(self.stream):
            for dst, src in copies:
                for d, s in zip(dst, src):
                    d.copy_(s, non_blocking=True)


def build_host_pages(cache: Cache, host_cache_bytes: int | None) -> HostPages | None:
    """The host tier's buffers for DynamicGenerator(host_cache_bytes=...), or None when it is off (0 slots)."""
    num = resolve_num_host_pages(cache, host_cache_bytes)
    return HostPages(cache, num) if num else None
