"""The Serve application: an Ingress deployment (CPU) in front of a Generator deployment (one GPU per replica).

    python -m folio.serve.app --model-path /models/llama --num-replicas 4 > serve.yaml   # a Serve config file
    serve run serve.yaml          # or: serve deploy serve.yaml (a running cluster), KubeRay's serveConfigV2
    serve run folio.serve.app:build_app model_path=/models/llama num_replicas=4   # gRPC options: see below

gRPC is configured per cluster, not per application: the config file written above carries `grpc_options`;
otherwise start Serve with `grpc_options(config)` (the `folio serve` command does). The proxy on every node must
import the servicer function (the folio package installed there, its protos generated).
`folio.serve.app:app` is the default configuration's Application, for tools that want one (`serve build`); options
cannot be changed through it, so prefer the config file.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from ray import serve
from ray.serve.config import BackpressureConfig, RequestRouterConfig, gRPCOptions

from folio.serve.config import ServeConfig
from folio.serve.errors import SERVE_REFUSAL_RETRY_AFTER_S
from folio.serve.generator import Generator
from folio.serve.ingress import Ingress

ROUTER_CLASSES = {
    "prefix": "folio.router.ray_router:PrefixAwareRequestRouter",
    "pow2": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",
    "ray_prefix": "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:PrefixCacheAffinityRouter",
}
DEFAULT_RAY_PREFIX_IMBALANCED_THRESHOLD = 10
INGRESS_REFUSAL_HEADROOM = 16

# Registers folio.v1.Generation (and works around a proxy cancellation bug: see folio.serve.grpc_servicer).
SERVICER_FUNCTION = "folio.serve.grpc_servicer.add_GenerationServicer_to_server"


def build_app(args: dict[str, Any]) -> serve.Application:
    """Application builder for `serve run` / `serve build`: args are ServeConfig options (strings are fine),
    or {"config": "file.yaml"} plus overrides."""
    values = dict(args or {})
    config_file = values.pop("config", None)
    config = ServeConfig() if config_file is None else ServeConfig.from_yaml(config_file)
    if values:
        config = ServeConfig.from_dict({**config.explicit_values(), **values})
    return build_application(config)


def build_application(config: ServeConfig) -> serve.Application:
    generator = Generator.options(
        request_router_config=request_router_config(config),
        num_replicas=config.num_replicas,
        max_ongoing_requests=config.max_ongoing_requests,
        # The ingress admits no more than the replicas take plus a bounded queue (folio.serve.admission). Serve's
        # own bound applies per caller (each ingress replica) and counts requests still being routed as queued: a
        # burst of admitted requests would trip a tighter one, so it is the ingress's share, a second line only.
        max_queued_requests=config.ingress_admission_limit,
        ray_actor_options={"num_gpus": config.num_gpus, "num_cpus": config.num_cpus},
        health_check_period_s=config.health_check_period_s,
        graceful_shutdown_timeout_s=config.graceful_shutdown_timeout_s,
        graceful_shutdown_wait_loop_s=0.5,
    ).bind(config)
    admitted = config.ingress_admission_limit + config.ingress_queue_limit
    return Ingress.options(
        num_replicas=config.ingress_replicas,
        # Room for every request the ingress runs or queues and a few that it refuses (with a retry hint, counted in
        # folio's metrics); beyond, requests wait at the proxy, and past a bounded queue the proxy refuses them
        # itself (RESOURCE_EXHAUSTED with a retry hint, folio.serve.grpc_servicer). A refusal at the proxy costs no
        # call to the ingress: in a burst, the CPU goes to admitted work.
        max_ongoing_requests=admitted + INGRESS_REFUSAL_HEADROOM,
        max_queued_requests=admitted,
        # HTTP clients refused by that queue get what OpenAI's clients retry on (gRPC ones: RESOURCE_EXHAUSTED).
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=SERVE_REFUSAL_RETRY_AFTER_S),
        ray_actor_options={"num_cpus": config.ingress_num_cpus},
        graceful_shutdown_timeout_s=config.graceful_shutdown_timeout_s,
        graceful_shutdown_wait_loop_s=0.5,
    ).bind(generator, config)


def request_router_config(config: ServeConfig) -> RequestRouterConfig:
    """The generator deployment's router (config.router). Its class is imported by path wherever a handle to the
    generator lives (the ingress) and where Serve validates the config (the controller, the dashboard), so the
    router package must be installed there, not only shipped in a working_dir."""
    options = dict(config.router_options or {})
    if config.router == "prefix":
        # Prompts are hashed with the replicas' page size before any of them reported it.
        kwargs = {"default_page_size": config.page_size, **options}
    elif config.router == "ray_prefix":
        # Its code default is no imbalance fallback at all (infinity) while its docs say 10: be explicit.
        kwargs = {"imbalanced_threshold": DEFAULT_RAY_PREFIX_IMBALANCED_THRESHOLD, **options}
    else:
        kwargs = options
    return RequestRouterConfig(request_router_class=ROUTER_CLASSES[config.router], request_router_kwargs=kwargs,
                               request_routing_stats_period_s=config.routing_stats_period_s,
                               request_routing_stats_timeout_s=config.routing_stats_timeout_s)


def grpc_options(config: ServeConfig) -> gRPCOptions:
    return gRPCOptions(port=config.grpc_port, grpc_servicer_functions=[SERVICER_FUNCTION],
                       request_timeout_s=config.request_timeout_s)


def route_prefix(config: ServeConfig) -> str:
    """The application's HTTP path (the OpenAI-compatible API is under {route_prefix}/v1); Serve's gRPC proxy also
    routes only to applications that have one (ray 2.60)."""
    return f"/{config.app_name}"


def serve_config(config: ServeConfig) -> dict[str, Any]:
    """A Serve config file (`serve deploy`, KubeRay's serveConfigV2) deploying this application."""
    grpc: dict[str, Any] = {"port": config.grpc_port, "grpc_servicer_functions": [SERVICER_FUNCTION]}
    if config.request_timeout_s is not None:
        grpc["request_timeout_s"] = config.request_timeout_s
    return {
        "http_options": {"host": config.http_host, "port": config.http_port},
        "grpc_options": grpc,
        "applications": [{
            "name": config.app_name,
            "route_prefix": route_prefix(config),
            "import_path": "folio.serve.app:build_app",
            "args": config.explicit_values(),
        }],
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Print a Serve config file (YAML) for the options given (ServeConfig's flags)."""
    import argparse

    import yaml

    from folio.serve.config import ConfigError

    parser = argparse.ArgumentParser(prog="python -m folio.serve.app", description=main.__doc__)
    ServeConfig.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config = ServeConfig.from_args(args)
    except ConfigError as e:
        print(f"folio.serve.app: {e}", file=sys.stderr)
        return 2
    yaml.safe_dump(serve_config(config), sys.stdout, sort_keys=False)
    return 0


app = build_application(ServeConfig())

if __name__ == "__main__":
    raise SystemExit(main())
