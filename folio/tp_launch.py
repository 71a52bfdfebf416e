"""Start the processes of a tensor-parallel replica on one machine (tests, benchmarks): one process per rank
(torch.multiprocessing, spawn), each in a torch.distributed process group (gloo on the CPU; NCCL with one GPU per
rank, rank r on GPU r), initialised through a file in a new temporary directory (no port to choose, none to collide
on when several replicas share a machine).

`launch(main, world_size, args)` runs main(tp, *args) on every rank and returns rank 0's result. `replica_main` is
such a main for a model directory: every rank loads its shard, rank 0 builds the cache with its Driver and runs
`drive(model, cache)` (a DynamicGenerator's jobs, say), and the other ranks run the worker loop until rank 0 is done.
main, drive and the arguments must be picklable (module-level functions): spawned processes import them afresh.

`start_local_ranks` is the serving form (folio.serve's replicas): the calling process becomes rank 0 and keeps
running (its generator serves requests); ranks 1.. are new processes that load their shards and run the worker loop
until rank 0's Driver shuts them down (`LocalRanks.close`).
"""

from __future__ import annotations

import gc
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from folio.kv_cache import Cache
from folio.model.decode_graphs import release_all
from folio.model.model import Model
from folio.model.tensor_parallel import TensorParallel
from folio.tp_worker import Driver, run_worker

T = TypeVar("T")
_POLL_S = 0.1  # how often the parent looks for a rank that died without a word
_EXIT_GRACE_S = 10.0  # after every rank reported: how long each may take to exit before it is killed
_FAILURE_GRACE_S = 2.0  # after a rank failed: how long to wait for the others' reports
# Served replicas: a worker waits for rank 0's next message inside a collective, for as long as no request comes.
SERVING_TIMEOUT_S = 365 * 24 * 3600.0


def launch(main: Callable[..., T], world_size: int, args: tuple = (), backend: str = "gloo",
           timeout_s: float = 600.0, num_threads: int | None = None) -> T:
    """Run main(tp, *args) in world_size new processes, one per rank; return rank 0's result (returned through
    pickle, as a copy).

    timeout_s: the limit of the whole run, and of each collective in it (the process group's timeout). When a rank
    fails (its traceback is in the error), dies, or the time runs out, every process is ended and RuntimeError
    (TimeoutError for the time) raised. num_threads: torch's intra-op threads in each process (None: its default;
    ranks sharing few cores want 1)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="folio-tp-") as rendezvous:
        init_method = (Path(rendezvous) / "init").as_uri()
        processes = [context.Process(target=_run_rank, name=f"folio-tp-rank{rank}", daemon=True,
                                     args=(rank, world_size, backend, init_method, timeout_s, num_threads, main, args,
                                           results))
                     for rank in range(world_size)]
        for process in processes:
            process.start()
        finished = False
        try:
            outcomes = _collect(processes, results, time.monotonic() + timeout_s)
            finished = True
        finally:
            _stop(processes, _EXIT_GRACE_S if finished else 0.0)
    return pickle.loads(outcomes[0])


class LocalRanks:
    """Ranks 1..world_size-1 of a replica whose rank 0 is this process (start_local_ranks)."""

    def __init__(self, tp: TensorParallel, processes: list, rendezvous: tempfile.TemporaryDirectory,
                 ready: Any) -> None:
        self.tp, self.processes, self._rendezvous, self._ready = tp, processes, rendezvous, ready
        self.driver: Driver | None = None

    def wait_ready(self, timeout_s: float = 1800.0) -> None:
        """Wait until every other rank has loaded its shard (their reports go through a host queue: a rank that
        failed or died is noticed here, not in rank 0's first collective, which could wait forever); RuntimeError
        with its traceback otherwise."""
        outcomes = _collect(self.processes, self._ready, time.monotonic() + timeout_s, first_rank=1)
        if len(outcomes) != len(self.processes):
            raise RuntimeError(f"tensor-parallel ranks reported {sorted(outcomes)} of {len(self.processes)}")

    def attach(self, cache: Cache) -> Cache:
        """Rank 0's cache, mirrored to the other ranks from now on (a Driver); returns it."""
        self.driver = Driver(self.tp, cache)
        self.driver.local_ranks = self
        return cache

    def close(self, grace_s: float = _EXIT_GRACE_S) -> None:
        """End the workers' loops, wait up to grace_s for their processes (then kill them), leave the group. Also
        after a failure: whatever step fails, the processes, the group and the rendezvous go."""
        try:
            if self.driver is not None and not self.driver.closed and all(p.is_alive() for p in self.processes):
                self.driver.shutdown()
        finally:
            _stop(self.processes, grace_s)
            if dist.is_initialized():
                leave_group()
            self._rendezvous.cleanup()


def start_local_ranks(model_dir: str | Path, world_size: int, model_kwargs: dict[str, Any] | None = None,
                      timeout_s: float = SERVING_TIMEOUT_S, num_threads: int | None = None) -> LocalRanks:
    """Make this process rank 0 of a tensor-parallel replica of the model in model_dir and start ranks 1.. as new
    processes on this machine, each loading its shard (Model.from_pretrained(model_dir, tensor_parallel=...,
    **model_kwargs)) and running the worker loop. model_kwargs' device "cuda" means NCCL with rank r on GPU r (of
    those this process sees: a Ray replica's); anything else gloo. Load rank 0's shard with `.tp`, `wait_ready`,
    then `attach(cache)` its cache; `close` on any failure. timeout_s: each collective's limit, which includes a
    worker's wait for rank 0's next message: a served replica may idle for days (SERVING_TIMEOUT_S)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"world_size must be an int >= 2, got {world_size!r}")
    model_kwargs = dict(model_kwargs or {})
    on_cuda = str(model_kwargs.get("device", "cpu")).startswith("cuda")
    if on_cuda and torch.cuda.device_count() < world_size:
        raise RuntimeError(f"tensor parallelism over {world_size} GPUs, but this process sees "
                           f"{torch.cuda.device_count()}")
    backend = "nccl" if on_cuda else "gloo"
    rendezvous = tempfile.TemporaryDirectory(prefix="folio-tp-")
    init_method = (Path(rendezvous.name) / "init").as_uri()
    context = mp.get_context("spawn")
    ready = context.Queue()
    processes = [context.Process(target=_serve_rank, name=f"folio-tp-rank{rank}", daemon=True,
                                 args=(rank, world_size, backend, init_method, timeout_s, num_threads, str(model_dir),
                                       model_kwargs, ready))
                 for rank in range(1, world_size)]
    for process in processes:
        process.start()
    try:
        if on_cuda:
            torch.cuda.set_device(0)
        tp = join_group(backend, init_method, 0, world_size, timeout_s)
    except BaseException:
        _stop(processes, 0.0)
        rendezvous.cleanup()
        raise
    return LocalRanks(tp, processes, rendezvous, ready)


def _serve_rank(rank: int, world_size: int, backend: str, init_method: str, timeout_s: float,
                num_threads: int | None, model_dir: str, model_kwargs: dict[str, Any], ready: Any) -> None:
    """A worker rank of start_local_ranks: its shard (reported ready, or its traceback), then the worker loop until
    rank 0 shuts it down."""
    try:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        if backend == "nccl":
            torch.cuda.set_device(rank)
            model_kwargs = {**model_kwargs, "device": f"cuda:{rank}"}
        tp = join_group(backend, init_method, rank, world_size, timeout_s)
        model = Model.from_pretrained(model_dir, tensor_parallel=tp, **{"progress": False, **model_kwargs})
    except BaseException:  # noqa: BLE001 - rank 0 reports it (LocalRanks.wait_ready)
        ready.put((rank, False, traceback.format_exc()))
        return
    ready.put((rank, True, b""))
    try:
        run_worker(model, tp)
    finally:
        del model
        leave_group()


def replica_main(tp: TensorParallel, model_dir: str | Path, drive: Callable[[Model, Cache], T],
                 model_kwargs: dict[str, Any] | None = None, cache_kwargs: dict[str, Any] | None = None) -> T | None:
    """One rank of a replica of the model in model_dir: Model.from_pretrained(model_dir, tensor_parallel=tp,
    **model_kwargs) on every rank; rank 0 builds Cache(model, **cache_kwargs) with its Driver, returns
    drive(model, cache) and then shuts the workers down; the other ranks serve until then (and return None)."""
    model = Model.from_pretrained(model_dir, tensor_parallel=tp, **{"progress": False, **(model_kwargs or {})})
    if tp.rank != 0:
        run_worker(model, tp)
        return None
    driver = Driver(tp, Cache(model, **(cache_kwargs or {})))
    try:
        return drive(model, driver.cache)
    finally:
        driver.shutdown()


def _run_rank(rank: int, world_size: int, backend: str, init_method: str, timeout_s: float,
              num_threads: int | None, main: Callable[..., Any], args: tuple, results: Any) -> None:
    try:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        tp = join_group(backend, init_method, rank, world_size, timeout_s)
        try:
            # pickled here, not by the queue: torch's queue would hand tensors over in shared memory, which needs
            # this process alive until the parent has read them
            value = pickle.dumps(main(tp, *args))
        except BaseException:  # noqa: BLE001 - reported before leaving the group: NCCL's destroy waits for ever
            results.put((rank, False, traceback.format_exc()))  # on a peer stuck inside a collective
            leave_group()
            return
        leave_group()
    except BaseException:  # noqa: BLE001 - whatever it is, the parent reports it
        results.put((rank, False, traceback.format_exc()))
        return
    results.put((rank, True, value))


def join_group(backend: str, init_method: str, rank: int, world_size: int, timeout_s: float) -> TensorParallel:
    """This rank in the default process group, and a gloo group of the same ranks for rank 0's message headers
    (TensorParallel.header_group; on the CPU too, where it is not faster, so that the CPU tests run the path GPUs
    take), with the same timeout: a served worker waits in it for the next request."""
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
    return TensorParallel.from_group(header_group=dist.new_group(backend="gloo", timeout=timeout))


def leave_group() -> None:
    """Leave the default process group, after this process's CUDA graphs and whatever holds them: NCCL's
    destroy of a communicator that a live graph captured waits for ever."""
    release_all()
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    dist.destroy_process_group()


def _collect(processes: list, results: Any, deadline: float, first_rank: int = 0) -> dict[int, bytes]:
    """Every rank's pickled result. At the first failure, the others' failures are awaited a moment (the first to
    report is often a rank that lost its peer, not the cause) and all are raised together; a rank that dies without a
    word and the deadline raise too. processes[i] is rank first_rank + i."""
    outcomes: dict[int, bytes] = {}
    failures: dict[int, str] = {}
    while len(outcomes) + len(failures) < len(processes):
        try:
            rank, ok, value = results.get(timeout=_POLL_S)
        except queue.Empty:
            ranks = range(first_rank, first_rank + len(processes))
            waiting = [r for r in ranks if r not in outcomes and r not in failures]
            dead = [r for r in waiting if processes[r - first_rank].exitcode is not None]
            if dead and results.empty():
                failures.update({r: f"exited with code {processes[r - first_rank].exitcode} without a result"
                                 for r in dead})
                break
            if time.monotonic() > deadline:
                if failures:
                    break
                raise TimeoutError(f"tensor-parallel ranks {waiting} did not finish in time") from None
            continue
        if ok:
            outcomes[rank] = value
        else:
            failures[rank] = value
            deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
    if failures:
        raise RuntimeError("\n".join(f"tensor-parallel rank {rank} failed:\n{text}"
                                     for rank, text in sorted(failures.items())))
    return outcomes


def _stop(processes: list, grace_s: float) -> None:
    """Wait up to grace_s for each process to exit, then kill what is left (only these processes, by handle)."""
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()
