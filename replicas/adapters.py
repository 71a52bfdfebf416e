"""LoRA adapters across a deployment: which adapters requests may name, and every replica loading them.

One registry per application (a named Ray actor, `AdapterRegistry`) is the source of truth, because Serve cannot
call every replica of a deployment and replicas come and go (restarts, autoscaling):
- the config's adapters (ServeConfig.lora_adapters) are loaded by each replica as it starts (a bad one fails the
  start), which then records them in the registry (the same entries from every replica: idempotent);
- LoadLora (admin) has one replica load the adapter, which validates it against the model, then records it; the
  other replicas load it before the first request that names it (`ReplicaAdapters.ensure`);
- UnloadLora removes the entry: the ingress refuses new requests naming it at once, and each replica drops it at
  its next routing report once no job uses it (`ReplicaAdapters.sync`).
An adapter's `adapter_id` is the digest of its weights (folio.lora): the replicas' page hashes and the router's keys
are namespaced by it, so a name reloaded with other weights never matches pages of the old ones.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from folio.serve.errors import AlreadyExists, InvalidRequest, NotFound, Overloaded, PermissionDenied

ADAPTER_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
# The ingress's copy of the registry is refreshed at least this often (and at once on a name it does not know).
INGRESS_REFRESH_S = 1.0


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    path: str
    rank: int
    scale: float
    target_modules: tuple[str, ...]
    adapter_id: str  # hex digest of the adapter's weights (its page-hash namespace)
    static: bool = False  # from the server config: UnloadLora refuses it


def check_adapter_name(name: Any, field: str = "name") -> str:
    if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name):
        raise InvalidRequest(field, f"an adapter name is 1-64 letters, digits, '.', '_' or '-'; got {name!r}")
    return name


class AdapterRegistry:
    """The application's adapters by name, with a version that changes on every change (run as a Ray actor)."""

    def __init__(self, max_adapters: int) -> None:
        self._adapters: dict[str, AdapterInfo] = {}
        self._version = 0
        self._max_adapters = max_adapters

    def add(self, info: AdapterInfo) -> int:
        """Record an adapter; the same entry again is a no-op (every replica records the config's). A name held by
        another adapter raises AlreadyExists."""
        held = self._adapters.get(info.name)
        if held is not None:
            if held == info:
                return self._version
            raise AlreadyExists("name", f"an adapter named {info.name!r} is loaded (from {held.path}); unload it "
                                        "first")
        if len(self._adapters) >= self._max_adapters:
            raise Overloaded(f"{len(self._adapters)} adapters are loaded, the server's max_loras; unload one first")
        self._adapters[info.name] = info
        self._version += 1
        return self._version

    def remove(self, name: str) -> int:
        held = self._adapters.get(name)
        if held is None:
            raise NotFound("name", f"no adapter named {name!r} is loaded")
        if held.static:
            raise PermissionDenied(f"adapter {name!r} is set in the server config (lora_adapters); change the config "
                                   "to remove it")
        del self._adapters[name]
        self._version += 1
        return self._version

    def snapshot(self) -> tuple[int, dict[str, AdapterInfo]]:
        return self._version, dict(self._adapters)


def registry_handle(app_name: str, max_adapters: int) -> Any:
    """The application's registry actor, created by whoever asks first. Detached and named after the application:
    it outlives the replica that created it (ingress and generator replicas restart independently)."""
    import ray

    return ray.remote(AdapterRegistry).options(
        name=f"folio-adapters:{app_name}", namespace="folio", get_if_exists=True, lifetime="detached",
        num_cpus=0, max_restarts=0).remote(max_adapters)


class IngressAdapters:
    """The ingress's view of the registry: which names requests may use, and their namespaces for routing."""

    def __init__(self, registry: Any, clock: Callable[[], float]) -> None:
        self.registry = registry
        self._clock = clock
        self._adapters: dict[str, AdapterInfo] = {}
        self._version = -1
        self._fetched_s = float("-inf")

    async def refresh(self) -> dict[str, AdapterInfo]:
        self._version, self._adapters = await self.registry.snapshot.remote()
        self._fetched_s = self._clock()
        return self._adapters

    async def listed(self) -> list[AdapterInfo]:
        if self._clock() - self._fetched_s > INGRESS_REFRESH_S:
            await self.refresh()
        return sorted(self._adapters.values(), key=lambda a: a.name)

    async def lookup(self, name: str) -> AdapterInfo:
        """The adapter a request names; NotFound when the registry does not list it (checked afresh on a miss)."""
        info = self._adapters.get(name)
        if info is None or self._clock() - self._fetched_s > INGRESS_REFRESH_S:
            info = (await self.refresh()).get(name)
        if info is None:
            raise NotFound("lora", f"no adapter named {name!r} is loaded (ListLoras lists them)")
        return info


class ReplicaAdapters:
    """A generator replica's adapters, kept in step with the registry. `load`/`unload` run on the engine (they are
    the engine's load_lora / unload_lora, run between two steps); `unload` returns False while jobs still use it."""

    def __init__(self, registry: Any, load: Callable[[str, str], Awaitable[AdapterInfo]],
                 unload: Callable[[str], Awaitable[bool]], static: Iterable[AdapterInfo] = ()) -> None:
        self._registry = registry
        self._load = load
        self._unload = unload
        self.loaded: dict[str, AdapterInfo] = {info.name: info for info in static}  # the config's, loaded at start
        self._version = -1
        self._lock = asyncio.Lock()

    async def load_new(self, name: str, path: str) -> AdapterInfo:
        """LoadLora: load here (which validates the adapter against the model), then record it for the others."""
        async with self._lock:
            _, listed = await self._registry.snapshot.remote()
            if name in listed:
                raise AlreadyExists("name", f"an adapter named {name!r} is loaded (from {listed[name].path}); "
                                            "unload it first")
            if name in self.loaded:  # unloaded from the registry, still in use here
                raise AlreadyExists("name", f"adapter {name!r} is being unloaded (jobs still use it); retry later")
            info = await self._load(name, path)
            self.loaded[name] = info
            try:
                await self._registry.add.remote(info)
            except AlreadyExists:
                await self._unload(name)
                del self.loaded[name]
                raise
            return info

    async def ensure(self, name: str, adapter_id: str) -> None:
        """Before a job naming `name` (registered with `adapter_id`, as the ingress saw it) starts here."""
        held = self.loaded.get(name)
        if held is not None and held.adapter_id == adapter_id:
            return
        await self.sync()
        held = self.loaded.get(name)
        if held is None or held.adapter_id != adapter_id:
            raise NotFound("lora", f"adapter {name!r} is no longer loaded (it was unloaded or replaced)")

    async def sync(self) -> None:
        """Load what the registry lists and this replica lacks; drop what it no longer lists once unused."""
        async with self._lock:
            version, listed = await self._registry.snapshot.remote()
            if version == self._version:
                return
            settled = True
            for name, held in list(self.loaded.items()):
                wanted = listed.get(name)
                if wanted is not None and wanted.adapter_id == held.adapter_id:
                    continue
                if await self._unload(name):
                    del self.loaded[name]
                else:
                    settled = False  # jobs still use it: try again at the next sync
            for name, wanted in listed.items():
                if name not in self.loaded:
                    self.loaded[name] = replace(await self._load(name, wanted.path), static=wanted.static)
            if settled:
                self._version = version


def require_admin(allowed: bool, rpc: str) -> None:
    if not allowed:
        raise PermissionDenied(f"{rpc} is an admin RPC, off on this server (set lora_admin: true in its config)")
