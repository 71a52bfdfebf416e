"""Admission control and request-size limits at the ingress, without Ray: folio.serve.admission, ServeConfig's
admission sizing, folio.serve.validation's limits (checked before any tokenizing)."""

from __future__ import annotations

import asyncio
import pickle

import pytest

pytest.importorskip("ray.serve")

from folio.serve.admission import MAX_RETRY_AFTER_S, MIN_RETRY_AFTER_S, Admission  # noqa: E402
from folio.serve.config import ConfigError, ServeConfig  # noqa: E402
from folio.serve.errors import InvalidRequest, Overloaded, http_retry_after  # noqa: E402
from folio.serve.schema import GenerationRequest, ModelInfo, ResponseFormat, Sampling  # noqa: E402
from folio.serve.validation import (  # noqa: E402
    RequestLimits,
    check_prompt_bytes,
    request_limits,
    to_engine_request,
)

INFO = ModelInfo(model_name="m", architecture="llama", dtype="float32", vocab_size=100, max_seq_len=64,
                 page_size=16, num_pages=8, max_batch_size=4, num_replicas=1, eos_token_ids=(2,), bos_token_id=1,
                 add_bos_token=True)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class NoTokenizer:
    """Fails the test if anything tokenizes: size limits must be checked first."""

    add_bos_token = False
    bos_token_id = None

    def encode(self, *args, **kwargs):
        raise AssertionError("the request was tokenized before its size was checked")

    def longest_token_bytes(self) -> int:
        return 7


def test_admission_runs_queues_then_refuses_and_hands_freed_slots_to_the_oldest_waiter():
    async def run():
        admission = Admission(2, max_waiting=2)
        order: list[str] = []
        release = {name: asyncio.Event() for name in "abcd"}

        async def request(name: str) -> None:
            async with admission.admitted():
                order.append(name)
                await release[name].wait()

        tasks = {name: asyncio.create_task(request(name)) for name in "abcd"}
        await asyncio.sleep(0.01)
        assert order == ["a", "b"] and admission.in_flight == 2 and admission.num_waiting == 2
        with pytest.raises(Overloaded) as info:  # 2 running, 2 waiting: a fifth is refused at once
            async with admission.admitted():
                pass
        assert info.value.retry_after_s is not None and "retry after" in str(info.value)
        assert admission.num_refused == 1
        release["b"].set()
        await asyncio.sleep(0.01)
        assert order == ["a", "b", "c"] and admission.in_flight == 2  # b's slot went to c, the oldest waiter
        tasks["d"].cancel()  # a waiter that leaves frees its place in the queue
        await asyncio.sleep(0.01)
        assert admission.num_waiting == 0
        release["a"].set()
        release["c"].set()
        await asyncio.gather(tasks["a"], tasks["b"], tasks["c"])
        assert admission.in_flight == 0 and order == ["a", "b", "c"]
        with pytest.raises(RuntimeError):  # a request that fails frees its slot too
            async with admission.admitted():
                raise RuntimeError("the request failed")
        assert admission.in_flight == 0

    asyncio.run(run())
    # Overloaded survives pickling (it crosses Ray as a cause) with its hint
    copy = pickle.loads(pickle.dumps(Overloaded("full", retry_after_s=2.5)))
    assert copy.retry_after_s == 2.5 and str(copy) == "full"


def test_a_slot_handed_to_a_waiter_that_left_goes_to_the_next_one():
    async def run():
        admission = Admission(1, max_waiting=2)
        first = asyncio.Event()

        async def holder():
            async with admission.admitted():
                await first.wait()

        got: list[str] = []

        async def waiter(name: str):
            async with admission.admitted():
                got.append(name)

        task = asyncio.create_task(holder())
        await asyncio.sleep(0)
        leaving, staying = asyncio.create_task(waiter("leaving")), asyncio.create_task(waiter("staying"))
        await asyncio.sleep(0.01)
        first.set()  # the slot is handed to "leaving" ...
        await asyncio.sleep(0)
        leaving.cancel()  # ... which is cancelled before it runs
        await asyncio.gather(task, staying, leaving, return_exceptions=True)
        assert "staying" in got and admission.in_flight == 0 and admission.num_waiting == 0

    asyncio.run(run())


def test_retry_hint_follows_the_completion_rate():
    async def run():
        clock = FakeClock()
        admission = Admission(4, clock=clock)
        assert admission.retry_after_s() == MIN_RETRY_AFTER_S  # nothing in flight: retry at once
        for _ in range(20):  # 20 requests finish over 10 s: 2 per second
            async with admission.admitted():
                clock.now += 0.5
        slots = [admission.admitted() for _ in range(4)]
        for slot in slots:
            await slot.__aenter__()
        with pytest.raises(Overloaded) as info:
            async with admission.admitted():
                pass
        assert info.value.retry_after_s == pytest.approx(0.5, rel=0.15)  # one slot frees in ~1/rate
        clock.now += 60  # nothing finished for a minute while 4 run: the longest hint
        assert admission.retry_after_s() == MAX_RETRY_AFTER_S
        for slot in slots:
            await slot.__aexit__(None, None, None)

    asyncio.run(run())
    assert http_retry_after(0.2) == "1" and http_retry_after(2.1) == "3"


def test_admission_limit_is_sized_from_the_replicas_capacity():
    config = ServeConfig(num_gpus=0, num_replicas=3, max_batch_size=8, max_queue_size=4, ingress_replicas=2)
    assert config.resolved_admission_limit == 3 * 12  # what the replicas take
    assert config.ingress_admission_limit == 18
    assert config.queued_requests == 12 and config.ingress_queue_limit == 6  # one replica's worth, shared
    assert config.replace(max_queued_requests=0).ingress_queue_limit == 0
    assert config.replace(admission_limit=5).ingress_admission_limit == 3
    with pytest.raises(ConfigError, match="max_queued_requests"):
        config.replace(max_queued_requests=-1)
    for name in ("max_stop_strings", "max_stop_string_chars", "max_list_items", "admission_limit",
                 "max_prompt_bytes"):
        with pytest.raises(ConfigError, match=name):
            config.replace(**{name: 0})


def test_the_prompt_byte_limit_follows_the_context_and_is_checked_before_tokenizing():
    config = ServeConfig(num_gpus=0)
    limits = request_limits(config, NoTokenizer(), INFO)
    assert limits.max_prompt_bytes == INFO.max_request_tokens * 7
    assert request_limits(config.replace(max_prompt_bytes=10), NoTokenizer(), INFO).max_prompt_bytes == 10
    huge = GenerationRequest(text="é" * 3_000_000)  # 6 MB of UTF-8
    with pytest.raises(InvalidRequest) as info:
        check_prompt_bytes(huge, limits)
    assert info.value.field == "text" and "6000000 bytes" in str(info.value)
    with pytest.raises(InvalidRequest) as info:
        to_engine_request(huge, NoTokenizer(), INFO, limits=limits)
    assert info.value.field == "text"
    negative = GenerationRequest(text="a", negative_text="x" * (limits.max_prompt_bytes + 1),
                                 sampling=Sampling(cfg_scale=2.0))
    with pytest.raises(InvalidRequest) as info:
        check_prompt_bytes(negative, limits)
    assert info.value.field == "negative_text"


@pytest.mark.parametrize("request_, field", [
    (GenerationRequest(token_ids=[5], stop_strings=["x"] * 4), "stop_strings"),
    (GenerationRequest(token_ids=[5], stop_strings=["ok", "y" * 11]), "stop_strings"),
    (GenerationRequest(token_ids=[5], stop_token_ids=[3] * 6), "stop_token_ids"),
    (GenerationRequest(token_ids=[5], banned_strings=["b"] * 6), "banned_strings"),
    (GenerationRequest(token_ids=[5], sampling=Sampling(token_bias={i: 1.0 for i in range(6)})), "token_bias"),
    (GenerationRequest(token_ids=[5], sampling=Sampling(dry_multiplier=1.0, dry_sequence_breakers=["a"] * 6)),
     "dry_sequence_breakers"),
    (GenerationRequest(token_ids=[5], response_format=ResponseFormat(choice=[str(i) for i in range(6)])),
     "response_format.choice"),
])
def test_list_fields_are_bounded_before_their_items_are_checked(request_, field):
    limits = RequestLimits(max_stop_strings=3, max_stop_string_chars=10, max_list_items=5)
    with pytest.raises(InvalidRequest) as info:
        to_engine_request(request_, NoTokenizer(), INFO, limits=limits)
    assert info.value.field == field


def test_requests_within_the_limits_pass():
    limits = RequestLimits(max_stop_strings=3, max_stop_string_chars=10, max_list_items=5)
    request = GenerationRequest(token_ids=[5], max_new_tokens=8, stop_strings=["a", "b" * 10, "c"],
                                stop_token_ids=[3] * 5, banned_strings=["z"] * 5)
    engine = to_engine_request(request, NoTokenizer(), INFO, limits=limits)
    assert engine.stop_conditions[-3:] == ("a", "b" * 10, "c") and len(engine.banned_strings) == 5


class FakeContext:
    def __init__(self) -> None:
        self.code = self.details = None
        self.trailing: tuple = ()

    def set_code(self, code) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing = tuple(metadata)


def test_the_proxy_gate_refuses_calls_beyond_its_bound_before_serve_handles_them(monkeypatch):
    import grpc

    from folio.serve import proxy_gate

    monkeypatch.setenv(proxy_gate.PROXY_LIMIT_ENV, "1")
    monkeypatch.setattr(proxy_gate, "_gate", None)
    calls: list[str] = []

    async def serve_unary(request, context):  # stands in for Serve's proxy method
        calls.append(request)
        await release.wait()
        return b"done"

    async def serve_stream(request, context):
        calls.append(request)
        yield b"one"

    async def run():
        unary = proxy_gate.gated("/folio.v1.Generation/GenerateUnary", serve_unary)
        stream = proxy_gate.gated("/folio.v1.Generation/Generate", serve_stream)
        first = asyncio.create_task(unary("a", FakeContext()))
        await asyncio.sleep(0.01)
        refused = FakeContext()
        assert await unary("b", refused) == b"" and calls == ["a"]  # Serve never saw "b"
        assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry after" in refused.details
        assert refused.trailing[0][0] == "retry-after" and float(refused.trailing[0][1]) > 0
        streamed = FakeContext()
        assert [m async for m in stream("c", streamed)] == [] and streamed.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        release.set()
        assert await first == b"done"
        assert [m async for m in stream("d", FakeContext())] == [b"one"]  # the slot is free again

    release = asyncio.Event()
    asyncio.run(run())
    # health checks and other services are never gated; without the bound there is no gate
    assert proxy_gate.gated("/grpc.health.v1.Health/Check", serve_unary) is serve_unary
    monkeypatch.delenv(proxy_gate.PROXY_LIMIT_ENV)
    assert proxy_gate.gated("/folio.v1.Generation/GenerateUnary", serve_unary) is serve_unary


def test_the_worker_setup_hook_patches_serve_only_once_serve_is_imported():
    """In a fresh interpreter, as in a Ray worker: the hook imports nothing of Serve itself; importing Serve then
    raises gRPC's pending-call limits and binds the gRPC proxy and the replicas' gRPC servers to the configured
    host, whichever of Serve's modules is imported first."""
    import subprocess
    import sys

    code = """
import os, sys
os.environ["FOLIO_GRPC_HOST"] = "127.0.0.1"
from folio.serve import proxy_setup
proxy_setup.setup_worker()
assert "ray.serve" not in sys.modules
from ray import serve
from ray.serve._private import constants, default_impl
options = dict(constants.DEFAULT_GRPC_SERVER_OPTIONS)
assert options["grpc.server.max_pending_requests"] == proxy_setup.MAX_PENDING_CALLS, options
bound = []
add = proxy_setup.bound_to("127.0.0.1", lambda server, address: bound.append(address))
add(None, "[::]:50051"); add(None, "0.0.0.0:0"); add(None, "10.1.2.3:7")  # (a host of its own is kept)
assert bound == ["127.0.0.1:50051", "127.0.0.1:0", "10.1.2.3:7"], bound
assert default_impl.add_grpc_address.folio_host == "127.0.0.1"
from ray.serve._private import replica
from ray._common import tls_utils
assert replica.add_port_to_grpc_server.folio_host == tls_utils.add_port_to_grpc_server.folio_host == "127.0.0.1"
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
