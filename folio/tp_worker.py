"""Tensor-parallel replicas: rank 0 drives, the other ranks follow.

Rank 0 runs the whole engine over its shard of the model (folio.model.tensor_parallel) and of the K/V cache: the
scheduler, the page pool and the sampler, a DynamicGenerator as on one GPU. Its cache's mirror (Cache.mirror, a
`Driver`) sends each operation that writes cache tensors to the other ranks before rank 0 runs it: every forward
(Model.forward), every partial-page slot copy (Cache.copy_page_slots) and the host tier's copies (the generator's
host buffers are `MirroredHostPages`); the cache's geometry and the host tier's size go first. The other ranks run
`run_worker`: receive an operation, run it on their shard, until rank 0 shuts them down. Since every rank runs the
same forwards in the same order, they meet in the same collectives (each layer's two all-reduces, the logits'
all-gather) in the same order, and their caches hold the same pages under the same ids.

Messages: a header of HEADER_LEN int64 (the op and its integer arguments) broadcast from rank 0, then the op's
tensors: a forward's integer tensors concatenated into one int64 broadcast, its injected embedding rows (if any) a
second. The tensors are on the model's device, so any backend carries them (NCCL: the GPU; gloo: the CPU), and
nothing is pickled; they queue on the stream like the kernels. The header goes host to host through the gloo group
TensorParallel.header_group where there is one (folio.tp_launch makes it): a worker learns what to run next while
its GPU still runs the step before, and queues it behind (through NCCL, the header would wait for everything queued
before it on both GPUs, and every worker step would start with an idle GPU). A worker reads each header on the host
(what comes next depends on it; it waits for rank 0 anyway), and a prefill's per-sequence lengths (the flash prefill
plan reads them on the host).

Sampling: only rank 0 samples, and nothing it samples is sent: a sampled token reaches the workers as an input id of
the next forward (a step launched ahead feeds the sampled ids from the device: they are in that batch's input_ids).

CUDA graphs (folio.model.decode_graphs): each rank captures its own over its shard, the same buckets in the same
order (SETUP_GRAPHS starts the workers' capture beside rank 0's: the warm-up forwards all-reduce for real); a graph
starts with the broadcast of rank 0's input buffers into every rank's, and a replay is one message (REPLAY: the
bucket) before every rank replays its own graph. Rank 0's forwards inside its graphs are not sent (Driver.paused);
any other forward captured on rank 0 raises (it could not reach the other ranks).

Failures: a forward that fails on rank 0 after it was sent fails on every rank at the same point (the same code on
the same batch), so a worker logs it and goes on. A failure of one rank alone (out of memory on one GPU) leaves the
others in a collective that never completes: the process group's timeout ends them.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Sequence
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist

from folio.cache.host_tier import HostTransfers
from folio.host_pages import HostPages, default_host_cache_bytes, resolve_num_host_pages
from folio.kv_cache import Cache
from folio.kv_formats import FORMATS_BY_CODE
from folio.model.batch import ForwardBatch
from folio.model.model import Model
from folio.model.tensor_parallel import TensorParallel
from folio.sampling.host import to_device

logger = logging.getLogger(__name__)

HEADER_LEN = 16  # int64 values: the op, then its arguments (zeros past them)
_VALUE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # injected embedding rows, by code


class Op(IntEnum):
    SHUTDOWN = 0
    SETUP_CACHE = 1  # num_pages, page_size, kv format code (folio.kv_formats; 0: the model's dtype)
    SETUP_HOST = 2  # num_host_pages
    FORWARD = 3  # see encode_batch
    COPY_SLOTS = 4  # src_page, dst_page, num_slots
    WRITE_BACK = 5  # n; then [n, 2] (GPU page, host slot)
    FETCH = 6  # n; then [n, 2] (host slot, GPU page)
    SETUP_GRAPHS = 7  # max_batch_size, max_seq_len, capture (folio.model.decode_graphs, captured in lockstep)
    REPLAY = 8  # bucket: replay its decode graph (its inputs are broadcast inside it)


class Channel:
    """Rank 0's messages to the other ranks of its group, over broadcasts of tensors on `device`.

    Headers through the gloo group are handed to gloo's thread and not waited for: rank 0 goes on to launch its step
    while the bytes leave, instead of spending its host time, which bounds a large batch's step, on the send's round
    trip. At most MAX_PENDING_HEADERS are in flight; beyond that the oldest is waited for, and `flush` waits for all
    (a failed send raises there). Headers still arrive in order: gloo matches a group's broadcasts by sequence."""

    MAX_PENDING_HEADERS = 32

    def __init__(self, tp: TensorParallel, device: torch.device) -> None:
        self.tp, self.device = tp, device
        self._pending: deque[tuple[Any, torch.Tensor]] = deque()  # (gloo's work, the header it sends)

    def send(self, op: Op, *args: int, tensors: Sequence[torch.Tensor] = ()) -> None:
        if len(args) >= HEADER_LEN:
            raise ValueError(f"{op.name} has {len(args)} arguments; a header holds {HEADER_LEN - 1}")
        header = [int(op), *args] + [0] * (HEADER_LEN - 1 - len(args))
        if self.tp.header_group is not None:  # (host to host: waits for no GPU)
            values = torch.tensor(header, dtype=torch.int64)
            work = dist.broadcast(values, src=self.tp.driver_rank, group=self.tp.header_group, async_op=True)
            self._pending.append((work, values))
            while self._pending and (len(self._pending) > self.MAX_PENDING_HEADERS
                                     or self._pending[0][0].is_completed()):
                self._pending.popleft()[0].wait()  # (raises if that send failed)
        else:
            self.tp.broadcast(to_device(header, torch.int64, self.device))
        for tensor in tensors:
            self.tp.broadcast(tensor.contiguous())

    def flush(self) -> None:
        """Wait until every header handed to gloo has been sent."""
        while self._pending:
            self._pending.popleft()[0].wait()

    def receive(self) -> tuple[Op, list[int]]:
        if self.tp.header_group is not None:
            header = torch.empty(HEADER_LEN, dtype=torch.int64)
            dist.broadcast(header, src=self.tp.driver_rank, group=self.tp.header_group)
        else:
            header = self.tp.broadcast(torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device))
        values = header.tolist()  # (through `group`, a host sync: what to receive and run next depends on it)
        return Op(values[0]), values[1:]

    def receive_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.tp.broadcast(torch.empty(shape, dtype=dtype, device=self.device))


def encode_batch(batch: ForwardBatch) -> tuple[list[int], list[torch.Tensor]]:
    """A forward's header arguments and tensors (see decode_batch)."""
    parts = [batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables.flatten(), batch.cu_seqlens_q,
             batch.context_lens, batch.logits_idx]
    values = batch.injected_values
    if values is not None:
        parts.append(batch.injected_rows)
    ints = torch.cat([p.to(torch.int64) for p in parts])
    args = [batch.num_tokens, batch.num_seqs, batch.block_tables.shape[1], batch.logits_idx.shape[0],
            0 if values is None else values.shape[0], 0 if values is None else values.shape[1],
            0 if values is None else _VALUE_DTYPES.index(values.dtype),
            batch.max_q_len, batch.max_context_len, batch.total_context_len, int(bool(batch.seq_q_lens))]
    return args, [ints] if values is None else [ints, values]


def decode_batch(channel: Channel, args: list[int]) -> ForwardBatch:
    """Receive the tensors of a forward whose header arguments are `args` and rebuild its batch."""
    (num_tokens, num_seqs, table_width, num_logits, num_injected, hidden_size, value_dtype, max_q_len,
     max_context_len, total_context_len, has_lens) = args[:11]
    sizes = [num_tokens, num_tokens, num_tokens, num_seqs * table_width, num_seqs + 1, num_seqs, num_logits,
             num_injected]
    ints = channel.receive_tensor((sum(sizes),), torch.int64)
    input_ids, positions, slot_mapping, tables, cu_seqlens_q, context_lens, logits_idx, rows = ints.split(sizes)
    values = None
    if num_injected:
        values = channel.receive_tensor((num_injected, hidden_size), _VALUE_DTYPES[value_dtype])
    seq_q_lens = seq_context_lens = ()
    if has_lens:  # (host sync, in prefill steps only: the flash prefill plan reads these on the host)
        starts, seq_context_lens = cu_seqlens_q.tolist(), tuple(context_lens.tolist())
        seq_q_lens = tuple(end - start for start, end in zip(starts, starts[1:]))
    return ForwardBatch(
        input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
        block_tables=tables.view(num_seqs, table_width).to(torch.int32), cu_seqlens_q=cu_seqlens_q.to(torch.int32),
        context_lens=context_lens.to(torch.int32), logits_idx=logits_idx, max_q_len=max_q_len,
        max_context_len=max_context_len, total_context_len=total_context_len, seq_q_lens=seq_q_lens,
        seq_context_lens=seq_context_lens, injected_rows=rows if num_injected else None, injected_values=values)


class Driver:
    """Rank 0's mirror of its cache (folio.kv_cache.CacheMirror): sends each operation on the cache to the other
    ranks, which run it on their shards (`run_worker`). Attaches itself to `cache` and tells the workers its
    geometry; `shutdown` ends their loops."""

    def __init__(self, tp: TensorParallel, cache: Cache) -> None:
        if tp.rank != 0:
            raise ValueError(f"the driver is rank 0 (this is rank {tp.rank}: run_worker)")
        if cache.mirror is not None:
            raise ValueError("this cache has a mirror already")
        self.tp, self.cache = tp, cache
        self.channel = Channel(tp, cache.k.device)
        self.num_sent: Counter[Op] = Counter()  # messages sent, per op
        self.closed = False
        self.local_ranks = None  # the other ranks' processes when this process started them (folio.tp_launch)
        self.paused = False  # forwards not sent (DecodeGraphs' steps: the other ranks run their own graphs)
        self._send(Op.SETUP_CACHE, cache.num_pages, cache.page_size, cache.kv_format_code)
        cache.mirror = self

    def forward(self, batch: ForwardBatch) -> None:
        if batch.lora is not None:
            raise NotImplementedError("LoRA adapters are not supported under tensor parallelism")
        if self.paused:  # a decode graph's step: its inputs travel inside it (DecodeGraphs)
            return
        if self.cache.k.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a forward captured outside DecodeGraphs cannot reach the other ranks")
        args, tensors = encode_batch(batch)
        self._send(Op.FORWARD, *args, tensors=tensors)

    def copy_page_slots(self, src_page: int, dst_page: int, num_slots: int) -> None:
        self._send(Op.COPY_SLOTS, src_page, dst_page, num_slots)

    def setup_graphs(self, max_batch_size: int, max_seq_len: int, capture: bool) -> None:
        """The other ranks build their DecodeGraphs alike (the same buckets), capturing with rank 0's, in step."""
        self._send(Op.SETUP_GRAPHS, max_batch_size, max_seq_len, int(capture))

    def replay(self, bucket: int) -> None:
        self._send(Op.REPLAY, bucket)

    def build_host_pages(self, cache: Cache, host_cache_bytes: int | None) -> HostPages | None:
        """Host buffers on every rank, each for its share of every page; host_cache_bytes is the replica's (None:
        on CUDA the default of folio.host_pages for the replica's whole cache, 0 on the CPU), split evenly."""
        if cache is not self.cache:
            raise ValueError("build_host_pages is for the driver's own cache")
        if host_cache_bytes is None:  # (the ranks share the machine's memory: one replica's default, split)
            host_cache_bytes = default_host_cache_bytes(cache.bytes * self.tp.world_size) \
                if cache.k.device.type == "cuda" else 0
        if isinstance(host_cache_bytes, int) and not isinstance(host_cache_bytes, bool) and host_cache_bytes > 0:
            host_cache_bytes //= self.tp.world_size
        num_host_pages = resolve_num_host_pages(cache, host_cache_bytes)  # (checks the value)
        if num_host_pages == 0:
            return None
        self._send(Op.SETUP_HOST, num_host_pages)
        return MirroredHostPages(cache, num_host_pages, self)

    def send_transfers(self, op: Op, pairs: Sequence[tuple[int, int]]) -> None:
        if pairs:
            flat = [value for pair in pairs for value in pair]
            self._send(op, len(pairs), tensors=[to_device(flat, torch.int64, self.channel.device)])

    def shutdown(self) -> None:
        """End the workers' loops (once); the cache can no longer be written after it."""
        if not self.closed:
            self._send(Op.SHUTDOWN)
            self.channel.flush()
            self.closed = True

    def _send(self, op: Op, *args: int, tensors: Sequence[torch.Tensor] = ()) -> None:
        if self.closed:
            raise RuntimeError("the tensor-parallel workers were shut down: the cache can no longer be written")
        self.channel.send(op, *args, tensors=tensors)
        self.num_sent[op] += 1


class MirroredHostPages(HostPages):
    """Rank 0's host buffers: each copy is sent to the other ranks (which copy their shards' pages) before it runs.
    The other ranks run mirror copies as write-backs (their forwards wait for them): correct, without the overlap."""

    def __init__(self, cache: Cache, num_host_pages: int, driver: Driver) -> None:
        super().__init__(cache, num_host_pages)
        self.driver = driver

    def write_back(self, transfers: HostTransfers) -> None:
        self.driver.send_transfers(Op.WRITE_BACK, transfers.mirror + transfers.to_host)
        super().write_back(transfers)

    def fetch(self, transfers: HostTransfers) -> None:
        self.driver.send_transfers(Op.FETCH, transfers.from_host)
        super().fetch(transfers)

    def fetch_ahead(self, transfers: HostTransfers) -> None:
        self.driver.send_transfers(Op.FETCH, transfers.from_host)  # (the other ranks' forwards wait for them)
        super().fetch_ahead(transfers)


_SETUP_OPS = frozenset({Op.SETUP_CACHE, Op.SETUP_HOST, Op.SETUP_GRAPHS, Op.REPLAY})


def run_worker(model: Model, tp: TensorParallel) -> Counter[Op]:
    """The loop of every rank but 0 (model: the rank's shard): run each operation rank 0's Driver sends on this
    rank's cache, until rank 0 shuts down. Returns the number of messages received, per op."""
    return Worker(model, tp).run()


class Worker:
    def __init__(self, model: Model, tp: TensorParallel) -> None:
        if tp.rank == 0:
            raise ValueError("rank 0 drives (Driver); the worker loop is for the other ranks")
        self.model, self.tp = model, tp
        self.channel = Channel(tp, model.device)
        self.cache: Cache | None = None
        self.host_pages: HostPages | None = None
        self.graphs = None  # folio.model.decode_graphs.DecodeGraphs (SETUP_GRAPHS)
        self.num_received: Counter[Op] = Counter()

    def run(self) -> Counter[Op]:
        while True:
            op, args = self.channel.receive()
            self.num_received[op] += 1
            if op is Op.SHUTDOWN:
                return self.num_received
            try:
                if op in _SETUP_OPS:
                    self._setup(op, args)
                else:
                    self._run(op, args)
            except Exception:  # noqa: BLE001 - rank 0 failed alike (the same op on the same input): go on with the next
                logger.exception("tensor-parallel rank %d: %s failed", self.tp.rank, op.name)

    def _setup(self, op: Op, args: list[int]) -> None:
        if op is Op.SETUP_CACHE:
            num_pages, page_size, kv_format = args[:3]
            self.cache = Cache(self.model, num_tokens=num_pages * page_size, page_size=page_size,
                               kv_format=FORMATS_BY_CODE[kv_format] if kv_format else None)
        elif op is Op.SETUP_HOST:
            self.host_pages = HostPages(self._cache(), args[0])
        elif op is Op.SETUP_GRAPHS:
            from folio.model.decode_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self.model, self._cache(), args[0], args[1], capture=bool(args[2]))
        elif self.graphs is None:  # Op.REPLAY
            raise RuntimeError("rank 0 replayed a decode graph before setting them up")
        else:
            self.graphs.replay(args[0])

    def _run(self, op: Op, args: list[int]) -> None:
        """One operation on the cache; its tensors are received before anything can fail."""
        pairs: list[tuple[int, int]] = []
        batch = None
        if op is Op.FORWARD:
            batch = decode_batch(self.channel, args)
        elif op in (Op.WRITE_BACK, Op.FETCH):
            flat = self.channel.receive_tensor((2 * args[0],), torch.int64).tolist()
            pairs = list(zip(flat[0::2], flat[1::2]))
        if op is Op.FORWARD:
            self.model.forward(batch, self._cache())
        elif op is Op.COPY_SLOTS:
            self._cache().copy_page_slots(*args[:3])
        elif op is Op.WRITE_BACK:
            self._host_pages().write_back(HostTransfers(to_host=tuple(pairs)))
        elif op is Op.FETCH:
            self._host_pages().fetch(HostTransfers(from_host=tuple(pairs)))
        else:
            raise ValueError(f"unknown tensor-parallel op {op!r}")

    def _cache(self) -> Cache:
        if self.cache is None:
            raise RuntimeError("rank 0 sent a cache operation before the cache's setup")
        return self.cache

    def _host_pages(self) -> HostPages:
        if self.host_pages is None:
            raise RuntimeError("rank 0 sent a host-tier copy before the host tier's setup")
        return self.host_pages
