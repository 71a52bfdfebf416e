"""folio's gRPC API: the .proto definitions under protos/folio/v1/ and their generated Python code.

protos/ installs as this package, folio.proto. The generated modules (`folio.proto.folio.v1.generation_pb2`,
`..._pb2_grpc`) are built, not committed: `pip install -e .` generates them, or run `python -m folio.proto.compile`.
"""
