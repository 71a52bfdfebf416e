"""Generates the Python code of folio's protos (it is built, never committed).

    python -m folio.proto.compile          # or: compile_protos() from a build step (setup.py's build_py)

The directory protos/ installs as the package folio.proto (pyproject's package-dir), so the modules of
`protos/folio/v1/generation.proto` are `folio.proto.folio.v1.generation_pb2` and `..._pb2_grpc`. protoc names a
module, and the imports between generated modules, after the .proto's path under its include root; so protoc sees
protos/ at the virtual path folio/proto/ (`--proto_path=folio/proto=protos`), writes into a scratch tree, and the
generated files are then moved next to their .proto. A .proto that imports another names it by that path too:
`import "folio/proto/folio/v1/other.proto";`.
Needs grpcio-tools (a build requirement of the serving extra).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent  # protos/ in a checkout (the package folio.proto)
PACKAGE = "folio.proto"  # what PROTO_ROOT installs as: keep equal to pyproject.toml's package-dir
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py")


def proto_files(proto_root: Path = PROTO_ROOT) -> list[Path]:
    """The .proto files under proto_root/folio/v1 (none where an installed package carries only generated code)."""
    return sorted((proto_root / "folio" / "v1").glob("*.proto"))


def generated_files(proto: Path) -> list[Path]:
    return [proto.with_name(proto.stem + suffix) for suffix in GENERATED_SUFFIXES]


def is_current(proto_root: Path = PROTO_ROOT) -> bool:
    """True when every .proto has generated modules newer than itself."""
    for proto in proto_files(proto_root):
        if not all(out.is_file() and out.stat().st_mtime >= proto.stat().st_mtime for out in generated_files(proto)):
            return False
    return True


def compile_protos(proto_root: Path = PROTO_ROOT, force: bool = False) -> list[Path]:
    """Run protoc (grpc_tools) over proto_root/folio/v1/*.proto; returns the generated files. Raises RuntimeError
    (with protoc's message) on failure."""
    try:
        import grpc_tools
        from grpc_tools import protoc
    except ImportError as e:
        raise RuntimeError("compiling folio's protos needs grpcio-tools: pip install grpcio-tools") from e
    proto_root = proto_root.resolve()
    protos = proto_files(proto_root)
    if not protos:
        raise RuntimeError(f"no .proto files under {proto_root / 'folio' / 'v1'}")
    generated = [out for proto in protos for out in generated_files(proto)]
    if not force and is_current(proto_root):
        return generated
    virtual_root = Path(*PACKAGE.split("."))
    virtual_protos = [virtual_root / proto.relative_to(proto_root) for proto in protos]
    well_known = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/*.proto
    with tempfile.TemporaryDirectory(prefix="folio-protoc-") as scratch:
        args = [
            "grpc_tools.protoc",
            f"--proto_path={virtual_root.as_posix()}={proto_root}",
            f"--proto_path={well_known}",
            f"--python_out={scratch}",
            f"--grpc_python_out={scratch}",
            *(p.as_posix() for p in virtual_protos),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {', '.join(p.name for p in protos)} (its message is above)")
        for proto, virtual in zip(protos, virtual_protos):
            for out in generated_files(proto):
                made = Path(scratch) / virtual.with_name(out.name)
                # copy beside the target, then rename over it: an importing process never sees half a file
                partial = out.with_name(f".{out.name}.{os.getpid()}.partial")
                shutil.copyfile(made, partial)
                os.replace(partial, out)
    return generated


def main() -> int:
    try:
        files = compile_protos(force="--force" in sys.argv[1:])
    except RuntimeError as e:
        print(f"{PACKAGE}.compile: {e}", file=sys.stderr)
        return 1
    for path in files:
        print(path.relative_to(PROTO_ROOT.parent))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
