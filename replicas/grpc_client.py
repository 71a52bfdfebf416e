"""A small blocking gRPC client of folio.v1.Generation (the `folio generate` command is built on it).

    with GrpcClient("127.0.0.1:50051") as client:
        for chunk in client.stream("Once upon a time", max_new_tokens=32, temperature=0.7):
            print(chunk.text, end="", flush=True)
        print(client.complete("Hello", max_new_tokens=8).finish.usage)

Options are those of folio.serve.schema.make_request. gRPC failures raise grpc.RpcError (`.code()`, `.details()`).
Any language's gRPC stack can call the service the same way: protos/folio/v1/generation.proto is the contract.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from folio.proto.folio.v1 import generation_pb2 as pb
from folio.proto.folio.v1 import generation_pb2_grpc as pb_grpc
from folio.serve import grpc_convert
from folio.serve.schema import Chunk, Completion, ModelInfo, make_request


class GrpcClient:
    def __init__(self, target: str = "127.0.0.1:50051", app_name: str | None = None,
                 timeout_s: float | None = None):
        """app_name: sent as the "application" metadata (needed when the cluster serves several applications)."""
        self._channel = grpc.insecure_channel(target)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._metadata = (("application", app_name),) if app_name else ()
        self._timeout_s = timeout_s

    def stream(self, prompt: str | Sequence[int], **options: Any) -> Iterator[Chunk]:
        """Chunks as they are generated; leaving the loop early cancels the request."""
        call = self._stub.Generate(grpc_convert.request_to_proto(make_request(prompt, **options)),
                                   metadata=self._metadata, timeout=self._timeout_s)
        try:
            for message in call:
                yield grpc_convert.chunk_from_proto(message)
        finally:
            call.cancel()  # a no-op once the call has completed

    def complete(self, prompt: str | Sequence[int], **options: Any) -> Completion:
        message = self._stub.GenerateUnary(grpc_convert.request_to_proto(make_request(prompt, **options)),
                                           metadata=self._metadata, timeout=self._timeout_s)
        chunk = grpc_convert.chunk_from_proto(message)
        return Completion.from_chunks([chunk])

    def tokenize(self, text: str, add_bos: bool | None = None, encode_special_tokens: bool = False) -> list[int]:
        request = pb.TokenizeRequest(text=text, encode_special_tokens=encode_special_tokens)
        if add_bos is not None:
            request.add_bos = add_bos
        return list(self._stub.Tokenize(request, metadata=self._metadata, timeout=self._timeout_s).token_ids)

    def model_info(self) -> ModelInfo:
        m = self._stub.ModelInfo(pb.ModelInfoRequest(), metadata=self._metadata, timeout=self._timeout_s)
        return grpc_convert.model_info_from_proto(m)

    def list_loras(self) -> list[dict]:
        """The adapters requests may name (`lora=`): name, path, rank, scale, target_modules."""
        response = self._stub.ListLoras(pb.ListLorasRequest(), metadata=self._metadata, timeout=self._timeout_s)
        return [grpc_convert.adapter_from_proto(a) for a in response.adapters]

    def load_lora(self, name: str, path: str) -> dict:
        """Admin (the server's lora_admin): load a PEFT adapter directory, on the replicas' disks, under `name`."""
        response = self._stub.LoadLora(pb.LoadLoraRequest(name=name, path=path), metadata=self._metadata,
                                       timeout=self._timeout_s)
        return grpc_convert.adapter_from_proto(response.adapter)

    def unload_lora(self, name: str) -> None:
        self._stub.UnloadLora(pb.UnloadLoraRequest(name=name), metadata=self._metadata, timeout=self._timeout_s)

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Block until the channel connects (grpc.FutureTimeoutError after timeout_s)."""
        grpc.channel_ready_future(self._channel).result(timeout=timeout_s)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> GrpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
