"""CUDA-graph capture of decode steps.

A decode step (every sequence feeds one token) launches a few hundred small kernels; on a fast GPU their launch
cost rivals the work. We capture `Model.forward` once per batch-size bucket over static input buffers and replay
it: the host only fills the buffers (pinned memory, non-blocking copies) and replays.

Padding rows (batch 5 runs in the bucket of 8) write nowhere (slot -1) and attend to one slot of page 0; their
logits are dropped. The attention kernels size their grid from the block-table width, which is fixed at capture
(enough pages for `max_seq_len`), so the same graph serves every context length.

LoRA (folio.lora): once the generator loads its first adapter, `enable_lora` captures every bucket again with the
masked update over the adapters' slot buffers in it (folio.lora.slots), each row's slot read from one more static
buffer (-1: the base model, and padding rows). Adapters then come and go by writing slots, with nothing to capture
again; steps without adapter rows replay the same graphs, every row on slot -1.

capture=False runs each replay as an eager forward over the same static buffers, on any device: CPU tests of
everything a captured step does but the capture itself (the host's filling of the buffers, padding rows, LoRA
slots, the batch the graphs are captured from).

Tensor parallelism (model.tensor_parallel): every rank holds DecodeGraphs of the same buckets (rank 0's cache
mirror has the others build theirs, folio.tp_worker's SETUP_GRAPHS) and captures them in the same order, so their
collectives meet. A step's graph starts with a broadcast of rank 0's input buffers into every rank's (a captured
collective, like the layers' all-reduces); rank 0 announces each replay (REPLAY, outside the graph) and every rank
replays its graph of that bucket.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from folio.kv_cache import Cache
from folio.lora.apply import LoraBatch
from folio.lora.slots import LoraSlots
from folio.model.batch import ForwardBatch
from folio.model.model import Model

STAGING_SETS = 4  # enough that a draft pass of a few forwards rarely waits for the device to catch up
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


# Every DecodeGraphs alive in this process, for release_all (a tensor-parallel rank leaving its process group).
_LIVE: weakref.WeakSet[DecodeGraphs] = weakref.WeakSet()


def release_all() -> None:
    """Drop every captured graph of this process (no graph replays after it: a process calls this as it leaves
    its tensor-parallel group). NCCL must not destroy a communicator while a CUDA graph that captured its collectives
    exists: its destroy then waits for ever, so a tensor-parallel rank releases its graphs first."""
    for graphs in list(_LIVE):
        graphs.drop()
    _LIVE.clear()


class DecodeGraphs:
    def __init__(self, model: Model, cache: Cache, max_batch_size: int, max_seq_len: int, capture: bool = True):
        self.on_cuda = model.device.type == "cuda"
        if capture and not self.on_cuda:
            raise ValueError("CUDA graphs need a model on a CUDA device")
        self.capture = capture
        self.model = model
        self.cache = cache
        self.page_size = cache.page_size
        self.max_blocks = math.ceil(max_seq_len / self.page_size)
        self.buckets = [b for b in BATCH_BUCKETS if b < max_batch_size] + [max_batch_size]
        self._allocate_buffers(max_batch_size)
        self.lora_slots: LoraSlots | None = None  # the LoRA slot buffers the graphs read (enable_lora)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self.tp = model.tensor_parallel
        self.driver = cache.mirror  # rank 0 of a tensor-parallel replica: its link to the other ranks (else None)
        if self.driver is not None:
            self.driver.setup_graphs(max_batch_size, max_seq_len, capture)
        self._capture_all()
        _LIVE.add(self)

    # --- construction steps ---

    def _allocate_buffers(self, n: int) -> None:
        device = self.model.device
        self._inputs = _InputRegion(n, self.max_blocks, device)  # what the host fills each step, in one buffer
        self.input_ids, self.positions, self.slot_mapping, self.row_slots = self._inputs.ids  # row_slots: LoRA's
        self.block_tables, self.context_lens = self._inputs.tables, self._inputs.lens
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.logits_idx = torch.arange(n, dtype=torch.int64, device=device)
        # Host staging, pinned so the copies are queued on the stream instead of blocking. A ring of sets used in
        # turn: the host may fill the next run's inputs while earlier runs' copies are still queued on the device
        # (a step launched ahead; a draft model's forwards, several per step). A set is refilled only once the
        # copies out of it have run (its event), or the host would overwrite inputs the device has not read yet.
        self._staging = [_HostStaging(n, self.max_blocks, self.on_cuda) for _ in range(STAGING_SETS)]
        self._next_staging = 0

    def _batch(self, b: int) -> ForwardBatch:
        """The static buffers as bucket b's batch (inside a capture: the LoRA mask is computed in the graph)."""
        lora = None if self.lora_slots is None else LoraBatch.for_graph(self.lora_slots, self.row_slots[:b])
        return ForwardBatch(
            input_ids=self.input_ids[:b], positions=self.positions[:b], slot_mapping=self.slot_mapping[:b],
            block_tables=self.block_tables[:b], cu_seqlens_q=self.cu_seqlens_q[: b + 1],
            context_lens=self.context_lens[:b], logits_idx=self.logits_idx[:b],
            max_q_len=1, max_context_len=self.max_blocks * self.page_size, lora=lora)

    def _capture_all(self) -> None:
        if not self.capture:
            return
        pool = torch.cuda.graph_pool_handle()
        # Largest first: smaller graphs then fit in the memory the larger one already reserved.
        for b in sorted(self.buckets, reverse=True):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._step(b)  # warm-up: lazy initialisation stays out of the graph
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[b] = self._step(b)
            self._graphs[b] = graph
        torch.cuda.synchronize()

    def enable_lora(self, slots: LoraSlots) -> None:
        """Capture every bucket again with the LoRA update over `slots` in it (once: when the generator loads its
        first adapter, between steps). The device finishes what is queued first (a step launched ahead replays
        the graphs being replaced); the buffers are reset so that the captures' warm-up forwards write no K/V."""
        if self.lora_slots is not None:
            raise ValueError("the decode graphs read LoRA slots already")
        if self.tp is not None:
            raise NotImplementedError("LoRA adapters are not supported under tensor parallelism")
        if self.on_cuda:
            torch.cuda.synchronize()
        self.slot_mapping.fill_(-1)
        self.context_lens.fill_(1)
        self.block_tables.zero_()
        self.input_ids.zero_()
        self.positions.zero_()
        self.row_slots.fill_(-1)
        self.lora_slots = slots
        # The old graphs' pool goes back before the new captures allocate theirs (a logits buffer that a step
        # launched ahead still holds stays alive until it is sampled).
        self.drop()
        if self.capture:
            torch.cuda.empty_cache()
        self._capture_all()

    def drop(self) -> None:
        """Let go of the captured graphs and their output buffers (nothing replays until captured again)."""
        self._graphs.clear()
        self._logits.clear()

    # --- use ---

    def replay(self, bucket: int) -> torch.Tensor:
        """Replay bucket's graph on whatever its input buffers hold (`run` fills them first; alone, the last run's
        inputs: the device side of a decode step, for benchmarks). Returns the bucket's logits buffer."""
        if self.driver is not None:
            self.driver.replay(bucket)
        if not self.capture:
            return self._step(bucket)
        self._graphs[bucket].replay()
        return self._logits[bucket]

    def _step(self, b: int) -> torch.Tensor:
        """Bucket b's forward over the static buffers (what a graph captures). Tensor parallelism: rank 0's inputs
        broadcast into every rank's buffers first, and rank 0's forward not sent (each rank runs this itself)."""
        if self.tp is None:
            return self.model.forward(self._batch(b), self.cache)
        self.tp.broadcast(self._inputs.prefix(b))  # (one message: the first b rows' inputs are one prefix)
        if self.driver is None:
            return self.model.forward(self._batch(b), self.cache)
        self.driver.paused = True
        try:
            return self.model.forward(self._batch(b), self.cache)
        finally:
            self.driver.paused = False

    def bucket_for(self, num_seqs: int) -> int | None:
        return next((b for b in self.buckets if b >= num_seqs), None)

    def run(self, token_ids: Sequence[int] | torch.Tensor, positions: Sequence[int],
            block_tables: Sequence[Sequence[int]], row_slots: Sequence[int] | None = None) -> torch.Tensor:
        """One decode step: row i feeds token_ids[i] at positions[i] through block_tables[i], with the LoRA adapter
        of slot row_slots[i] (-1 or row_slots None: the base model; needs enable_lora). token_ids may be a device
        tensor (int64, ids >= 0: tokens sampled by a step whose results the host has not read yet).
        Returns fp32 logits [len(positions), vocab] (a view into graph memory, valid until the next run)."""
        num_seqs = len(positions)
        b = self.bucket_for(num_seqs)
        if b is None:
            raise ValueError(f"{num_seqs} sequences exceed the largest captured batch ({self.buckets[-1]})")
        if row_slots is not None and self.lora_slots is None:
            raise ValueError("row_slots given, but the decode graphs were captured without LoRA (enable_lora)")
        staging = self._staging[self._next_staging]
        self._next_staging = (self._next_staging + 1) % len(self._staging)
        staging.wait_until_read()
        size = self.page_size
        ids, lens, tables = staging.np_ids, staging.np_lens, staging.np_tables
        on_device = isinstance(token_ids, torch.Tensor)
        if not on_device:
            ids[0, :num_seqs] = token_ids
        ids[1, :num_seqs] = positions
        ids[3, :num_seqs] = -1 if row_slots is None else row_slots
        pos = ids[1, :num_seqs]
        used = pos // size + 1  # pages each row reads
        if int(used.max()) > self.max_blocks:
            raise ValueError(f"position {int(pos.max())} is beyond the captured context "
                             f"({self.max_blocks * size} tokens)")
        # All rows' pages in one flat array, scattered into the table rows (a Python loop of numpy slice
        # assignments costs ~3 us a row: most of a 256-row step's input preparation).
        flat = np.fromiter(itertools.chain.from_iterable(
            itertools.islice(table, n) for table, n in zip(block_tables, used.tolist())), dtype=np.int32)
        row_of = np.repeat(np.arange(num_seqs), used)
        starts = np.cumsum(used) - used
        tables[row_of, np.arange(flat.shape[0]) - np.repeat(starts, used)] = flat
        ids[2, :num_seqs] = flat[starts + used - 1].astype(np.int64) * size + pos % size
        lens[:num_seqs] = pos + 1
        # Padding rows: write nowhere, read one slot of page 0.
        ids[:, num_seqs:b] = 0
        ids[2:, num_seqs:b] = -1
        lens[num_seqs:b] = 1
        # one copy: the staging set has the device buffer's layout (rows past b go along: no graph of b reads them)
        self._inputs.prefix(b).copy_(staging.region.prefix(b), non_blocking=True)
        if on_device:
            self.input_ids[:num_seqs].copy_(token_ids)
        staging.mark_queued()
        return self.replay(b)[:num_seqs]


class _InputRegion:
    """A decode step's inputs for n rows in one byte buffer: [4, n] int64 (token ids, positions, cache slots, LoRA
    slots), [n] int32 context lengths, then [n, max_blocks] int32 block tables. The inputs of bucket b's rows are
    then one prefix of it (the small arrays whole, the first b table rows): one copy from the host a step, and under
    tensor parallelism one broadcast to the other ranks instead of five."""

    def __init__(self, n: int, max_blocks: int, device: torch.device, pinned: bool = False):
        ids_bytes, lens_bytes = 8 * 4 * n, _round16(4 * n)
        self.small_bytes, self.row_bytes = ids_bytes + lens_bytes, 4 * max_blocks
        self.bytes = torch.zeros(_round16(self.small_bytes + n * self.row_bytes), dtype=torch.uint8, device=device)
        if pinned:
            self.bytes = self.bytes.pin_memory()
        self.ids = self.bytes[:ids_bytes].view(torch.int64).view(4, n)
        self.lens = self.bytes[ids_bytes:ids_bytes + 4 * n].view(torch.int32)
        self.tables = self.bytes[self.small_bytes:self.small_bytes + n * self.row_bytes].view(torch.int32)
        self.tables = self.tables.view(n, max_blocks)
        self.ids[2:].fill_(-1)  # cache slots and LoRA slots: -1 (write nowhere; the base model)
        self.lens.fill_(1)

    def prefix(self, b: int) -> torch.Tensor:
        """The bytes that hold rows [0, b) of every input (whole 16-byte vectors)."""
        return self.bytes[:_round16(self.small_bytes + b * self.row_bytes)]


def _round16(num_bytes: int) -> int:
    return -(-num_bytes // 16) * 16


class _HostStaging:
    """Pinned host buffers of one step's graph inputs (the device buffer's layout), with numpy views to fill them
    cheaply."""

    def __init__(self, n: int, max_blocks: int, pinned: bool):
        self.region = _InputRegion(n, max_blocks, torch.device("cpu"), pinned)
        self.ids, self.lens, self.tables = self.region.ids, self.region.lens, self.region.tables
        self._pinned = pinned
        self.np_ids = self.ids.numpy()
        self.np_lens = self.lens.numpy()
        self.np_tables = self.tables.numpy()
        self._read = None  # recorded after the copies out of these buffers

    def wait_until_read(self) -> None:
        """Block until the device has copied the inputs last staged here (at once when it has)."""
        if self._read is not None and not self._read.query():
            self._read.synchronize()

    def mark_queued(self) -> None:
        if not self._pinned:  # (CPU: the copies have run)
            return
        if self._read is None:
            self._read = torch.cuda.Event()
        self._read.record()
