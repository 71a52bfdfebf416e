"""The `folio` command: `serve` and `generate` here (they need Ray / gRPC, which folio/ must not import); every
other command (demo-model, run, ...) is folio.cli's.

    folio serve                          a local Ray cluster (its services on 127.0.0.1): the ingress and 2
                                         generator replicas on the demo model (CPU), gRPC on port 50051 of every
                                         interface (Serve's gRPC proxy cannot be restricted); Ctrl-C stops it
    folio serve --config serve.yaml      any ServeConfig option, from a YAML file and/or flags (folio serve -h)
    folio generate "Once upon a time"    stream a completion from a running server over gRPC
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

OWN_COMMANDS = ("serve", "generate")
ENGINE_COMMANDS = "demo-model, run"
DEFAULT_DEMO_DIR = Path("demo-model")
DASHBOARD_PORT = 8265  # Ray's default, where `serve status` looks

# `folio serve` without options: the demo model on the CPU, two replicas sharing two cores.
DEMO_DEFAULTS = {
    "model_path": str(DEFAULT_DEMO_DIR),
    "device": "auto",
    "num_gpus": 0.0,
    "num_cpus": 0.5,
    "ingress_num_cpus": 0.25,
    "num_replicas": 2,
    "cache_tokens": 8192,
    "page_size": 16,
    "max_batch_size": 16,
    "max_queue_size": 32,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in OWN_COMMANDS or (args[:1] in (["-h"], ["--help"])):
        parsed = _parser().parse_args(args)
        return parsed.handler(parsed)
    from folio import engine_cli_main as engine_main

    return engine_main(args)


def _parser() -> argparse.ArgumentParser:
    from folio.serve.config import ServeConfig

    parser = argparse.ArgumentParser(
        prog="folio", description="folio: a paged dynamic generator for LLMs, served by Ray Serve over gRPC",
        epilog=f"engine commands: {ENGINE_COMMANDS} (folio <command> -h)")
    commands = parser.add_subparsers(dest="command", required=True)

    serve_cmd = commands.add_parser(
        "serve", help="serve a model on a local Ray cluster over gRPC",
        description="Start a local Ray cluster and serve a model over gRPC until Ctrl-C. Without options: the demo "
                    "model (written to ./demo-model if missing; random weights, so its text is gibberish) on the "
                    "CPU, 2 generator replicas, gRPC on port 50051. Where it listens: Ray's own services on "
                    "127.0.0.1; Serve's HTTP proxy (the OpenAI-compatible API) and gRPC proxy on --http-host "
                    "(127.0.0.1; 0.0.0.0 for every interface). A port already in use is refused before anything "
                    "starts.")
    ServeConfig.add_arguments(serve_cmd, DEMO_DEFAULTS)
    local_group = serve_cmd.add_argument_group("local cluster")
    local_group.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                             help="Ray's metrics agent: Prometheus text (Ray's and folio's metrics) at "
                                  "http://127.0.0.1:PORT/metrics (default: a free port, printed when ready)")
    local_group.add_argument("--dashboard", action="store_true",
                             help=f"also start Ray's dashboard on 127.0.0.1:{DASHBOARD_PORT}, which `serve status` "
                                  "and `ray list actors` need (several seconds more to start)")
    serve_cmd.set_defaults(handler=_cmd_serve)

    gen = commands.add_parser("generate", help="stream a completion from a running server over gRPC")
    gen.add_argument("prompt", help="prompt text")
    gen.add_argument("--host", default="127.0.0.1")
    gen.add_argument("--port", type=int, default=50051)
    gen.add_argument("--app", default=None, help="Serve application name (when several are deployed)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--min-new-tokens", type=int, default=0)
    gen.add_argument("--temperature", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--min-p", type=float, default=None)
    gen.add_argument("--repetition-penalty", type=float, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past the model's EOS token")
    fmt = gen.add_mutually_exclusive_group()
    fmt.add_argument("--json-schema", type=Path, default=None, metavar="FILE",
                     help="the completion is JSON valid under this JSON Schema file")
    fmt.add_argument("--regex", default=None, help="the completion matches this regular expression")
    fmt.add_argument("--grammar", type=Path, default=None, metavar="FILE", help="a Lark grammar file")
    fmt.add_argument("--choice", action="append", default=None, metavar="TEXT",
                     help="the completion is one of these (repeatable)")
    gen.add_argument("--ban", action="append", default=[], metavar="TEXT", help="banned string (repeatable)")
    gen.add_argument("--token-healing", action="store_true")
    gen.add_argument("--negative-prompt", default=None, help="classifier-free guidance's negative prompt")
    gen.add_argument("--cfg-scale", type=float, default=None)
    gen.add_argument("--timeout", type=float, default=120.0, help="seconds (default 120)")
    gen.set_defaults(handler=_cmd_generate)
    return parser


# --- serve ---

def _cmd_serve(args: argparse.Namespace) -> int:
    from folio.serve.config import ConfigError, ServeConfig

    try:
        config = ServeConfig.from_args(args, **DEMO_DEFAULTS)
    except ConfigError as e:
        print(f"folio serve: {e}", file=sys.stderr)
        return 2
    # Before anything starts (a bind test, not Ray): Serve's proxies would otherwise share a taken port with its
    # owner through SO_REUSEPORT, or fail in a log nobody reads, while this command said it was serving.
    taken = _taken_ports(config, args)
    if taken:
        for option, port in taken:
            print(f"folio serve: port {port} ({option}) is already in use on this machine -- another `folio serve` "
                  f"or another program listens on it. Stop it, or choose a free port with {option}.",
                  file=sys.stderr)
        return 2
    if not _prepare_model(config):
        return 2

    from folio.serve import local

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"starting a local Ray cluster on 127.0.0.1 and {config.num_replicas} generator replica(s) of "
          f"{config.model_path} ...", file=sys.stderr)
    start_s = time.monotonic()
    try:
        context = local.start_cluster(config, metrics_export_port=args.metrics_port, include_dashboard=args.dashboard)
        local.deploy(config)
        if not stop.is_set():
            local.record_server(config, context)  # what folio.serve.connect() reads
            _print_ready(config, time.monotonic() - start_s, context.address_info.get("metrics_export_port"))
            stop.wait()
    finally:
        print("\nshutting down ...", file=sys.stderr)
        local.forget_server()
        local.shutdown()
    return 0


def _taken_ports(config, args: argparse.Namespace) -> list[tuple[str, int]]:
    """[(option, port)] of the ports this command would listen on that a server could not bind now. The gRPC port
    is tested where both proxies bind (--http-host), the others where they listen. Without SO_REUSEPORT (which
    would let a second server share the port), with SO_REUSEADDR as servers set it (connections of a server that
    just stopped do not count)."""
    wanted = [("--grpc-port", config.http_host, config.grpc_port),
              ("--http-port", config.http_host, config.http_port)]
    if args.metrics_port:
        wanted.append(("--metrics-port", "127.0.0.1", args.metrics_port))
    if args.dashboard:
        wanted.append(("--dashboard", "127.0.0.1", DASHBOARD_PORT))
    return [(option, port) for option, host, port in wanted if not _can_bind(host, port)]


def _can_bind(host: str, port: int) -> bool:
    if host in ("", "::") and not socket.has_dualstack_ipv6():
        host = "0.0.0.0"  # no IPv6 here: gRPC binds IPv4's any-address instead
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if host == "::":
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # [::] covers IPv4 too, as gRPC's does
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def _prepare_model(config) -> bool:
    model_dir = Path(config.model_path)
    if model_dir == DEFAULT_DEMO_DIR:
        from folio import is_demo_model_current, write_demo_model

        if not is_demo_model_current(model_dir):
            print(f"writing the demo model to ./{model_dir}", file=sys.stderr)
        write_demo_model(model_dir)
    for name, path in (("model_path", config.model_path), ("draft_model_path", config.draft_model_path)):
        if path is not None and not (Path(path) / "config.json").is_file():
            print(f"folio serve: {name}: {path} is not a model directory (no config.json)", file=sys.stderr)
            return False
    return True


def _print_ready(config, elapsed_s: float, metrics_port: int | None = None) -> None:
    port = config.grpc_port
    demo = ("\n  the demo model has random weights by design: its text is gibberish"
            if Path(config.model_path) == DEFAULT_DEMO_DIR else "")
    metrics = f"http://127.0.0.1:{metrics_port}/metrics" if metrics_port else "none (no metrics agent port)"
    openai_url = f"http://{config.http_host}:{config.http_port}/{config.app_name}/v1"  # folio.serve.openai_api
    model_name = Path(config.model_path).resolve().name  # the id /v1/models lists
    print(f"""
folio is serving {config.model_path} on gRPC port {port} (application {config.app_name!r}; ready in {elapsed_s:.0f} s)
  gRPC endpoint: {config.http_host}:{port}{demo}

  folio generate "Once upon a time" --port {port} --max-new-tokens 32
  grpcurl -plaintext -d '{{"text": "Once upon a time", "max_new_tokens": 32}}' \\
      127.0.0.1:{port} folio.v1.Generation/Generate
  python:  folio.serve.grpc_client.GrpcClient("127.0.0.1:{port}").stream("Once upon a time", max_new_tokens=32)
  python, Ray handles (any process on this machine): import folio.serve; client = folio.serve.connect()
           print(client.complete_sync("Once upon a time", max_new_tokens=32).text)
  OpenAI-compatible HTTP API: {openai_url}
           from openai import OpenAI
           client = OpenAI(base_url="{openai_url}", api_key="unused")
           print(client.completions.create(model="{model_name}", prompt="Once upon", max_tokens=32).choices[0].text)
  health:  grpc.health.v1.Health/Check, service "" or "folio.v1.Generation": SERVING / NOT_SERVING, e.g.
           grpc_health_probe -addr=127.0.0.1:{port} -service=folio.v1.Generation
  metrics: {metrics}

The API: protos/folio/v1/generation.proto. Press Ctrl-C to stop.""", flush=True)


# --- generate ---

def _cmd_generate(args: argparse.Namespace) -> int:
    import grpc

    from folio.serve.grpc_client import GrpcClient

    options = {"max_new_tokens": args.max_new_tokens, "min_new_tokens": args.min_new_tokens,
               "stop_strings": args.stop, "stop_on_eos": not args.ignore_eos, "seed": args.seed}
    for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "cfg_scale"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    from folio.serve.schema import ResponseFormat

    if args.json_schema is not None:
        options["response_format"] = ResponseFormat(json_schema=args.json_schema.read_text())
    elif args.regex is not None:
        options["response_format"] = ResponseFormat(regex=args.regex)
    elif args.grammar is not None:
        options["response_format"] = ResponseFormat(grammar=args.grammar.read_text())
    elif args.choice is not None:
        options["response_format"] = ResponseFormat(choice=args.choice)
    options.update(banned_strings=args.ban, token_healing=args.token_healing, negative_text=args.negative_prompt)
    target = f"{args.host}:{args.port}"
    with GrpcClient(target, app_name=args.app, timeout_s=args.timeout) as client:
        try:
            sys.stdout.write(args.prompt)
            finish = None
            for chunk in client.stream(args.prompt, **options):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                finish = chunk.finish or finish
            sys.stdout.write("\n")
        except grpc.RpcError as e:
            sys.stdout.write("\n")
            hint = " (is `folio serve` running?)" if e.code() == grpc.StatusCode.UNAVAILABLE else ""
            print(f"folio generate: {e.code().name}: {e.details()}{hint}", file=sys.stderr)
            return 1
    if finish is not None:
        u, t = finish.usage, finish.timings
        drafts = ""
        if u.accepted_draft_tokens or u.rejected_draft_tokens:
            drafts = f" ({u.accepted_draft_tokens} drafted tokens accepted, {u.rejected_draft_tokens} rejected)"
        print(f"[{finish.reason.value}; {u.prompt_tokens} prompt tokens ({u.cached_tokens} cached), "
              f"{u.completion_tokens} generated{drafts}; first token {t.time_to_first_token_s * 1000:.0f} ms, "
              f"total {t.total_s:.2f} s]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
