"""A gRPC load generator for folio.v1.Generation: many concurrent calls from several client processes, so that the
client is not what limits a measurement (bench/flood.py, the overload tests).

    records = flood("127.0.0.1:50051", "folio", [request_message, ...], num_processes=2)
    records = closed_loop("127.0.0.1:50051", "folio", make_request, num_streams=64, duration_s=20)
    records = open_loop("127.0.0.1:50051", "folio", [request_message, ...], rate_per_s=8.0, stream=True)

Each call is a unary GenerateUnary (or a streaming Generate with stream=True) on grpc.aio; a record keeps its wall-clock
start / first message / end (time.time(), comparable across processes on one machine), its status code name, its
completion tokens and the server's retry hint (trailing metadata "retry-after", seconds) if it sent one. Streamed calls
also keep each token-carrying message's arrival time and token count (inter-token latency) and the finish's prompt /
cached token counts (prefix hits) and the replica that served them. `client_cpu_s`, where given, collects each client
process's CPU seconds over its calls (what the load cost the client).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from folio.serve.errors import REPLICA_KEY, RETRY_AFTER_KEY

# Concurrent calls per client channel (one HTTP/2 connection): servers cap the streams one connection carries.
CALLS_PER_CHANNEL = 100
# How long client processes may take to start and connect.
BARRIER_TIMEOUT_S = 120.0
# Client processes run at a lower priority: on a machine they share with the server they take CPU the server leaves
# idle, closer to clients on machines of their own (the load a client generates is then not the server's cost).
CLIENT_NICENESS = 10


@dataclass
class CallRecord:
    start_s: float
    end_s: float
    code: str  # grpc.StatusCode name
    completion_tokens: int = 0
    first_message_s: float | None = None
    retry_after_s: float | None = None
    details: str = ""
    message_s: list[float] | None = None  # streamed: arrival of each message that carried tokens
    message_tokens: list[int] | None = None  # streamed: tokens of each of those messages
    prompt_tokens: int = 0
    cached_tokens: int = 0
    replica: str = ""  # streamed: the generator replica that served it (the server's trailing metadata)
    server_ttft_s: float | None = None  # the finish's timings: arrival at the ingress to the first token there
    engine_ttft_s: float | None = None  # and in the replica's engine: enqueued to first token (queued + prefill)

    @property
    def latency_s(self) -> float:
        return self.end_s - self.start_s


async def _one_call(stub, message, metadata, timeout_s: float, stream: bool) -> CallRecord:
    import grpc

    start = time.time()
    first = None
    tokens = 0
    call = None
    times: list[float] | None = [] if stream else None
    counts: list[int] | None = [] if stream else None
    usage = timings = None
    try:
        if stream:
            call = stub.Generate(message, metadata=metadata, timeout=timeout_s)
            async for chunk in call:
                now = time.time()
                if first is None:
                    first = now
                if chunk.token_ids:
                    times.append(now)
                    counts.append(len(chunk.token_ids))
                if chunk.HasField("finish"):
                    usage, timings = chunk.finish.usage, chunk.finish.timings
            replica = dict(await call.trailing_metadata() or ()).get(REPLICA_KEY, "")
        else:
            call = stub.GenerateUnary(message, metadata=metadata, timeout=timeout_s)
            response = await call
            first = time.time()
            usage = response.finish.usage
            replica = ""
        if usage is not None:
            tokens = usage.completion_tokens
        return CallRecord(start, time.time(), "OK", tokens, first, message_s=times, message_tokens=counts,
                          prompt_tokens=usage.prompt_tokens if usage else 0,
                          cached_tokens=usage.cached_tokens if usage else 0, replica=replica,
                          server_ttft_s=timings.time_to_first_token_s if timings else None,
                          engine_ttft_s=timings.queued_s + timings.prefill_s if timings else None)
    except grpc.aio.AioRpcError as error:
        retry = None
        for key, value in error.trailing_metadata() or ():
            if key == RETRY_AFTER_KEY:
                retry = float(value)
        return CallRecord(start, time.time(), error.code().name, 0, first, retry, error.details() or "")


async def _connected(target: str, count: int, barrier) -> list:
    """`count` channels, connected; then wait (off the loop) until every client process is connected too, so that
    process start-up and imports never overlap the load."""
    import grpc

    channels = [grpc.aio.insecure_channel(target) for _ in range(max(1, count))]
    await asyncio.gather(*(c.channel_ready() for c in channels))
    await asyncio.get_running_loop().run_in_executor(None, barrier.wait, BARRIER_TIMEOUT_S)
    return channels


async def _flood_async(target: str, app: str, messages: Sequence[bytes], timeout_s: float, stream: bool,
                       calls_per_channel: int, barrier) -> list[CallRecord]:
    from folio.proto.folio.v1 import generation_pb2 as pb
    from folio.proto.folio.v1 import generation_pb2_grpc as pb_grpc

    metadata = (("application", app),)
    requests = [pb.GenerateRequest.FromString(m) for m in messages]
    channels = await _connected(target, -(-len(messages) // calls_per_channel), barrier)
    try:
        stubs = [pb_grpc.GenerationStub(c) for c in channels]
        calls = [_one_call(stubs[i % len(stubs)], r, metadata, timeout_s, stream) for i, r in enumerate(requests)]
        return list(await asyncio.gather(*calls))
    finally:
        await asyncio.gather(*(c.close() for c in channels))


def _flood_worker(args: tuple, barrier) -> list[CallRecord]:
    return asyncio.run(_flood_async(*args, barrier))


def flood(target: str, app: str, messages: Sequence, num_processes: int = 2, timeout_s: float = 600.0,
          stream: bool = False, calls_per_channel: int = CALLS_PER_CHANNEL,
          client_cpu_s: list[float] | None = None, niceness: int = CLIENT_NICENESS) -> list[CallRecord]:
    """Send every message at once, split over `num_processes` client processes that start together once all are
    connected, and wait for all the answers."""
    payloads = [m.SerializeToString() for m in messages]
    shares = [payloads[i::num_processes] for i in range(num_processes)]
    jobs = [(target, app, share, timeout_s, stream, calls_per_channel) for share in shares if share]
    return _run_processes(_flood_worker, jobs, timeout_s, client_cpu_s, niceness)


async def _closed_async(target: str, app: str, make_request: Callable[[int], object], stream_ids: Sequence[int],
                        duration_s: float, timeout_s: float, stream: bool, barrier) -> list[CallRecord]:
    from folio.proto.folio.v1 import generation_pb2_grpc as pb_grpc

    metadata = (("application", app),)
    channels = await _connected(target, -(-len(stream_ids) // CALLS_PER_CHANNEL), barrier)
    try:
        stubs = [pb_grpc.GenerationStub(c) for c in channels]
        end_at = time.time() + duration_s

        async def loop(i: int, stream_id: int) -> list[CallRecord]:
            out, n = [], 0
            while time.time() < end_at:
                out.append(await _one_call(stubs[i % len(stubs)], make_request(stream_id * 1_000_003 + n), metadata,
                                           timeout_s, stream))
                n += 1
            return out

        parts = await asyncio.gather(*(loop(i, s) for i, s in enumerate(stream_ids)))
        return [r for part in parts for r in part]
    finally:
        await asyncio.gather(*(c.close() for c in channels))


def _closed_worker(args: tuple, barrier) -> list[CallRecord]:
    return asyncio.run(_closed_async(*args, barrier))


def closed_loop(target: str, app: str, make_request: Callable[[int], object], num_streams: int, duration_s: float,
                num_processes: int = 2, timeout_s: float = 600.0, stream: bool = False,
                client_cpu_s: list[float] | None = None, niceness: int = CLIENT_NICENESS) -> list[CallRecord]:
    """`num_streams` callers, each sending its next request as soon as the last one ends, for `duration_s` from the
    moment every client process is connected; make_request(n) builds the n-th message (picklable: a top-level
    function or a partial of one). Calls still running at the end are waited for and recorded."""
    ids = list(range(num_streams))
    jobs = [(target, app, make_request, ids[i::num_processes], duration_s, timeout_s, stream)
            for i in range(num_processes) if ids[i::num_processes]]
    return _run_processes(_closed_worker, jobs, duration_s + timeout_s, client_cpu_s, niceness)


def poisson_arrivals_s(num_requests: int, rate_per_s: float, seed: int = 0) -> list[float]:
    """Send times (seconds after the start) of a Poisson process of `rate_per_s`: exponential gaps."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(rate_per_s)
        out.append(t)
    return out


async def _open_async(target: str, app: str, messages: Sequence[bytes], send_at_s: Sequence[float],
                      timeout_s: float, stream: bool, barrier) -> list[CallRecord]:
    from folio.proto.folio.v1 import generation_pb2 as pb
    from folio.proto.folio.v1 import generation_pb2_grpc as pb_grpc

    metadata = (("application", app),)
    requests = [pb.GenerateRequest.FromString(m) for m in messages]
    # enough channels for the calls that may be in flight at once (at most all of them)
    channels = await _connected(target, -(-len(messages) // CALLS_PER_CHANNEL), barrier)
    try:
        stubs = [pb_grpc.GenerationStub(c) for c in channels]
        # every process's clock starts at the barrier, so the processes' shares interleave as one Poisson process
        start = time.time()

        async def at(i: int, request) -> CallRecord:
            await asyncio.sleep(max(0.0, start + send_at_s[i] - time.time()))
            return await _one_call(stubs[i % len(stubs)], request, metadata, timeout_s, stream)

        return list(await asyncio.gather(*(at(i, r) for i, r in enumerate(requests))))
    finally:
        await asyncio.gather(*(c.close() for c in channels))


def _open_worker(args: tuple, barrier) -> list[CallRecord]:
    return asyncio.run(_open_async(*args, barrier))


def open_loop(target: str, app: str, messages: Sequence, rate_per_s: float, num_processes: int = 2,
              timeout_s: float = 600.0, stream: bool = False, seed: int = 0,
              client_cpu_s: list[float] | None = None) -> list[CallRecord]:
    """Send the messages in order at Poisson arrival times of `rate_per_s` (poisson_arrivals_s(seed)), whatever
    the answers (an open loop: a slow server sees calls pile up), from `num_processes` client processes; wait for
    all the answers."""
    payloads = [m.SerializeToString() for m in messages]
    send_at = poisson_arrivals_s(len(payloads), rate_per_s, seed)
    jobs = [(target, app, payloads[i::num_processes], send_at[i::num_processes], timeout_s, stream)
            for i in range(num_processes) if payloads[i::num_processes]]
    return _run_processes(_open_worker, jobs, (send_at[-1] if send_at else 0.0) + timeout_s, client_cpu_s)


def _process_main(worker: Callable, job: tuple, barrier, results, niceness: int) -> None:
    if niceness:
        os.nice(niceness)
    try:
        cpu_start = time.process_time()
        records = worker(job, barrier)
        results.put((records, time.process_time() - cpu_start))
    except BaseException as error:  # noqa: BLE001 — handed to the parent, which raises it
        barrier.abort()
        results.put(RuntimeError(f"client process failed: {error!r}"))


def _run_processes(worker: Callable, jobs: list[tuple], timeout_s: float,
                   client_cpu_s: list[float] | None = None, niceness: int = CLIENT_NICENESS) -> list[CallRecord]:
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(len(jobs))
    results = context.Queue()
    processes = [context.Process(target=_process_main, args=(worker, job, barrier, results, niceness),
                                 daemon=True) for job in jobs]
    for process in processes:
        process.start()
    try:
        parts = [results.get(timeout=timeout_s + BARRIER_TIMEOUT_S) for _ in processes]
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    for part in parts:
        if isinstance(part, BaseException):
            raise part
    if client_cpu_s is not None:
        client_cpu_s.extend(cpu for _, cpu in parts)
    return [record for records, _ in parts for record in records]


def tokens_per_s(records: Sequence[CallRecord], start_s: float | None = None, end_s: float | None = None) -> float:
    """Completion tokens of the OK calls per second of the window (default: first start to last end)."""
    ok = [r for r in records if r.code == "OK"]
    if not ok:
        return 0.0
    start = min(r.start_s for r in records) if start_s is None else start_s
    end = max(r.end_s for r in ok) if end_s is None else end_s
    return sum(r.completion_tokens for r in ok) / max(end - start, 1e-9)


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


SHORT_PROMPTS = ("The harbour at dawn", "Once upon a time", "The lighthouse keeper", "A letter arrived",
                 "In the old library", "The train left the station")


def short_request(n: int, max_new_tokens: int = 16):
    """The n-th request of a flood: a short prompt (a few distinct ones, so prefixes repeat as in real traffic),
    `max_new_tokens` sampled tokens that ignore EOS (every admitted request costs the same)."""
    from folio.proto.folio.v1 import generation_pb2 as pb

    message = pb.GenerateRequest(text=f"{SHORT_PROMPTS[n % len(SHORT_PROMPTS)]} ({n})",
                                 max_new_tokens=max_new_tokens, stop_on_eos=False, seed=n)
    return message
