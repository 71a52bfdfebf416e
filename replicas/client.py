"""Client: folio from Python code inside the Ray cluster, over Ray Serve handles (no gRPC).

Anything connected to the cluster can use it: a task, an actor, another deployment, a driver. It calls the
application's ingress (`serve.get_app_handle`), so requests are validated, tokenized and routed exactly as gRPC
requests are. Another process on the machine where `folio serve` runs joins its cluster with connect():

    import folio.serve

    client = folio.serve.connect()                             # a Client of the running `folio serve`
    print(client.complete_sync("Once upon a time", max_new_tokens=32).text)

Inside a cluster (a task, a deployment, a driver that called ray.init itself):

    from folio.serve.client import Client

    client = Client("folio")                                   # the application's name
    async for chunk in client.stream("Once upon a time", max_new_tokens=32, temperature=0.7):
        print(chunk.text, end="", flush=True)
    completion = await client.complete([1, 2, 3], max_new_tokens=8, stop_on_eos=False)   # token ids work too
    print(completion.text, completion.finish.reason, completion.finish.usage)

    for chunk in client.stream_sync("Hello", max_new_tokens=8):   # outside an event loop
        ...

Options are GenerationRequest's fields (max_new_tokens, min_new_tokens, stop_strings, stop_token_ids, stop_on_eos,
seed, add_bos, return_probs, return_top_tokens, ...) and Sampling's (temperature, top_k, top_p, min_p,
repetition_penalty, ..., token_bias), or `sampling=Sampling(...)`. Failures raise folio.serve.errors types:
InvalidRequest (with `.field`), Overloaded, ReplicaUnavailable, InternalError. Leaving a stream early cancels the
request on its replica.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from folio.serve.adapters import AdapterInfo
from folio.serve.errors import InvalidRequest, RequestError
from folio.serve.failures import cancel_quietly
from folio.serve.schema import Chunk, Completion, GenerationRequest, ModelInfo, Sampling, make_request


class Client:
    def __init__(self, app_name: str = "folio", handle: DeploymentHandle | None = None):
        self._handle = handle if handle is not None else serve.get_app_handle(app_name)

    @staticmethod
    def request(prompt: str | Sequence[int], **options: Any) -> GenerationRequest:
        """A GenerationRequest from a prompt (text, or token ids) and options (see the module's docstring)."""
        return make_request(prompt, **options)

    async def stream(self, prompt: str | Sequence[int], **options: Any) -> AsyncIterator[Chunk]:
        response = self._handle.options(stream=True).generate_stream.remote(self.request(prompt, **options))
        ended = False
        try:
            async for chunk in response:
                yield chunk
            ended = True
        except Exception as error:  # noqa: BLE001
            ended = True
            raise _unwrap(error) from None
        finally:
            if not ended:  # the caller left the loop early
                cancel_quietly(response)

    def stream_sync(self, prompt: str | Sequence[int], **options: Any) -> Iterator[Chunk]:
        response = self._handle.options(stream=True).generate_stream.remote(self.request(prompt, **options))
        ended = False
        try:
            for chunk in response:  # noqa: UP028 - not `yield from`: closing early must not close() Ray's stream here
                yield chunk
            ended = True
        except Exception as error:  # noqa: BLE001
            ended = True
            raise _unwrap(error) from None
        finally:
            if not ended:  # the caller left the loop early
                cancel_quietly(response)

    async def complete(self, prompt: str | Sequence[int], **options: Any) -> Completion:
        try:
            return await self._handle.generate.remote(self.request(prompt, **options))
        except Exception as error:  # noqa: BLE001
            raise _unwrap(error) from None

    def complete_sync(self, prompt: str | Sequence[int], **options: Any) -> Completion:
        try:
            return self._handle.generate.remote(self.request(prompt, **options)).result()
        except Exception as error:  # noqa: BLE001
            raise _unwrap(error) from None

    async def tokenize(self, text: str, add_bos: bool | None = None, encode_special_tokens: bool = False) -> list[int]:
        try:
            return await self._handle.tokenize.remote(text, add_bos, encode_special_tokens)
        except Exception as error:  # noqa: BLE001
            raise _unwrap(error) from None

    async def model_info(self) -> ModelInfo:
        try:
            return await self._handle.model_info.remote()
        except Exception as error:  # noqa: BLE001
            raise _unwrap(error) from None

    async def list_loras(self) -> list[AdapterInfo]:
        """The LoRA adapters requests may name (`lora=`)."""
        return await self._call("list_loras")

    async def load_lora(self, name: str, path: str) -> AdapterInfo:
        """Admin (the server's lora_admin): load a PEFT adapter directory, on the replicas' disks, under `name`."""
        return await self._call("load_lora", name, path)

    async def unload_lora(self, name: str) -> None:
        await self._call("unload_lora", name)

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            return await getattr(self._handle, method).remote(*args)
        except Exception as error:  # noqa: BLE001
            raise _unwrap(error) from None


def connect(app_name: str | None = None) -> Client:
    """A Client of the `folio serve` running on this machine: joins its Ray cluster (unless this process is in
    one already) from the record the server wrote (folio.serve.local.server_record_path()). `app_name`: default
    the server's application. Raises LookupError, saying what to do, when no `folio serve` runs."""
    import ray

    from folio.serve import local

    server = local.running_server()
    if not ray.is_initialized():
        local.join(server)
    return Client(app_name or server["app_name"])


def generator_replicas(app_name: str = "folio", deployment: str = "Generator") -> dict[str, Any]:
    """Actor handles of a running application's generator replicas, by replica id. Diagnostics (stats, tests that
    kill a replica): Serve has no public listing, so this relies on its replica actor names,
    "SERVE_REPLICA::<app>#<deployment>#<replica id>" in the "serve" namespace (ray 2.60)."""
    import ray

    prefix = f"SERVE_REPLICA::{app_name}#{deployment}#"
    found = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == "serve" and entry["name"].startswith(prefix):
            try:
                found[entry["name"][len(prefix):]] = ray.get_actor(entry["name"], namespace="serve")
            except ValueError:  # the replica went away meanwhile
                continue
    return found


def replica_stats(app_name: str = "folio", deployment: str = "Generator", timeout_s: float = 10.0) -> dict[str, dict]:
    """Each live generator replica's record_routing_stats() (load, pages, cache digest), by replica id."""
    import ray

    replicas = generator_replicas(app_name, deployment)
    stats = {}
    for replica_id, actor in replicas.items():
        try:
            stats[replica_id] = ray.get(actor.record_routing_stats.remote(), timeout=timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            continue
    return stats


def _unwrap(error: BaseException) -> BaseException:
    """The RequestError a replica raised, rather than Ray's wrapper (whose str() is a traceback)."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, RequestError):
        return type(cause)(*cause.args)
    if isinstance(error, RequestError):
        return type(error)(*error.args)
    return error


__all__ = ["Client", "connect", "replica_stats", "generator_replicas", "Chunk", "Completion", "GenerationRequest",
           "InvalidRequest", "ModelInfo", "Sampling"]
