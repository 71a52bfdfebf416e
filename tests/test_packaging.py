"""How folio installs: replicas/, router/ and protos/ keep their places in the tree but install only as folio.serve,
folio.router and folio.proto (pyproject.toml's package-dir, setup.py's package list), so no generic top-level name
(`router`, ...) is ever installed.

Two installs are checked: the tree setup.py's build_py makes (what a wheel and the Docker image hold, less the native
build), and the one this test run imports from (editable, `make setup`). Imports run in fresh interpreters started
outside the repository, whose root would otherwise offer its directories as top-level packages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAPPED = {"folio.serve": "replicas", "folio.router": "router", "folio.proto": "protos"}
SERVING_MODULES = ("folio.serve.app", "folio.serve.cli", "folio.serve.grpc_servicer", "folio.router.ray_router",
                   "folio.proto.compile")
GENERATED_MODULES = ("folio.proto.folio.v1.generation_pb2", "folio.proto.folio.v1.generation_pb2_grpc")

# Prints where each module comes from, and whether the old top-level names resolve.
PROBE = """
import importlib, importlib.util, json, sys
modules = sys.argv[1:]
print(json.dumps({
    "files": {name: importlib.import_module(name).__file__ for name in modules},
    "top_level": {name: importlib.util.find_spec(name) is not None for name in ("replicas", "router", "protos")},
}))
"""


def probe(modules: tuple[str, ...], cwd: Path, pythonpath: Path | None = None) -> dict:
    pytest.importorskip("ray.serve", reason="folio.serve.app imports Ray Serve (the serve extra)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    result = subprocess.run([sys.executable, "-c", PROBE, *modules], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_pyproject_maps_the_serving_directories_into_folio():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert config["tool"]["setuptools"]["package-dir"] == MAPPED
    assert config["project"]["scripts"] == {"folio": "folio.serve.cli:main"}
    from folio.proto import compile as proto_compile

    assert proto_compile.PACKAGE == "folio.proto"  # the path protoc names the generated modules after


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """setup.py's build_py into a temp dir (egg-info there too): the pure-Python part of a wheel."""
    pytest.importorskip("grpc_tools", reason="build_py generates the gRPC modules with grpcio-tools")
    out = tmp_path_factory.mktemp("build")
    command = ["setup.py", "-q", "egg_info", "--egg-base", str(out), "build_py", "--build-lib", str(out / "lib")]
    result = subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return out / "lib"


def test_a_build_installs_folio_alone_with_every_serving_module(built):
    assert [p.name for p in built.iterdir()] == ["folio"]
    for package, directory in MAPPED.items():
        sources = {p.relative_to(ROOT / directory) for p in (ROOT / directory).rglob("*.py")}
        target = built.joinpath(*package.split("."))
        assert sources <= {p.relative_to(target) for p in target.rglob("*.py")}, package
    for name in GENERATED_MODULES:
        assert built.joinpath(*name.split(".")).with_suffix(".py").is_file(), name


def test_a_build_imports_under_folio_and_nothing_else(built, tmp_path):
    found = probe(SERVING_MODULES + GENERATED_MODULES, cwd=tmp_path, pythonpath=built)
    assert all(Path(f).is_relative_to(built / "folio") for f in found["files"].values()), found["files"]
    assert not any(found["top_level"].values()), found["top_level"]


def test_the_installed_folio_imports_under_folio_and_nothing_else(tmp_path):
    """This environment's install (editable: the finder maps folio.serve to replicas/, ...) from outside the tree."""
    found = probe(SERVING_MODULES + GENERATED_MODULES, cwd=tmp_path)
    files = {name: Path(f) for name, f in found["files"].items()}
    if files["folio.serve.app"].is_relative_to(ROOT):  # editable: the modules are the tree's own files
        assert files["folio.serve.app"] == ROOT / "replicas" / "app.py"
        assert files["folio.router.ray_router"] == ROOT / "router" / "ray_router.py"
        assert files["folio.proto.folio.v1.generation_pb2_grpc"] == ROOT / "protos/folio/v1/generation_pb2_grpc.py"
    assert not any(found["top_level"].values()), found["top_level"]


def test_generated_modules_name_themselves_under_folio_proto():
    pytest.importorskip("grpc", reason="the gRPC modules need grpcio (the serve extra)")
    from folio.proto.folio.v1 import generation_pb2, generation_pb2_grpc

    assert generation_pb2.GenerateRequest.__module__ == "folio.proto.folio.v1.generation_pb2"  # pickles by this name
    assert generation_pb2.DESCRIPTOR.name == "folio/proto/folio/v1/generation.proto"
    assert generation_pb2.DESCRIPTOR.package == "folio.v1"  # the wire names stay: folio.v1.Generation
    assert generation_pb2_grpc.GenerationStub.__module__ == "folio.proto.folio.v1.generation_pb2_grpc"


def test_make_setup_shows_its_progress():
    """`make serve` / `make test` on a fresh machine first run minutes of setup: each step says what it does, and pip
    shows its own progress (no -q)."""
    import shutil

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    result = subprocess.run(["make", "-n", "-B", "setup"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    steps = [line for line in result.stdout.splitlines() if line.startswith('echo "==> setup')]
    assert len(steps) >= 5, result.stdout
    installs = [line for line in result.stdout.splitlines() if "pip install" in line]
    assert installs and not any(" -q" in line for line in installs), installs
