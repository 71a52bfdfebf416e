"""Generated code of folio.v1 (see protos/compile.py); importing this package fails clearly when it is missing."""

try:
    from folio.proto.folio.v1 import generation_pb2, generation_pb2_grpc
except ImportError as _error:  # ModuleNotFoundError, or a stale module that no longer matches the runtime
    raise ImportError(
        "folio's gRPC code is not generated (protos/folio/v1/generation_pb2*.py): run "
        "`python -m folio.proto.compile` (`pip install -e .` does it too); it needs grpcio-tools"
    ) from _error

__all__ = ["generation_pb2", "generation_pb2_grpc"]
