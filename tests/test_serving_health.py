"""The standard gRPC health service (grpc.health.v1.Health) of folio's endpoint, on a local Ray cluster (loopback).

One cluster per ingress mode (calls through HAProxy to the ingress replicas' own servers, or through Serve's proxy):
application "folio" (ingress + 1 generator replica of the demo model). A test adds
application "down" and takes its generator replica away; the last test deletes "folio" under an open Watch.
"""

from __future__ import annotations

import threading
import time

import pytest
from fakes import free_port, wait_for

pytestmark = pytest.mark.ray

grpc = pytest.importorskip("grpc")
pytest.importorskip("grpc_health.v1")
pytest.importorskip("ray.serve")

GENERATION = "folio.v1.Generation"
# Longer than anything here should take: a drain that waits it out means a Watch stream held the ingress.
GRACEFUL_SHUTDOWN_S = 120.0


@pytest.fixture(scope="module", params=["direct", "proxy"])  # (folio.serve.ingress_mode: both paths)
def served(request, tmp_path_factory):
    from folio.demo import write_demo_model
    from folio.serve import local
    from folio.serve.config import ServeConfig

    model_dir = write_demo_model(tmp_path_factory.mktemp("health") / "demo-model")
    config = ServeConfig(model_path=str(model_dir), num_gpus=0, num_cpus=0.3, ingress_num_cpus=0.1, num_replicas=1,
                         cache_tokens=1024, page_size=16, max_batch_size=4, max_queue_size=4,
                         grpc_port=free_port(), http_port=free_port(), app_name="folio",
                         graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S, ingress_mode=request.param)
    local.start_cluster(config, num_cpus=2)
    try:
        local.deploy(config)
        channel = grpc.insecure_channel(f"127.0.0.1:{config.grpc_port}")
        yield {"config": config, "channel": channel}
        channel.close()
    finally:
        local.shutdown()


def _stub(served):
    from grpc_health.v1 import health_pb2_grpc

    return health_pb2_grpc.HealthStub(served["channel"])


def _check(served, service: str = "", app: str | None = "folio") -> str:
    """The status's name, or the RPC error's code name."""
    from grpc_health.v1 import health_pb2

    metadata = (("application", app),) if app else None
    try:
        response = _stub(served).Check(health_pb2.HealthCheckRequest(service=service), metadata=metadata, timeout=30)
    except grpc.RpcError as error:
        return error.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)




def test_check_is_serving_for_the_server_and_the_generation_service(served):
    # The first answer may precede the ingress's view of its generator replicas: wait for it once.
    assert wait_for(lambda: _check(served) == "SERVING", timeout_s=60, interval_s=0.5)
    assert _check(served, "") == "SERVING"
    assert _check(served, GENERATION) == "SERVING"
    # One application deployed: a request without `application` metadata reaches it (Kubernetes' probes send none).
    assert _check(served, GENERATION, app=None) == "SERVING"


def test_check_of_an_unknown_service_is_not_found(served):
    from grpc_health.v1 import health_pb2

    with pytest.raises(grpc.RpcError) as info:
        _stub(served).Check(health_pb2.HealthCheckRequest(service="no.such.Service"),
                            metadata=(("application", "folio"),), timeout=30)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no.such.Service" in info.value.details() and "Traceback" not in info.value.details()


def test_list_names_both_services(served):
    from grpc_health.v1 import health_pb2

    response = _stub(served).List(health_pb2.HealthListRequest(), metadata=(("application", "folio"),), timeout=30)
    assert {name: status.status for name, status in response.statuses.items()} == {
        "": health_pb2.HealthCheckResponse.SERVING, GENERATION: health_pb2.HealthCheckResponse.SERVING}


def test_watch_streams_the_status(served):
    from grpc_health.v1 import health_pb2

    stub = _stub(served)
    call = stub.Watch(health_pb2.HealthCheckRequest(service=GENERATION), metadata=(("application", "folio"),),
                      timeout=60)
    assert next(call).status == health_pb2.HealthCheckResponse.SERVING
    call.cancel()  # the stream stays open while nothing changes
    unknown = stub.Watch(health_pb2.HealthCheckRequest(service="no.such.Service"),
                         metadata=(("application", "folio"),), timeout=60)
    assert next(unknown).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN  # the protocol's Watch answer
    unknown.cancel()


def test_not_serving_while_no_generator_replica_is_reachable(served):
    """Application "down": its only generator replica is killed (not restarted by Ray; Serve notices at its next
    health check, a minute away): its health turns NOT_SERVING, "folio"'s stays SERVING."""
    import ray
    from ray import serve

    from folio.serve import local
    from folio.serve.client import generator_replicas

    down = served["config"].replace(app_name="down", health_check_period_s=60.0)
    local.deploy(down)
    try:
        assert wait_for(lambda: _check(served, GENERATION, app="down") == "SERVING", timeout_s=60, interval_s=0.5)
        replicas = generator_replicas("down")
        assert len(replicas) == 1
        for actor in replicas.values():
            ray.kill(actor, no_restart=True)
        assert wait_for(lambda: _check(served, GENERATION, app="down") == "NOT_SERVING", timeout_s=30)
        assert _check(served, "", app="down") == "NOT_SERVING"
        assert _check(served, GENERATION, app="folio") == "SERVING"
        # Two applications: a request without `application` metadata has nowhere to go (Serve's NOT_FOUND).
        assert _check(served, GENERATION, app=None) == "NOT_FOUND"
    finally:
        serve.delete("down")


def test_watch_ends_with_not_serving_when_the_ingress_drains(served):
    """Runs last: deletes "folio". Its ingress drains while a Watch stream is open: the stream reports NOT_SERVING
    and ends, so the drain does not wait out graceful_shutdown_timeout_s for it."""
    from grpc_health.v1 import health_pb2
    from ray import serve

    call = _stub(served).Watch(health_pb2.HealthCheckRequest(service=""), metadata=(("application", "folio"),),
                               timeout=2 * GRACEFUL_SHUTDOWN_S)
    assert next(call).status == health_pb2.HealthCheckResponse.SERVING
    seen, ended = [], []

    def read_rest() -> None:
        try:
            seen.extend(message.status for message in call)
            ended.append("OK")
        except grpc.RpcError as error:
            ended.append(error.code().name)

    reader = threading.Thread(target=read_rest, daemon=True)
    reader.start()
    start_s = time.monotonic()
    serve.delete("folio")
    deleted_s = time.monotonic() - start_s
    reader.join(timeout=30)
    assert seen == [health_pb2.HealthCheckResponse.NOT_SERVING] and ended == ["OK"], (seen, ended)
    assert deleted_s < GRACEFUL_SHUTDOWN_S / 2, f"deleting the application took {deleted_s:.0f} s"
