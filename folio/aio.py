"""asyncio front end: DynamicGeneratorAsync / DynamicJobAsync.

The engine loop (`DynamicGenerator.iterate()`) runs in its own thread and never on the event loop, so streaming is
smooth however long a step takes. Jobs may be created from any task or event loop: each job remembers the loop it
was created on, and results are handed to it with `call_soon_threadsafe`. The sync generator is only ever touched
by the engine thread; other threads talk to it through a command inbox.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from folio.generator import DynamicGenerator, QueueFull
from folio.job import DynamicJob, JobState
from folio.results import Result
from folio.stats import StepStats

_END = object()  # put in a job's results when it ends without a final result (cancelled, generator closed)


class GeneratorClosed(RuntimeError):
    pass


@dataclass
class _Command:
    kind: str  # "enqueue" | "cancel" | "call"
    job: DynamicJobAsync | None
    done: asyncio.Future | None = None
    fn: Callable[[DynamicGenerator], Any] | None = None


class DynamicGeneratorAsync:
    """Owns a DynamicGenerator (pass one, or the DynamicGenerator constructor's keyword arguments).

    on_step: called on the engine thread with each step's StepStats (keep it cheap: it runs between steps)."""

    def __init__(self, generator: DynamicGenerator | None = None,
                 on_step: Callable[[StepStats], None] | None = None, **generator_kwargs: Any):
        if generator is None:
            generator = DynamicGenerator(**generator_kwargs)
        elif generator_kwargs:
            raise TypeError("pass either a DynamicGenerator or its constructor arguments, not both")
        self.generator = generator
        self._on_step = on_step
        self._inbox: deque[_Command] = deque()
        self._jobs: dict[DynamicJob, DynamicJobAsync] = {}  # sync job -> async job, engine thread only
        self._wake = threading.Condition()
        self._closed = False
        self._error: BaseException | None = None
        # enqueue commands submitted and not yet applied (under self._wake): jobs the engine has not seen yet
        self._num_unapplied_enqueues = 0
        self._last_command_time = time.monotonic()  # set by the engine thread after each batch of commands
        self._thread = threading.Thread(target=self._engine_loop, name="folio-engine", daemon=True)
        self._thread.start()

    # --- called from the event loop(s) ---

    def _submit(self, command: _Command) -> None:
        with self._wake:
            if self._closed:
                raise GeneratorClosed("the generator is closed")
            self._inbox.append(command)
            self._num_unapplied_enqueues += command.kind == "enqueue"
            self._wake.notify()

    def enqueue(self, job: DynamicJobAsync) -> None:
        # Validate here so a bad request fails in the caller's task, not later in its stream.
        self.generator.validate_job(job.job)
        bound = self.generator.max_queued_jobs
        with self._wake:
            queued = sum(1 for c in self._inbox if c.kind == "enqueue")
            if bound is not None and queued + self.generator.num_pending_jobs() >= bound:
                raise QueueFull(f"the generator's queue is full ({bound} waiting jobs)")
        self._submit(_Command("enqueue", job))

    async def cancel(self, job: DynamicJobAsync) -> None:
        """Cancel a job in any state; returns once its pages are released. Cancelling a finished job is a no-op."""
        done = asyncio.get_running_loop().create_future()
        try:
            self._submit(_Command("cancel", job, done))
        except GeneratorClosed:
            return
        await done

    async def run_in_engine(self, fn: Callable[[DynamicGenerator], Any]) -> Any:
        """Run `fn(generator)` on the engine thread between two steps and return its result: the safe way to read
        engine state (the page pool, the queue) from the event loop."""
        done = asyncio.get_running_loop().create_future()
        self._submit(_Command("call", None, done, fn))
        return await done

    @property
    def is_alive(self) -> bool:
        """False once the engine thread has ended (closed, or died)."""
        return self._thread.is_alive()

    async def close(self) -> None:
        """Stop the engine thread; jobs still running end (their iteration stops)."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    @property
    def num_remaining_jobs(self) -> int:
        """Jobs enqueued and not ended (those the engine thread has not taken in yet included); commands that are
        not jobs (run_in_engine calls, cancels) do not count."""
        with self._wake:
            return self._num_unapplied_enqueues + self.generator.num_remaining_jobs()

    @property
    def last_progress_time(self) -> float:
        """time.monotonic() when the engine thread last showed progress: the end of its last step, or of the last
        commands it applied (enqueues, cancels, run_in_engine calls). A thread blocked inside a step or a call shows
        none."""
        return max(self._last_command_time, self.generator.last_step_time)

    # --- engine thread ---

    def _engine_loop(self) -> None:
        while True:
            with self._wake:
                while not self._closed and not self._inbox and self.generator.num_remaining_jobs() == 0:
                    self._wake.wait()
                if self._closed:
                    break
                commands = list(self._inbox)
                self._inbox.clear()
            for command in commands:
                self._apply(command)
                if command.kind == "enqueue":
                    with self._wake:  # taken in (or dropped): the generator counts it from here on
                        self._num_unapplied_enqueues -= 1
            if commands:
                self._last_command_time = time.monotonic()
            if self.generator.num_remaining_jobs() == 0:
                continue
            try:
                results = self.generator.iterate()
                if self._on_step is not None:
                    self._on_step(self.generator.last_step_stats)
            except BaseException as error:  # noqa: BLE001 — a failed step must not kill the loop
                self._fail_all(error)
                continue
            self._deliver_all(results)
        self._shutdown()

    def _apply(self, command: _Command) -> None:
        ajob = command.job
        if command.kind == "call":
            try:
                value, error = command.fn(self.generator), None
            except Exception as e:  # noqa: BLE001 — handed to the caller
                value, error = None, e
            command.done.get_loop().call_soon_threadsafe(_settle, command.done, value, error)
        elif command.kind == "enqueue":
            if ajob.cancelled:
                return
            try:
                self.generator.enqueue(ajob.job)
            except Exception as error:  # noqa: BLE001 — e.g. the queue filled up meanwhile
                ajob._push(error)
                return
            self._jobs[ajob.job] = ajob
        elif command.kind == "cancel":
            ajob.cancelled = True
            if ajob.job in self._jobs:
                self.generator.cancel(ajob.job)
                del self._jobs[ajob.job]
            ajob._push(_END)
            if command.done is not None:
                command.done.get_loop().call_soon_threadsafe(_resolve, command.done)

    def _deliver_all(self, results: list[Result]) -> None:
        """A step's results, handed to each event loop in one call: waking a loop once per job (a write to its
        self-pipe each) cost the loop, and the engine thread the GIL, as much as the rest of a large batch's
        delivery."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for result in results:
            ajob = self._jobs.get(result.job)
            if ajob is None:
                continue
            if result.eos:
                del self._jobs[result.job]
            by_loop.setdefault(ajob._loop, []).append((ajob, result))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop closed: nobody is waiting for these results any more
                continue

    def _fail_all(self, error: BaseException) -> None:
        for ajob in list(self._jobs.values()):
            ajob._push(error)
        self._jobs.clear()
        self.generator.clear_queue()

    def _shutdown(self) -> None:
        for command in self._inbox:
            if command.done is not None:
                if command.kind == "call":
                    error = GeneratorClosed("the generator was closed")
                    command.done.get_loop().call_soon_threadsafe(_settle, command.done, None, error)
                else:
                    command.done.get_loop().call_soon_threadsafe(_resolve, command.done)
            if command.job is not None:
                command.job._push(_END)
        with self._wake:
            self._inbox.clear()
            self._num_unapplied_enqueues = 0
        for ajob in self._jobs.values():
            ajob._push(GeneratorClosed("the generator was closed before the job finished"))
        self._jobs.clear()
        self.generator.clear_queue()


def _put_all(items: list[tuple[DynamicJobAsync, Any]]) -> None:
    for ajob, item in items:
        ajob._put(item)


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _settle(future: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


class DynamicJobAsync:
    """Create inside a running event loop; `async for result in job` streams its results until eos, and
    `await job.next_results()` takes every result that has arrived at once.

    Results wait in the job's own list and wake its consumer only when it waits for them: a step's results reach
    the loop in one call (see _deliver_all), so a consumer that takes them in batches (a server pacing its
    messages) costs the loop a list append per token, not a task switch."""

    def __init__(self, generator: DynamicGeneratorAsync, **job_kwargs: Any):
        self.generator = generator
        self.job = DynamicJob(**job_kwargs)
        self.cancelled = False
        self._loop = asyncio.get_running_loop()
        self._items: deque[Any] = deque()  # results, errors and _END, in order (event loop only)
        self._waiter: asyncio.Future | None = None  # set while the consumer waits for an item
        self._ended = False
        generator.enqueue(self)

    def _push(self, item: Any) -> None:  # engine thread
        self._loop.call_soon_threadsafe(self._put, item)

    def _put(self, item: Any) -> None:  # event loop
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __aiter__(self) -> DynamicJobAsync:
        return self

    async def __anext__(self) -> Result:
        results = await self.next_results(limit=1)
        if not results:
            raise StopAsyncIteration
        return results[0]

    async def next_results(self, limit: int | None = None) -> list[Result]:
        """The results that have arrived (at most `limit`), waiting until there is one; [] once the job has
        ended (where `async for` stops). Raises what `async for` raises (the job's error), after the results that
        came before it have been returned."""
        while not self._ended and not self._items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self.ready_results(limit)

    def ready_results(self, limit: int | None = None) -> list[Result]:
        """The results that have arrived (at most `limit`) without waiting: [] when none has (or the job
        ended); raises as next_results."""
        out: list[Result] = []
        items = self._items
        while items and not self._ended and (limit is None or len(out) < limit):
            item = items[0]
            failure = item if isinstance(item, BaseException) else (
                item.error if item is not _END and item.eos else None)
            if failure is not None and out:
                break  # (raised by the next call, after these)
            items.popleft()
            if item is _END:
                self._ended = True
                break
            if failure is not None:
                self._ended = True
                raise failure
            out.append(item)
            self._ended = item.eos
        return out

    async def cancel(self) -> None:
        if self.job.state in (JobState.FINISHED, JobState.CANCELLED):
            self._ended = True
            return
        await self.generator.cancel(self)
        self._ended = True
