"""The ingress's LoRA RPCs (ListLoras, and the admin LoadLora / UnloadLora) and the adapter check of each request;
the adapters themselves live in folio.serve.adapters' registry."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from folio.serve.adapters import AdapterInfo, IngressAdapters, check_adapter_name, registry_handle, require_admin
from folio.serve.config import ServeConfig
from folio.serve.errors import InvalidRequest, RequestError
from folio.serve.failures import answer_failure, as_request_error, current_request_id
from folio.serve.schema import EngineRequest, GenerationRequest


class AdapterRpcs:
    """Mixed into the Ingress deployment, which sets `_generator` (the generator deployment's handle), `_config`
    and `_adapters` (None until first used: the registry needs Ray)."""

    _generator: Any
    _config: ServeConfig
    _adapters: IngressAdapters | None

    # --- gRPC ---

    async def ListLoras(self, request: Any, grpc_context: Any = None) -> Any:  # noqa: N802
        from folio.proto.folio.v1 import generation_pb2 as pb
        from folio.serve import grpc_convert

        try:
            return pb.ListLorasResponse(adapters=[grpc_convert.adapter_to_proto(a) for a in await self.list_loras()])
        except Exception as error:  # noqa: BLE001 — a status, never a traceback
            return answer_failure(grpc_context, error, "ListLorasResponse")

    async def LoadLora(self, request: Any, grpc_context: Any = None) -> Any:  # noqa: N802
        from folio.proto.folio.v1 import generation_pb2 as pb
        from folio.serve import grpc_convert

        try:
            info = await self.load_lora(request.name, request.path)
            return pb.LoadLoraResponse(adapter=grpc_convert.adapter_to_proto(info))
        except Exception as error:  # noqa: BLE001 — a status, never a traceback
            return answer_failure(grpc_context, error, "LoadLoraResponse")

    async def UnloadLora(self, request: Any, grpc_context: Any = None) -> Any:  # noqa: N802
        from folio.proto.folio.v1 import generation_pb2 as pb

        try:
            await self.unload_lora(request.name)
            return pb.UnloadLoraResponse()
        except Exception as error:  # noqa: BLE001 — a status, never a traceback
            return answer_failure(grpc_context, error, "UnloadLoraResponse")

    # --- Python ---

    async def list_loras(self) -> list[AdapterInfo]:
        return await self._lora_view().listed()

    async def load_lora(self, name: str, path: str) -> AdapterInfo:
        """Admin: one generator replica loads the adapter (validating it against the model) and records it in the
        application's registry; the others load it before their first request that names it."""
        require_admin(self._config.lora_admin, "LoadLora")
        check_adapter_name(name)
        if not isinstance(path, str) or not path:
            raise InvalidRequest("path", "must name a PEFT adapter directory on the replicas' file system")
        try:
            info = await self._generator.load_lora.remote(name, path)
        except Exception as error:  # noqa: BLE001 — mapped to a status
            raise as_request_error(error, current_request_id()) from None
        await self._lora_view().refresh()
        return info

    async def unload_lora(self, name: str) -> None:
        """Admin: requests can no longer name the adapter; each replica frees it once its jobs with it are done."""
        require_admin(self._config.lora_admin, "UnloadLora")
        check_adapter_name(name)
        try:
            await self._lora_view().registry.remove.remote(name)
        except Exception as error:  # noqa: BLE001 — mapped to a status
            raise as_request_error(error, current_request_id()) from None
        await self._lora_view().refresh()

    def _lora_view(self) -> IngressAdapters:
        if self._adapters is None:
            self._adapters = IngressAdapters(registry_handle(self._config.app_name, self._config.max_loras),
                                             time.monotonic)
        return self._adapters

    async def _with_adapter(self, request: GenerationRequest, engine_request: EngineRequest) -> EngineRequest:
        """The request's adapter as the registry lists it now (NOT_FOUND when it does not)."""
        if request.lora is None:
            return engine_request
        try:
            adapter = await self._lora_view().lookup(check_adapter_name(request.lora, "lora"))
        except RequestError:
            raise
        except Exception as error:  # noqa: BLE001 — the registry actor is gone: mapped to a status
            raise as_request_error(error, current_request_id()) from None
        return dataclasses.replace(engine_request, lora=adapter.name, lora_adapter_id=adapter.adapter_id)
