"""Generates the Python code of folio's protos (it is built, never committed).

    python -m protos.compile          # or: compile_protos() from a build step

Every `protos/folio/v1/*.proto` is compiled with the repository root as the include path, so a file
`protos/folio/v1/generation.proto` becomes the modules `protos.folio.v1.generation_pb2` and `..._pb2_grpc`, whose
imports name the `protos` package and can never be confused with the engine package `folio`.
Needs grpcio-tools (a build requirement of the serving extra).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos" / "folio" / "v1"


def proto_files(root: Path = ROOT) -> list[Path]:
    return sorted((root / "protos" / "folio" / "v1").glob("*.proto"))


def is_current(root: Path = ROOT) -> bool:
    """True when every .proto has generated modules newer than itself."""
    for proto in proto_files(root):
        outputs = [proto.with_name(proto.stem + suffix) for suffix in ("_pb2.py", "_pb2_grpc.py")]
        if not all(out.is_file() and out.stat().st_mtime >= proto.stat().st_mtime for out in outputs):
            return False
    return True


def compile_protos(root: Path = ROOT, force: bool = False) -> list[Path]:
    """Run protoc (grpc_tools) over protos/folio/v1/*.proto; returns the generated files. Raises RuntimeError
    (with protoc's message) on failure."""
    try:
        import grpc_tools
        from grpc_tools import protoc
    except ImportError as e:
        raise RuntimeError("compiling folio's protos needs grpcio-tools: pip install grpcio-tools") from e
    protos = proto_files(root)
    if not protos:
        raise RuntimeError(f"no .proto files under {root / 'protos' / 'folio' / 'v1'}")
    generated = [p.with_name(p.stem + s) for p in protos for s in ("_pb2.py", "_pb2_grpc.py")]
    if not force and is_current(root):
        return [p for p in generated if p.exists()]
    well_known = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/*.proto
    args = [
        "grpc_tools.protoc",
        f"--proto_path={root}",
        f"--proto_path={well_known}",
        f"--python_out={root}",
        f"--grpc_python_out={root}",
        *(str(p.relative_to(root)) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {', '.join(str(p.relative_to(root)) for p in protos)} "
                           "(its message is above)")
    return [p for p in generated if p.exists()]


def main() -> int:
    try:
        files = compile_protos(force="--force" in sys.argv[1:])
    except RuntimeError as e:
        print(f"protos.compile: {e}", file=sys.stderr)
        return 1
    for path in files:
        print(path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
