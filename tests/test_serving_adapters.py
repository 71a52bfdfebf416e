"""The serving side of LoRA adapters and injected embeddings, without a cluster: the registry's rules, a replica
keeping in step with it, payload placement, and the router hashing a request's prompt under the namespace the
replica's page pool will use."""

from __future__ import annotations

import asyncio
import struct
from types import SimpleNamespace

import pytest

from folio.serve.adapters import AdapterInfo, AdapterRegistry, IngressAdapters, ReplicaAdapters, check_adapter_name
from folio.serve.errors import AlreadyExists, InvalidRequest, NotFound, Overloaded, PermissionDenied


def _info(name: str, adapter_id: str = "aa", static: bool = False, path: str | None = None) -> AdapterInfo:
    return AdapterInfo(name=name, path=path or f"/adapters/{name}", rank=8, scale=2.0, target_modules=("q_proj",),
                       adapter_id=adapter_id, static=static)


class _Remote:
    """A registry called as a Ray actor is: `registry.method.remote(...)` awaited."""

    def __init__(self, target):
        self._target = target

    def __getattr__(self, name):
        method = getattr(self._target, name)

        async def call(*args):
            return method(*args)

        return SimpleNamespace(remote=call)


def test_registry_rules():
    registry = AdapterRegistry(max_adapters=2)
    v1 = registry.add(_info("a", static=True))
    assert registry.add(_info("a", static=True)) == v1  # every replica records the config's: no change
    with pytest.raises(AlreadyExists, match="unload it first"):
        registry.add(_info("a", adapter_id="bb"))
    registry.add(_info("b"))
    with pytest.raises(Overloaded, match="max_loras"):
        registry.add(_info("c"))
    with pytest.raises(PermissionDenied, match="server config"):
        registry.remove("a")
    with pytest.raises(NotFound):
        registry.remove("zzz")
    version = registry.remove("b")
    assert registry.snapshot() == (version, {"a": _info("a", static=True)})


def test_adapter_names():
    assert check_adapter_name("support-v2.1_b") == "support-v2.1_b"
    for bad in ("", "two words", "a/b", "x" * 65, 7):
        with pytest.raises(InvalidRequest, match="adapter name"):
            check_adapter_name(bad)


def test_replica_follows_the_registry_and_keeps_an_adapter_in_use():
    registry = AdapterRegistry(max_adapters=4)
    engine: dict[str, str] = {}
    in_use: set[str] = set()

    async def load(name, path):
        engine[name] = path
        return _info(name, adapter_id=f"id-{path}", path=path)

    async def unload(name):
        if name in in_use:
            return False
        del engine[name]
        return True

    async def scenario():
        here = ReplicaAdapters(_Remote(registry), load, unload)
        other = ReplicaAdapters(_Remote(registry), load, unload)
        info = await here.load_new("x", "/p1")
        assert registry.snapshot()[1]["x"] == info
        with pytest.raises(AlreadyExists):
            await other.load_new("x", "/p2")
        await other.ensure("x", info.adapter_id)  # not loaded there yet: loads it from the registry
        in_use.add("x")
        registry.remove("x")
        await here.sync()
        assert "x" in here.loaded  # still running a job with it: kept, and retried at the next sync
        with pytest.raises(NotFound, match="no longer loaded"):
            await here.ensure("x", "some-other-id")
        in_use.clear()
        await here.sync()
        assert "x" not in here.loaded and "x" not in engine

    asyncio.run(scenario())


def test_ingress_refreshes_on_a_miss_and_when_stale():
    registry = AdapterRegistry(max_adapters=4)
    now = [0.0]
    view = IngressAdapters(_Remote(registry), lambda: now[0])

    async def scenario():
        with pytest.raises(NotFound, match="ListLoras"):
            await view.lookup("late")
        registry.add(_info("late"))
        assert (await view.lookup("late")).name == "late"  # a miss asks the registry again at once
        registry.remove("late")
        assert (await view.lookup("late")).name == "late"  # fresh: the cached copy stands
        now[0] += 5.0
        with pytest.raises(NotFound):
            await view.lookup("late")

    asyncio.run(scenario())


def _payload(rows: int, hidden: int, position: int, value: float = 0.25, dtype: str = "float32"):
    from folio.serve.embedding_payloads import EmbeddingPayload

    data = struct.pack(f"<{rows * hidden}f", *([value] * (rows * hidden)))
    return EmbeddingPayload(position=position, rows=rows, dtype=dtype, data=data)


def test_payload_placement_and_its_checks():
    from folio.embeddings import is_placeholder
    from folio.serve.embedding_payloads import place

    ids = list(range(10, 20))
    placed = place([_payload(3, 4, position=2)], ids, hidden_size=4, max_bytes=1 << 20)
    assert placed.input_ids[:2] == (10, 11) and placed.input_ids[5:] == tuple(ids[5:])
    assert all(is_placeholder(t) for t in placed.input_ids[2:5]) and len(placed.digest) == 32
    other = place([_payload(3, 4, position=2, value=0.5)], ids, hidden_size=4, max_bytes=1 << 20)
    assert other.digest != placed.digest and other.input_ids[2:5] != placed.input_ids[2:5]
    cases = [
        ([_payload(3, 4, position=8)], "embeddings[0].position"),
        ([_payload(3, 5, position=0)], "embeddings[0].data"),
        ([_payload(2, 4, position=0), _payload(2, 4, position=1, value=0.5)], "overlaps"),
        ([_payload(1, 4, position=0, dtype="int8")], "embeddings[0].dtype"),
        ([_payload(1, 4, position=0, value=float("nan"))], "NaN"),
    ]
    for payloads, words in cases:
        with pytest.raises(InvalidRequest, match=words.replace("[", r"\[").replace("]", r"\]")):
            place(payloads, ids, hidden_size=4, max_bytes=1 << 20)
    with pytest.raises(InvalidRequest, match="max_embedding_bytes"):
        place([_payload(3, 4, position=2)], ids, hidden_size=4, max_bytes=16)


def test_router_hashes_the_prompt_under_the_replica_pages_namespace(demo, tmp_path):
    """The namespace the router computes from a request (adapter id and embeddings digest, as the ingress sets
    them) is the one the generator files the job's pages under."""
    import folio
    from folio.lora import random_adapter
    from folio.router.ray_router import prompt_namespace
    from folio.serve.embedding_payloads import place
    from folio.serve.schema import EngineRequest

    generator = demo.generator()
    adapter = random_adapter("r", demo.model.config, rank=4, target_modules=("q_proj",), device=demo.model.device,
                             dtype=demo.model.dtype, seed=0)
    info = generator.loras.add(adapter)
    hidden = demo.model.config.hidden_size
    placed = place([_payload(2, hidden, position=1)], list(range(5, 15)), hidden_size=hidden, max_bytes=1 << 20)
    request = EngineRequest(input_ids=placed.input_ids, max_new_tokens=1, lora="r", lora_adapter_id=info.adapter_id,
                            embeddings=placed.payloads, embeddings_digest=placed.digest)
    job = folio.DynamicJob(input_ids=list(placed.input_ids), max_new_tokens=1, lora="r",
                           embeddings=list(placed.payloads))
    generator.enqueue(job)
    pending = SimpleNamespace(args=(request,), kwargs={})
    assert job.sequence.namespace == prompt_namespace(pending) != b""
    generator.cancel(job)


def test_requests_that_cannot_carry_embeddings_are_refused():
    from folio.serve.embedding_payloads import placed_embeddings
    from folio.serve.errors import Unimplemented
    from folio.serve.schema import GenerationRequest

    payload = _payload(1, 4, position=0)
    assert placed_embeddings(GenerationRequest(token_ids=[5, 6]), [5, 6], 4, 1 << 20, cfg=False) is None
    with pytest.raises(InvalidRequest, match="token_ids prompt"):
        placed_embeddings(GenerationRequest(text="hi", embeddings=[payload]), [5, 6], 4, 1 << 20, cfg=False)
    with pytest.raises(InvalidRequest, match="classifier-free guidance"):
        placed_embeddings(GenerationRequest(token_ids=[5, 6], embeddings=[payload]), [5, 6], 4, 1 << 20, cfg=True)
    with pytest.raises(Unimplemented):
        placed_embeddings(GenerationRequest(token_ids=[5, 6], embeddings=[payload]), [5, 6], 0, 1 << 20, cfg=False)
    placed = placed_embeddings(GenerationRequest(token_ids=[5, 6], embeddings=[payload]), [5, 6], 4, 1 << 20,
                               cfg=False)
    assert placed.input_ids[1] == 6 and placed.input_ids[0] != 5
