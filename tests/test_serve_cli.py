"""`folio serve` as a user runs it: the real command in a subprocess, and clients in other processes.

A port that is taken is refused before anything starts (no Ray). The module's server (marker `ray`): the demo model,
one generator replica, free ports, its record in a temporary XDG_CACHE_HOME (never the user's); the README's handle
client snippet and the Dockerfile's HEALTHCHECK run against it as written.
"""

from __future__ import annotations

import os
import queue
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from fakes import free_port

ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 180  # the cluster's start and the replicas' on a loaded 2-core machine
COMMAND_TIMEOUT_S = 120


def folio_command() -> list[str]:
    script = Path(sys.executable).with_name("folio")  # the console script the install made
    return [str(script)] if script.exists() else [sys.executable, "-m", "folio.serve.cli"]


def client_env(cache_home: Path) -> dict[str, str]:
    return {**os.environ, "XDG_CACHE_HOME": str(cache_home),
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}


def run_folio(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*folio_command(), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT_S)


# --- ports, before anything starts ---------------------------------------------------------------------------

@pytest.mark.parametrize("option", ["--grpc-port", "--http-port"])
def test_serve_refuses_a_taken_port_before_starting_anything(tmp_path, option):
    with socket.socket() as listener:  # another program's server: a plain listener, no SO_REUSEPORT
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        ports = {"--grpc-port": free_port(), "--http-port": free_port(), option: port}
        result = run_folio("serve", *(f"{k}={v}" for k, v in ports.items()), cwd=tmp_path,
                           env=client_env(tmp_path / "cache"))
    assert result.returncode == 2, result.stderr
    assert f"port {port} ({option}) is already in use" in result.stderr
    assert "starting a local Ray cluster" not in result.stderr and not (tmp_path / "demo-model").exists()
    assert not (tmp_path / "cache").exists()  # nothing recorded either


@pytest.mark.ray
def test_a_proxy_that_cannot_bind_leaves_no_ray_running(tmp_path):
    # The library path (start_cluster, as the test fixtures use it) rather than the CLI, which checks ports first:
    # Serve's proxy fails to bind after ray.init, and the caller must be able to start again.
    code = (
        "import socket, ray\n"
        "from folio.serve import local\n"
        "from folio.serve.config import ServeConfig\n"
        "with socket.socket() as taken:\n"
        "    taken.bind(('127.0.0.1', 0)); taken.listen()\n"
        f"    config = ServeConfig(model_path='unused', num_gpus=0, grpc_port={free_port()},\n"
        "                         http_port=taken.getsockname()[1])\n"
        "    try:\n"
        "        local.start_cluster(config, num_cpus=1)\n"
        "    except Exception as error:\n"
        "        print('refused:', type(error).__name__)\n"
        "print('ray running:', ray.is_initialized())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=client_env(tmp_path / "cache"),
                            capture_output=True, text=True, timeout=READY_TIMEOUT_S)
    assert "refused:" in result.stdout and "ray running: False" in result.stdout, result.stdout + result.stderr[-3000:]


def test_connect_without_a_server_says_so(tmp_path):
    code = "import folio.serve\ntry:\n    folio.serve.connect()\nexcept LookupError as e:\n    print(e)\n"
    result = subprocess.run([sys.executable, "-c", code], env=client_env(tmp_path / "cache"), capture_output=True,
                            text=True, timeout=COMMAND_TIMEOUT_S)
    assert result.returncode == 0 and "no `folio serve` is running" in result.stdout, result.stdout + result.stderr


# --- a running server ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory, demo_dir):
    home = tmp_path_factory.mktemp("serve-cli")
    env = client_env(home / "cache")
    grpc_port, http_port = free_port(), free_port()
    stderr = (home / "serve.err").open("w")
    process = subprocess.Popen(
        [*folio_command(), "serve", "--model-path", str(demo_dir), "--num-replicas", "1", "--cache-tokens", "1024",
         "--max-batch-size", "4", "--max-queue-size", "4", "--grpc-port", str(grpc_port),
         "--http-port", str(http_port)],
        cwd=home, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    try:
        ready = _read_ready_message(lines, process, home / "serve.err")
        yield {"env": env, "cwd": home, "grpc_port": grpc_port, "http_port": http_port, "ready": ready}
    finally:
        process.send_signal(signal.SIGINT)  # what Ctrl-C does: Serve and Ray shut down
        try:
            process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the group this fixture started
            process.wait(timeout=30)
        stderr.close()


def _read_ready_message(lines: queue.Queue, process: subprocess.Popen, stderr_path: Path) -> str:
    deadline = time.monotonic() + READY_TIMEOUT_S
    seen: list[str] = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            if process.poll() is not None:
                break
            continue
        seen.append(line)
        if "Press Ctrl-C to stop" in line:
            return "".join(seen)
    pytest.fail(f"`folio serve` was not ready in {READY_TIMEOUT_S} s (exit code {process.poll()}):\n"
                + "".join(seen) + stderr_path.read_text()[-4000:])


@pytest.mark.ray
def test_ready_message_shows_endpoint_health_check_handle_client_and_metrics(server):
    ready, port = server["ready"], server["grpc_port"]
    assert f"gRPC endpoint: 127.0.0.1:{port}" in ready
    assert "grpc.health.v1.Health" in ready and "folio.v1.Generation" in ready
    assert "folio.serve.connect()" in ready
    (metrics_url,) = re.findall(r"metrics: (http://127\.0\.0\.1:\d+/metrics)", ready)
    body = urllib.request.urlopen(metrics_url, timeout=30).read().decode()
    assert "ray_" in body  # Prometheus text from Ray's metrics agent


@pytest.mark.ray
@pytest.mark.parametrize("option", ["--grpc-port", "--http-port"])
def test_a_second_serve_refuses_the_running_servers_port(server, tmp_path, option):
    port = server["grpc_port" if option == "--grpc-port" else "http_port"]
    ports = {"--grpc-port": free_port(), "--http-port": free_port(), option: port}
    result = run_folio("serve", *(f"{k}={v}" for k, v in ports.items()), cwd=tmp_path, env=server["env"])
    assert result.returncode == 2, result.stderr
    assert f"port {port} ({option}) is already in use" in result.stderr


@pytest.mark.ray
def test_the_readme_handle_client_snippet_prints_generated_text(server):
    """README's example, as written, from a process of its own: folio.serve.connect() finds the server's cluster."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    (snippet,) = [block for block in re.findall(r"```python\n(.*?)```", readme, flags=re.S)
                  if "folio.serve.connect()" in block]
    result = subprocess.run([sys.executable, "-c", snippet], cwd=server["cwd"], env=server["env"],
                            capture_output=True, text=True, timeout=READY_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip(), "no text printed"


@pytest.mark.ray
def test_the_readme_openai_snippet_runs_against_folio_serve(server, demo_dir):
    """README's OpenAI-client example (chat, then a streamed completion), as written but for the port and the model
    directory's name, against `folio serve`'s HTTP proxy."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    (snippet,) = [block for block in re.findall(r"```python\n(.*?)```", readme, flags=re.S)
                  if "from openai import OpenAI" in block]
    assert "http://127.0.0.1:8000/folio/v1" in snippet and 'model="demo-model"' in snippet
    snippet = (snippet.replace("127.0.0.1:8000", f"127.0.0.1:{server['http_port']}")
               .replace('model="demo-model"', f'model="{demo_dir.resolve().name}"'))
    result = subprocess.run([sys.executable, "-c", snippet], cwd=server["cwd"], env=server["env"],
                            capture_output=True, text=True, timeout=READY_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-4000:]
    assert len(result.stdout.strip()) > 10, result.stdout


@pytest.mark.ray
def test_the_dockerfile_healthcheck_passes_against_the_server(server):
    dockerfile = (ROOT / "Dockerfile").read_text(encoding="utf-8").replace("\\\n", " ")
    (healthcheck,) = [line for line in dockerfile.splitlines() if line.startswith("HEALTHCHECK")]
    command = shlex.split(healthcheck.split(" CMD ", 1)[1])
    assert command[0] == "python"
    env = {**server["env"], "FOLIO_GRPC_PORT": str(server["grpc_port"])}
    result = subprocess.run([sys.executable, *command[1:]], env=env, capture_output=True, text=True,
                            timeout=COMMAND_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-4000:]
    env["FOLIO_GRPC_PORT"] = str(free_port())  # nothing there: unhealthy
    assert subprocess.run([sys.executable, *command[1:]], env=env, capture_output=True,
                          timeout=COMMAND_TIMEOUT_S).returncode != 0


def _outbound_address() -> str | None:
    """This machine's address on its default route (no packet is sent), if it has one besides loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") or address == "0.0.0.0" else address


@pytest.mark.ray
def test_grpc_listens_on_loopback_only(server):
    """`folio serve` binds its gRPC proxy where its HTTP proxy is (--http-host, 127.0.0.1), not every interface
    as Serve does by itself."""
    address = _outbound_address()
    if address is None:
        pytest.skip("this machine has no address besides loopback")
    with socket.create_connection(("127.0.0.1", server["grpc_port"]), timeout=10):
        pass
    with pytest.raises(OSError):
        socket.create_connection((address, server["grpc_port"]), timeout=10).close()
