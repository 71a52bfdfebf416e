"""folio under overload and hostile requests, on a real local Ray cluster, called over real gRPC from client
processes (folio.serve.loadgen).

One cluster: application "folio" as `folio serve` deploys it (2 generator replicas of the demo model, batch 16,
engine queue 32). A flood of 1,000 requests at once gets only OK and RESOURCE_EXHAUSTED (with a retry hint), no
replica idles while admitted requests wait, and admitted requests finish in bounded time. A huge prompt or a large
stop list does not hold up a small request.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from fakes import free_port

pytestmark = pytest.mark.ray

grpc = pytest.importorskip("grpc")
pytest.importorskip("ray.serve")

FLOOD_REQUESTS = 1000
TOKENS = 16
# A small request may take this much longer while a hostile one is handled (the bound).
HEAD_OF_LINE_S = 0.5
# Admitted requests' p99 latency in the flood: several times what a quiet machine needs, for a loaded CI machine.
P99_BOUND_S = 45.0


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from folio.demo import write_demo_model
    from folio.serve import local
    from folio.serve.cli import DEMO_DEFAULTS
    from folio.serve.config import ServeConfig

    model_dir = write_demo_model(tmp_path_factory.mktemp("overload") / "demo-model")
    config = ServeConfig.from_dict({**DEMO_DEFAULTS, "model_path": str(model_dir), "grpc_port": free_port(),
                                    "http_port": free_port()})
    local.start_cluster(config)
    try:
        local.deploy(config)
        channel = grpc.insecure_channel(f"127.0.0.1:{config.grpc_port}")
        yield {"config": config, "channel": channel, "target": f"127.0.0.1:{config.grpc_port}"}
        channel.close()
    finally:
        local.shutdown()


def _stub(served):
    from folio.proto.folio.v1 import generation_pb2_grpc as pb_grpc

    return pb_grpc.GenerationStub(served["channel"])


def _small(served, text: str = "The harbour", **fields) -> float:
    """One small greedy request's latency in seconds (it must succeed)."""
    from folio.proto.folio.v1 import generation_pb2 as pb

    message = pb.GenerateRequest(text=text, max_new_tokens=4, stop_on_eos=False, **fields)
    start = time.monotonic()
    _stub(served).GenerateUnary(message, metadata=(("application", "folio"),), timeout=60)
    return time.monotonic() - start


def _sample_idle(stop: threading.Event, samples: list) -> None:
    """(time, requests waiting in the ingress's admission queue, {replica: (running, queued)}) every 0.25 s."""
    from ray import serve

    from folio.serve.client import replica_stats

    ingress = serve.get_app_handle("folio")
    while not stop.is_set():
        t = time.time()
        waiting = ingress.admission_stats.remote().result(timeout_s=10)["waiting"]
        stats = replica_stats("folio", timeout_s=5.0)
        samples.append((t, waiting, {r: (s["num_running"], s["num_queued"]) for r, s in stats.items()}))
        stop.wait(0.25)


def test_a_flood_gets_only_ok_or_resource_exhausted_and_no_replica_idles(served):
    import functools

    from folio.serve.loadgen import flood, percentile, short_request

    config = served["config"]
    samples: list = []
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_idle, args=(stop, samples), daemon=True)
    make = functools.partial(short_request, max_new_tokens=TOKENS)
    sampler.start()
    try:
        records = flood(served["target"], "folio", [make(i) for i in range(FLOOD_REQUESTS)], num_processes=2,
                        timeout_s=240)
    finally:
        stop.set()
        sampler.join(timeout=10)
    codes = Counter(r.code for r in records)
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, {
        code: next(r.details for r in records if r.code == code) for code in codes}
    ok = [r for r in records if r.code == "OK"]
    refused = [r for r in records if r.code == "RESOURCE_EXHAUSTED"]
    # the application runs what its replicas take, queues one replica's worth at the ingress, and refuses the rest
    assert config.resolved_admission_limit + config.queued_requests <= len(ok) < FLOOD_REQUESTS, codes
    assert all(r.completion_tokens == TOKENS for r in ok)
    assert refused and all(r.retry_after_s is not None and r.retry_after_s > 0 for r in refused)
    assert all("retry" in r.details and "Traceback" not in r.details for r in refused)
    # Refusals do not wait for service: no request waits in a queue only to be refused. (They do wait for the
    # proxy's loop to reach them in a burst, 1-6 s here depending on what else runs on the machine, so the bound
    # is relative: a refused call's median is at most the admitted ones' upper quartile.)
    assert percentile([r.latency_s for r in refused], 50) <= percentile([r.latency_s for r in ok], 75)
    # admitted requests wait only for those admitted before them (a few batches' worth, here about 3 s each on an
    # idle 2-core machine): bounded, where unbounded queues gave p50 61 s and a maximum of 233 s
    p50, p99 = percentile([r.latency_s for r in ok], 50), percentile([r.latency_s for r in ok], 99)
    assert p99 < P99_BOUND_S, (p50, p99)
    # No replica sat idle while requests waited in the ingress's queue (one sample of slack: the stats are read one
    # after the other, so a sample can catch a replica between a request that ended and the next one handed over).
    first = min(r.start_s for r in records)
    idle = [(round(t - first, 2), waiting, sorted(stats.values())) for t, waiting, stats in samples
            if waiting > 0 and any(running == queued == 0 for running, queued in stats.values())]
    assert sum(1 for _, waiting, _ in samples if waiting) >= 2, "the flood never filled the ingress's queue"
    assert len(idle) <= 1, f"{len(idle)} of {len(samples)} samples saw an idle replica while requests waited: {idle}"


def test_a_huge_prompt_is_refused_before_tokenizing_and_does_not_stall_others(served):
    from folio.proto.folio.v1 import generation_pb2 as pb

    baseline = max(_small(served) for _ in range(3))
    huge = pb.GenerateRequest(text="lorem ipsum " * 250_000, max_new_tokens=4)  # 3 MB
    errors: list = []

    def send_huge() -> None:
        try:
            _stub(served).GenerateUnary(huge, metadata=(("application", "folio"),), timeout=60)
        except grpc.RpcError as e:
            errors.append(e)

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(send_huge) for _ in range(3)]
        time.sleep(0.05)
        latency = _small(served)
        for f in futures:
            f.result(timeout=120)
    assert len(errors) == 3 and all(e.code() == grpc.StatusCode.INVALID_ARGUMENT for e in errors)
    assert errors[0].details().startswith("text: 3000000 bytes exceed the server's limit")
    assert latency < baseline + HEAD_OF_LINE_S, (baseline, latency)


def test_stop_lists_are_bounded_and_the_largest_allowed_does_not_stall_others(served):
    from folio.proto.folio.v1 import generation_pb2 as pb

    config = served["config"]
    stub = _stub(served)
    for stops, problem in (([f"stop {i}" for i in range(config.max_stop_strings + 1)], "stop strings exceed"),
                           (["x" * (config.max_stop_string_chars + 1)], "characters; the server's limit")):
        with pytest.raises(grpc.RpcError) as info:
            stub.GenerateUnary(pb.GenerateRequest(text="hi", max_new_tokens=4, stop_strings=stops),
                               metadata=(("application", "folio"),), timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and problem in info.value.details()
        assert info.value.details().startswith("stop_strings")

    # The largest allowed stop list on long generations that occupy both replicas, against the same generations
    # without stop strings: a small request beside them takes at most HEAD_OF_LINE_S longer.
    largest = [f"{i:03d}" + "q" * (config.max_stop_string_chars - 3) for i in range(config.max_stop_strings)]

    def small_beside(stop_strings: list[str]) -> float:
        heavy = pb.GenerateRequest(text="Once upon a time", max_new_tokens=200, stop_on_eos=False,
                                   stop_strings=stop_strings)
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(stub.GenerateUnary, heavy, metadata=(("application", "folio"),), timeout=120)
                       for _ in range(4)]
            time.sleep(1.0)  # the heavy requests are generating
            latency = _small(served)
            results = [f.result(timeout=180) for f in futures]
        assert all(r.finish.usage.completion_tokens == 200 for r in results)
        return latency

    baseline = small_beside([])
    latency = small_beside(largest)
    assert latency < baseline + HEAD_OF_LINE_S, (baseline, latency)
