"""folio served by Ray Serve on a local cluster (loopback), called by real gRPC clients and the Python handle client.

One cluster for the module: application "folio" (ingress + 2 generator replicas of the demo model, CPU, a 4096-token
cache of 16-token pages), application "small" (1 replica that takes 1 running + 1 queued request, 1 more may wait
at the caller) for the queue-full case, and application "spec" (1 replica drafting with n-grams) for speculative
decoding. The replica-kill test runs last: it takes a replica of "folio" down.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from fakes import free_port, wait_for

pytestmark = pytest.mark.ray

grpc = pytest.importorskip("grpc")
pytest.importorskip("ray.serve")

LONG_PROMPT = ("The lighthouse keeper climbed the spiral stairs every evening, counting the steps and listening to "
               "the sea below the rocks while the lamp warmed")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from folio.demo import write_demo_model
    from folio.serve import local
    from folio.serve.config import ServeConfig

    model_dir = write_demo_model(tmp_path_factory.mktemp("serving") / "demo-model")
    main = ServeConfig(model_path=str(model_dir), num_gpus=0, num_cpus=0.5, ingress_num_cpus=0.2, num_replicas=2,
                       cache_tokens=4096, page_size=16, max_batch_size=32, max_queue_size=32,
                       grpc_port=free_port(), http_port=free_port(), app_name="folio")
    small = main.replace(app_name="small", num_replicas=1, num_cpus=0.2, ingress_num_cpus=0.1, cache_tokens=1024,
                         max_batch_size=1, max_queue_size=1, max_queued_requests=1)
    spec = main.replace(app_name="spec", num_replicas=1, num_cpus=0.2, ingress_replicas=1, ingress_num_cpus=0.1,
                        ngram=True)
    # (Ray's 2 CPUs on a 2-core machine: 1.8 taken by the apps above)
    by_ray = main.replace(app_name="ray", num_replicas=1, num_cpus=0.1, ingress_replicas=1, ingress_num_cpus=0.05,
                          token_channel=False)
    metrics_port = free_port()
    local.start_cluster(main, metrics_export_port=metrics_port)
    try:
        local.deploy(main)
        local.deploy(small)
        local.deploy(spec)
        local.deploy(by_ray)
        channel = grpc.insecure_channel(f"127.0.0.1:{main.grpc_port}")
        yield {"main": main, "small": small, "channel": channel, "metrics_port": metrics_port}
        channel.close()
    finally:
        local.shutdown()


def _stub(served):
    from folio.proto.folio.v1 import generation_pb2_grpc as pb_grpc

    return pb_grpc.GenerationStub(served["channel"])


def _md(app: str = "folio"):
    return (("application", app),)


def _request(text: str | None = None, **fields):
    from folio.proto.folio.v1 import generation_pb2 as pb

    sampler = fields.pop("sampler", {})
    message = pb.GenerateRequest(**fields)
    if text is not None:
        message.text = text
    for name, value in sampler.items():
        setattr(message.sampler, name, value)
    return message


def _greedy(**fields):
    return {"sampler": {"temperature": 0.0, "top_k": 1}, "stop_on_eos": False, **fields}


def _stream(stub, message, app="folio", timeout=120):
    return list(stub.Generate(message, metadata=_md(app), timeout=timeout))


def _in_use(stats) -> int:
    """Pages held by running jobs, from a routing digest (folio.router.digest)."""
    return stats["num_pages"] - stats["num_allocatable_pages"]




# --- calls ----------------------------------------------------------------------------------------------------


def test_streaming_generate(served):
    from folio.proto.folio.v1 import generation_pb2 as pb

    stub = _stub(served)
    prompt_ids = stub.Tokenize(pb.TokenizeRequest(text="Once upon a time"), metadata=_md()).token_ids
    messages = _stream(stub, _request("Once upon a time", max_new_tokens=20, **_greedy()))
    assert len(messages) >= 2, "the completion arrives in several messages"
    assert all(not m.HasField("finish") for m in messages[:-1])
    final = messages[-1].finish
    assert final.reason == pb.FINISH_REASON_MAX_NEW_TOKENS
    assert sum(len(m.token_ids) for m in messages) == 20
    assert final.usage.completion_tokens == 20
    assert final.usage.prompt_tokens == len(prompt_ids)
    assert 0 < final.timings.time_to_first_token_s <= final.timings.total_s


def test_unary_equals_stream_and_token_prompts(served):
    from folio.proto.folio.v1 import generation_pb2 as pb

    stub = _stub(served)
    streamed = _stream(stub, _request("The harbour", max_new_tokens=12, **_greedy()))
    unary = stub.GenerateUnary(_request("The harbour", max_new_tokens=12, **_greedy()), metadata=_md(), timeout=60)
    assert unary.text == "".join(m.text for m in streamed)
    assert list(unary.token_ids) == [t for m in streamed for t in m.token_ids]
    assert unary.finish.usage.completion_tokens == 12
    ids = stub.Tokenize(pb.TokenizeRequest(text="The harbour"), metadata=_md()).token_ids
    by_ids = _request(None, max_new_tokens=12, **_greedy())
    by_ids.token_ids.ids.extend(ids)
    assert stub.GenerateUnary(by_ids, metadata=_md(), timeout=60).token_ids == unary.token_ids


def test_model_info(served):
    from folio.proto.folio.v1 import generation_pb2 as pb

    info = _stub(served).ModelInfo(pb.ModelInfoRequest(), metadata=_md())
    assert (info.architecture, info.page_size, info.num_pages, info.num_replicas) == ("LlamaForCausalLM", 16, 256, 2)
    assert info.max_seq_len == 4096 and info.vocab_size == 1000 and list(info.eos_token_ids)
    # the demo model's float32 K and V, every layer; no host tier on a CPU unless asked
    demo = json.loads((Path(served["main"].model_path) / "config.json").read_text())
    head_dim = demo["head_dim"]
    assert (info.weight_format, info.kv_format) == ("dense", "fp32")
    assert info.bytes_per_page == 2 * demo["num_hidden_layers"] * 16 * demo["num_key_value_heads"] * head_dim * 4
    assert (info.num_host_pages, info.host_cache_bytes) == (0, 0)


def test_prefix_cache_hits_are_reported(served):
    stub = _stub(served)
    cached = []
    for _ in range(4):  # two replicas: from the third call on, the replica that gets it has seen the prompt
        final = _stream(stub, _request(LONG_PROMPT, max_new_tokens=2, **_greedy()))[-1].finish
        cached.append(final.usage.cached_tokens)
    assert cached[0] < 16, cached  # at most a partial page shared with an earlier test's prompt
    assert max(cached) >= 32, cached  # whole 16-token pages of this prompt came from the prefix cache


def test_32_concurrent_streams_complete_with_exact_lengths(served):
    stub = _stub(served)

    def one(i: int) -> tuple[int, int, int]:
        lengths = 8 + i % 9
        messages = _stream(stub, _request(f"Story {i}: the keeper", max_new_tokens=lengths,
                                          sampler={"temperature": 0.8, "top_p": 0.9}, stop_on_eos=False, seed=i))
        return lengths, sum(len(m.token_ids) for m in messages), messages[-1].finish.usage.completion_tokens

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    assert [(want, want) for want, _, _ in results] == [(got, n) for _, got, n in results]


def test_cancel_mid_stream_frees_pages(served):
    """Clients that cancel mid-stream cancel their jobs: every page they held is released long before the jobs
    could have run to their end. Streams are cancelled one after another (the proxy is busy writing when the
    cancellation arrives: ray 2.60's proxy loses that one, see folio.serve.grpc_servicer) and then several at once."""
    from folio.router.digest import parse_digest
    from folio.serve.client import replica_stats

    stub = _stub(served)
    max_new_tokens = 4000

    def start(i: int):
        return stub.Generate(_request(f"{LONG_PROMPT} {i}", max_new_tokens=max_new_tokens, **_greedy()),
                             metadata=_md(), timeout=120)

    def read_then_cancel(call, num_tokens: int) -> int:
        received = 0
        for message in call:
            received += len(message.token_ids)
            if received >= num_tokens:
                break
        call.cancel()
        return received

    def freed():
        stats = replica_stats("folio")
        return len(stats) == 2 and all(_in_use(s) == 0 and s["num_running"] == 0 for s in stats.values())

    start_s = time.monotonic()
    first = start(0)
    received = [read_then_cancel(first, 20)]
    tokens_per_s = received[0] / (time.monotonic() - start_s)
    received += [read_then_cancel(start(i), 5 + 7 * i) for i in range(1, 6)]
    calls = [start(i) for i in range(6, 12)]
    busy = wait_for(lambda: [s for s in replica_stats("folio").values() if _in_use(s) > 0], 10)
    assert busy and sum(s["num_running"] for s in busy) >= 1, "streams hold pages while they run"
    with ThreadPoolExecutor(len(calls)) as pool:
        received += pool.map(read_then_cancel, calls, [3 + 4 * i for i in range(len(calls))])
    cancelled_s = time.monotonic()
    assert wait_for(freed, 10), replica_stats("folio")
    freed_after_s = time.monotonic() - cancelled_s
    assert freed_after_s < 0.5 * (max_new_tokens - max(received)) / tokens_per_s, (freed_after_s, tokens_per_s)
    stats = replica_stats("folio")
    assert any(s["num_allocatable_pages"] > s["num_free_pages"] for s in stats.values()), \
        "released pages stay cached for reuse"
    one = parse_digest(next(iter(stats.values())))
    assert one.page_size == 16 and one.epoch >= 1 and one.seq >= 1 and one.batches


@pytest.mark.parametrize("text, fields, field", [
    ("hello", {"max_new_tokens": -5}, "max_new_tokens"),
    ("hello", {"sampler": {"temperature": -0.5}}, "temperature"),
    ("hello", {"sampler": {"top_p": 1.5}}, "top_p"),
    ("hello", {"sampler": {"top_k": -1}}, "top_k"),
    ("hello", {"sampler": {"repetition_penalty": 0.0}}, "repetition_penalty"),
    ("", {}, "text"),
    (None, {}, "prompt"),
    ("hello", {"max_new_tokens": 5000}, "max_new_tokens"),
    ("hello", {"stop_strings": [""]}, "stop_strings"),
    ("hello", {"stop_token_ids": [100000]}, "stop_token_ids"),
    ("hello", {"min_new_tokens": 10, "max_new_tokens": 5}, "min_new_tokens"),
    ("hello", {"return_top_tokens": 1000}, "return_top_tokens"),
    ("hello", {"sampler": {"presence_penalty": -1e308}}, "presence_penalty"),  # inf in fp32 logits
])
def test_bad_requests_are_invalid_argument_naming_the_field(served, text, fields, field):
    stub = _stub(served)
    for call in (lambda m: _stream(stub, m), lambda m: stub.GenerateUnary(m, metadata=_md(), timeout=30)):
        with pytest.raises(grpc.RpcError) as info:
            call(_request(text, **fields))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = info.value.details()
        assert details.startswith(field + ": "), details
        assert "Traceback" not in details and len(details) < 300


def test_prompt_longer_than_the_context_is_invalid_argument(served):
    message = _request(None, max_new_tokens=4)
    message.token_ids.ids.extend([42] * 5000)
    with pytest.raises(grpc.RpcError) as info:
        _stream(_stub(served), message)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("prompt: 5000 tokens")
    message = _request(None, max_new_tokens=4)
    message.token_ids.ids.extend([42, 5000])
    with pytest.raises(grpc.RpcError) as info:
        _stream(_stub(served), message)
    assert info.value.details().startswith("token_ids: [1] = 5000 is outside the vocabulary")


def test_a_token_bias_that_bans_every_token_is_invalid_argument(served):
    message = _request("hello", max_new_tokens=4)
    message.sampler.token_bias.update(dict.fromkeys(range(1000), float("-inf")))
    with pytest.raises(grpc.RpcError) as info:
        _stream(_stub(served), message)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("token_bias: ") and "nothing is left to sample" in info.value.details()


def test_malformed_request_bytes_are_invalid_argument(served):
    """Bytes that are not a GenerateRequest: INVALID_ARGUMENT from the proxy (folio.serve.grpc_servicer), not grpc's
    UNKNOWN naming a Python class."""
    channel = served["channel"]
    unary = channel.unary_unary("/folio.v1.Generation/GenerateUnary", request_serializer=None,
                                response_deserializer=None)
    stream = channel.unary_stream("/folio.v1.Generation/Generate", request_serializer=None,
                                  response_deserializer=None)
    for call in (lambda b: unary(b, metadata=_md(), timeout=30), lambda b: list(stream(b, metadata=_md(), timeout=30))):
        with pytest.raises(grpc.RpcError) as info:
            call(b"\xff\xff\xff\xff")
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert info.value.details().startswith("malformed request: ") and "<class" not in info.value.details()
    # the same channel and methods still serve well-formed requests
    good = _request("The harbour", max_new_tokens=3, **_greedy()).SerializeToString()
    from folio.proto.folio.v1 import generation_pb2 as pb

    assert len(pb.GenerateUnaryResponse.FromString(unary(good, metadata=_md(), timeout=60)).token_ids) == 3


def test_queue_full_is_resource_exhausted(served):
    # "small": 1 running + 1 queued in its replica, 1 waiting at the caller; the rest must be refused.
    stub = _stub(served)
    codes: list = []
    lock = threading.Lock()

    def one(i: int) -> None:
        try:
            _stream(stub, _request(f"queue {i}", max_new_tokens=48, **_greedy()), app="small", timeout=120)
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                assert "retry" in e.details() and "Traceback" not in e.details()
        with lock:
            codes.append(code)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(8)))
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 1, codes
    assert codes.count(grpc.StatusCode.OK) >= 2, codes


def test_metrics_are_exported(served):
    """After the calls above, Ray's metrics agent serves folio's counters, histograms and gauges (Prometheus)."""
    import urllib.request

    wanted = ["ray_folio_requests_total", "ray_folio_time_to_first_token_seconds_bucket",
              "ray_folio_time_per_output_token_seconds_bucket", "ray_folio_generated_tokens_total",
              "ray_folio_prompt_tokens_total", "ray_folio_cached_prompt_tokens_total",
              "ray_folio_prefix_cache_hit_rate", "ray_folio_pages_in_use", "ray_folio_engine_steps_total",
              "ray_folio_engine_decode_rows_total", "ray_folio_engine_running_jobs", "ray_folio_replica_format_info",
              "ray_folio_kv_page_bytes", "ray_folio_host_tier_pages"]

    def scrape():
        url = f"http://127.0.0.1:{served['metrics_port']}/metrics"
        try:
            body = urllib.request.urlopen(url, timeout=5).read().decode()
        except OSError:
            return None
        found = {line.split("{")[0].split(" ")[0] for line in body.splitlines() if line.startswith("ray_folio_")}
        missing[:] = [name for name in wanted if name not in found]
        return None if missing else body

    missing = list(wanted)
    body = wait_for(scrape, timeout_s=40, interval_s=1.0)
    assert body is not None, f"folio's metrics did not all appear on the metrics endpoint: missing {missing}"
    generated = [float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
                 if line.startswith("ray_folio_generated_tokens_total{")]
    assert sum(generated) > 0
    steps = [float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
             if line.startswith("ray_folio_engine_steps_total{")]
    assert sum(steps) > 0
    ok = [line for line in body.splitlines() if line.startswith("ray_folio_requests_total{") and 'status="OK"' in line]
    assert ok and sum(float(line.rsplit(" ", 1)[1]) for line in ok) > 0
    formats = [line for line in body.splitlines() if line.startswith("ray_folio_replica_format_info{")]
    assert formats and all('kv_format="fp32"' in line and 'weight_format="dense"' in line for line in formats)


def test_gauges_stay_exported_while_the_server_is_idle(served):
    """Ray's metrics agent drops a gauge series that no worker reported for two export intervals (20 s by
    default); the replicas set every gauge again on each routing-stats poll, so the hit rate of an idle server stays
    on the endpoint (it vanished ~30 s after the last request when it was set only as requests ended)."""
    import urllib.request

    import ray

    interval_s = max(ray._config.metrics_report_interval_ms(), 1000) / 1000

    def hit_rates() -> list[str]:
        try:
            body = urllib.request.urlopen(f"http://127.0.0.1:{served['metrics_port']}/metrics", timeout=5).read()
        except OSError:
            return []
        return [line for line in body.decode().splitlines()
                if line.startswith("ray_folio_prefix_cache_hit_rate{") and 'app="folio"' in line]

    _stub(served).GenerateUnary(_request(LONG_PROMPT, max_new_tokens=2, **_greedy()), metadata=_md(), timeout=60)
    idle_since = time.monotonic()
    assert wait_for(hit_rates, timeout_s=3 * interval_s + 10, interval_s=1.0), "the hit rate was never exported"
    # past the agent's TTL (two intervals) after the export that follows the last request
    time.sleep(max(0.0, idle_since + 3 * interval_s + 5 - time.monotonic()))
    assert hit_rates(), "the hit rate vanished from the endpoint while the server was idle"


def test_speculative_app_completes_as_the_plain_one_and_exports_its_acceptance_rate(served):
    """Application "spec" drafts with n-grams: greedy completions equal "folio"'s, responses count the drafts, and
    its replica exports them. Its drafts are all from the calls here (the warm-up's steps are not counted)."""
    import urllib.request

    stub = _stub(served)
    prompt = "one two three four, one two three four, one two three four, one two three four,"
    plain = stub.GenerateUnary(_request(prompt, max_new_tokens=40, **_greedy()), metadata=_md(), timeout=60)
    unary = stub.GenerateUnary(_request(prompt, max_new_tokens=40, **_greedy()), metadata=_md("spec"), timeout=60)
    streamed = _stream(stub, _request(prompt, max_new_tokens=40, **_greedy()), app="spec")
    assert list(unary.token_ids) == list(plain.token_ids) == [t for m in streamed for t in m.token_ids]
    assert plain.finish.usage.accepted_draft_tokens == plain.finish.usage.rejected_draft_tokens == 0
    usages = [unary.finish.usage, streamed[-1].finish.usage]
    for usage in usages:
        assert usage.accepted_draft_tokens + usage.rejected_draft_tokens > 0
        assert usage.accepted_draft_tokens <= usage.completion_tokens == 40
    num_drafted = sum(u.accepted_draft_tokens + u.rejected_draft_tokens for u in usages)
    num_accepted = sum(u.accepted_draft_tokens for u in usages)

    wanted = {"ray_folio_engine_drafted_tokens_total": num_drafted,
              "ray_folio_engine_accepted_draft_tokens_total": num_accepted,
              "ray_folio_engine_draft_acceptance_rate": num_accepted / num_drafted}
    seen = {}

    def spec_values_match() -> bool:
        try:
            body = urllib.request.urlopen(f"http://127.0.0.1:{served['metrics_port']}/metrics", timeout=5).read()
        except OSError:
            return False
        for line in body.decode().splitlines():
            if line.startswith("ray_folio_engine_") and 'app="spec"' in line:
                seen[line.split("{")[0]] = float(line.rsplit(" ", 1)[1])
        # the replica publishes its totals every routing-stats poll (1 s): wait for those of the calls above
        return all(name in seen and seen[name] == pytest.approx(value) for name, value in wanted.items())

    assert wait_for(spec_values_match, timeout_s=40, interval_s=1.0), f"wanted {wanted}, the endpoint has {seen}"


def test_token_channel_app_streams_as_the_ray_stream_does(served):
    """Application "folio" streams over the token channel (the default: chunks reach the ingress over TCP), "ray"
    as Ray items (token_channel false): greedy streams with probabilities and top tokens are equal, unary calls too;
    on the channel, concurrent streams complete with exact lengths and a stream the client leaves frees its pages."""
    assert served["main"].token_channel
    from folio.serve.client import replica_stats

    stub = _stub(served)
    fields = dict(max_new_tokens=24, return_probs=True, return_top_tokens=3, **_greedy())
    plain = _stream(stub, _request("The harbour at dawn", **fields), app="ray")
    chan = _stream(stub, _request("The harbour at dawn", **fields))

    def flat(messages, name):
        return [x for m in messages for x in getattr(m, name)]

    assert flat(chan, "token_ids") == flat(plain, "token_ids") and len(flat(chan, "token_ids")) == 24
    assert flat(chan, "token_probs") == pytest.approx(flat(plain, "token_probs"))
    top_ids = [[list(t.token_ids) for t in flat(messages, "top_tokens")] for messages in (chan, plain)]
    assert top_ids[0] == top_ids[1] and len(top_ids[0]) == 24
    assert "".join(m.text for m in chan) == "".join(m.text for m in plain)
    assert chan[-1].finish.usage.completion_tokens == 24 and chan[-1].finish.timings.time_to_first_token_s > 0
    unary = stub.GenerateUnary(_request("The harbour at dawn", **fields), metadata=_md(), timeout=60)
    assert list(unary.token_ids) == flat(plain, "token_ids")

    def one(i: int) -> tuple[int, int]:
        messages = _stream(stub, _request(f"Story {i}", max_new_tokens=6 + i, **_greedy()))
        return 6 + i, sum(len(m.token_ids) for m in messages)

    with ThreadPoolExecutor(12) as pool:
        assert all(want == got for want, got in pool.map(one, range(12)))

    call = stub.Generate(_request(LONG_PROMPT + " !", max_new_tokens=3000, **_greedy()), metadata=_md(), timeout=120)
    received = 0
    for message in call:
        received += len(message.token_ids)
        if received >= 5:
            break
    call.cancel()
    assert wait_for(lambda: all(_in_use(s) == 0 and s["num_running"] == 0 for s in replica_stats("folio").values()),
                    20), replica_stats("folio")


def test_the_cluster_serves_through_its_haproxy(served):
    """The default ingress mode (folio.serve.ingress_mode): HAProxy, started with this cluster's files, in front of
    the ingress replicas; the calls of every other test here went through it."""
    from folio.serve import ingress_mode, local

    assert served["main"].ingress_mode == "direct" and local._haproxy is not None
    assert ingress_mode._processes_with_argument_under(local._haproxy.directory)


def test_python_handle_client_streams(served):
    from folio.serve.client import Client
    from folio.serve.errors import InvalidRequest

    client = Client("folio")
    chunks = list(client.stream_sync("Once upon a time", max_new_tokens=10, stop_on_eos=False, temperature=0.0))
    assert sum(len(c.token_ids) for c in chunks) == 10 and chunks[-1].finish.usage.completion_tokens == 10

    async def run():
        streamed = [c async for c in client.stream([0, 42, 71], max_new_tokens=6, stop_on_eos=False, seed=3)]
        completion = await client.complete([0, 42, 71], max_new_tokens=6, stop_on_eos=False, seed=3)
        with pytest.raises(InvalidRequest) as info:
            await client.complete("x", top_p=2.0)
        return streamed, completion, info.value

    streamed, completion, error = asyncio.run(run())
    assert [t for c in streamed for t in c.token_ids] == completion.token_ids and len(completion.token_ids) == 6
    assert error.field == "top_p"
    assert (client.complete_sync("hi", max_new_tokens=3, stop_on_eos=False).finish.usage.completion_tokens == 3)


def test_replica_killed_mid_stream_is_unavailable(served):
    """Runs last: it takes one of the two "folio" replicas down (Serve starts a replacement)."""
    import ray

    from folio.serve.client import generator_replicas, replica_stats

    stub = _stub(served)
    call = stub.Generate(_request(LONG_PROMPT, max_new_tokens=3000, **_greedy()), metadata=_md(), timeout=120)
    iterator = iter(call)
    next(iterator)
    busy = wait_for(lambda: [r for r, s in replica_stats("folio").items() if s["num_running"] > 0], 10)
    assert len(busy) == 1
    ray.kill(generator_replicas("folio")[busy[0]], no_restart=True)
    with pytest.raises(grpc.RpcError) as info:
        for _ in iterator:
            pass
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
    assert "retry" in info.value.details() and "Traceback" not in info.value.details()
