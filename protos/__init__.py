"""folio's gRPC API: the .proto definitions under protos/folio/v1/ and their generated Python code.

The generated modules (`protos.folio.v1.generation_pb2`, `..._pb2_grpc`) are built, not committed:
`pip install -e .` generates them, or run `python -m protos.compile`.
"""
