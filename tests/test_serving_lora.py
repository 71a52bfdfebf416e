"""LoRA adapters and injected embeddings through the server: a local Ray cluster, real gRPC clients, PEFT adapter
directories on disk, and the in-process engine as the oracle of every completion.

Application "lora" (2 demo-model replicas, admin RPCs on, adapter "tone" from the config) and application
"locked" (1 replica, admin RPCs off).
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from fakes import free_port

pytestmark = pytest.mark.ray

grpc = pytest.importorskip("grpc")
pytest.importorskip("ray.serve")
peft = pytest.importorskip("peft")

PROMPT = "The lighthouse keeper climbed the spiral stairs"


def write_adapter(model_dir, out_dir, seed: int, targets=("q_proj", "v_proj", "down_proj")):
    """A PEFT adapter of the demo model with non-zero B factors (PEFT starts B at zero: a no-op adapter)."""
    import torch
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=list(targets)))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    model.save_pretrained(out_dir)
    return str(out_dir)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from folio.demo import write_demo_model
    from folio.serve import local
    from folio.serve.config import ServeConfig

    root = tmp_path_factory.mktemp("serving-lora")
    model_dir = write_demo_model(root / "demo-model")
    tone = write_adapter(model_dir, root / "tone", seed=1)
    terse = write_adapter(model_dir, root / "terse", seed=2, targets=("k_proj", "o_proj", "gate_proj", "up_proj"))
    main = ServeConfig(model_path=str(model_dir), num_gpus=0, num_cpus=0.5, ingress_num_cpus=0.2, num_replicas=2,
                       cache_tokens=2048, page_size=16, max_batch_size=8, max_queue_size=8,
                       grpc_port=free_port(), http_port=free_port(), app_name="lora",
                       lora_adapters={"tone": tone}, lora_admin=True, max_loras=3)
    locked = main.replace(app_name="locked", num_replicas=1, num_cpus=0.2, ingress_num_cpus=0.1, lora_admin=False)
    local.start_cluster(main)
    try:
        local.deploy(main)
        local.deploy(locked)
        channel = grpc.insecure_channel(f"127.0.0.1:{main.grpc_port}")
        yield {"model_dir": model_dir, "tone": tone, "terse": terse, "channel": channel, "root": root,
               "http": f"http://127.0.0.1:{main.http_port}/lora"}
        channel.close()
    finally:
        local.shutdown()


@pytest.fixture(scope="module")
def engine(served):
    """The same model in this process, with the same adapters: what every served completion must equal."""
    import folio

    model = folio.Model.from_pretrained(served["model_dir"], progress=False)
    generator = folio.DynamicGenerator(model=model, cache=folio.Cache(model, num_tokens=2048, page_size=16),
                                       tokenizer=folio.Tokenizer.from_pretrained(served["model_dir"]))
    generator.load_lora("tone", served["tone"])
    generator.load_lora("terse", served["terse"])
    return generator


def _stub(served):
    from folio.proto.folio.v1 import generation_pb2_grpc as pb_grpc

    return pb_grpc.GenerationStub(served["channel"])


def _md(app: str = "lora"):
    return (("application", app),)


def _greedy(token_ids, **fields):
    from folio.proto.folio.v1 import generation_pb2 as pb

    message = pb.GenerateRequest(max_new_tokens=12, stop_on_eos=False, **fields)
    message.token_ids.ids.extend(token_ids)
    message.sampler.temperature = 0.0
    message.sampler.top_k = 1
    return message


def _expected(engine, token_ids, **job):
    import folio

    job = folio.DynamicJob(input_ids=list(token_ids), max_new_tokens=12, stop_conditions=[],
                           gen_settings=folio.SamplerSettings(temperature=0.0, top_k=1), **job)  # as _greedy asks
    engine.enqueue(job)
    while engine.num_remaining_jobs():
        engine.step()
    return list(job.generated_ids)


def _prompt(engine, text: str = PROMPT):
    return engine.tokenizer.encode(text, add_bos=True)


def test_config_adapter_is_listed_and_changes_the_completion_as_the_engine_does(served, engine):
    from folio.proto.folio.v1 import generation_pb2 as pb

    stub = _stub(served)
    listed = stub.ListLoras(pb.ListLorasRequest(), metadata=_md(), timeout=60).adapters
    assert [(a.name, a.rank, sorted(a.target_modules)) for a in listed] == [
        ("tone", 8, ["down_proj", "q_proj", "v_proj"])]
    info = stub.ModelInfo(pb.ModelInfoRequest(), metadata=_md(), timeout=60)
    assert "LlamaForCausalLM" in info.supported_architectures and info.hidden_size > 0
    assert [a.name for a in info.adapters] == ["tone"]
    prompt = _prompt(engine)
    base = stub.GenerateUnary(_greedy(prompt), metadata=_md(), timeout=120)
    tuned = stub.GenerateUnary(_greedy(prompt, lora="tone"), metadata=_md(), timeout=120)
    assert list(base.token_ids) == _expected(engine, prompt)
    assert list(tuned.token_ids) == _expected(engine, prompt, lora="tone")
    assert list(tuned.token_ids) != list(base.token_ids)  # the adapter is applied, not accepted and dropped


def test_openai_model_names_the_adapter(served, engine):
    """The OpenAI-compatible API: `model` = an adapter's name applies it, as gRPC's `lora` does."""
    import json
    import urllib.request

    from folio.proto.folio.v1 import generation_pb2 as pb

    with urllib.request.urlopen(f"{served['http']}/v1/models", timeout=60) as answer:
        assert "tone" in [card["id"] for card in json.load(answer)["data"]]
    prompt = _prompt(engine)

    def completion(model: str) -> str:
        body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0.0, "top_k": 1}
        request = urllib.request.Request(f"{served['http']}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as answer:
            return json.load(answer)["choices"][0]["text"]

    # the same sampling through gRPC (OpenAI's defaults: no repetition penalty, top_p 1, stop at EOS)
    message = pb.GenerateRequest(max_new_tokens=12, lora="tone")
    message.token_ids.ids.extend(prompt)
    message.sampler.temperature, message.sampler.top_k = 0.0, 1
    message.sampler.repetition_penalty, message.sampler.top_p = 1.0, 1.0
    tuned = _stub(served).GenerateUnary(message, metadata=_md(), timeout=120).text
    assert completion("tone") == tuned != completion(Path(served["model_dir"]).name)


def test_load_use_and_unload_an_adapter_while_serving(served, engine):
    from folio.proto.folio.v1 import generation_pb2 as pb

    stub = _stub(served)
    loaded = stub.LoadLora(pb.LoadLoraRequest(name="terse", path=served["terse"]), metadata=_md(), timeout=120)
    assert loaded.adapter.name == "terse" and loaded.adapter.rank == 8
    assert sorted(a.name for a in stub.ListLoras(pb.ListLorasRequest(), metadata=_md(), timeout=60).adapters) == [
        "terse", "tone"]
    # distinct prompts, streamed at once: both replicas get some (the one that did not load it loads it first)
    prompts = [_prompt(engine, f"{PROMPT} number {i}") for i in range(6)]
    calls = [stub.GenerateUnary.future(_greedy(p, lora="terse"), metadata=_md(), timeout=180) for p in prompts]
    for prompt, call in zip(prompts, calls):
        assert list(call.result().token_ids) == _expected(engine, prompt, lora="terse")
    # through the Python handle, which names the replica: every replica, not only the one that loaded it, serves it
    from concurrent.futures import ThreadPoolExecutor

    from folio.serve.client import Client

    client = Client("lora")
    words = ["Seven", "Rivers", "Under", "Quiet", "Lamps", "Beyond", "Granite", "Orchards"]
    replica_ids = set()
    for attempt in range(3):  # the router picks: a round may, rarely, keep to one replica
        prompts = [_prompt(engine, f"{word} {attempt} {PROMPT}") for word in words]
        with ThreadPoolExecutor(len(prompts)) as pool:
            done = list(pool.map(lambda p: client.complete_sync(p, lora="terse", max_new_tokens=12,
                                                                stop_on_eos=False, temperature=0.0, top_k=1), prompts))
        assert [list(c.token_ids) for c in done] == [_expected(engine, p, lora="terse") for p in prompts]
        replica_ids |= {c.finish.replica_id for c in done}
        if len(replica_ids) == 2:
            break
    assert len(replica_ids) == 2
    with pytest.raises(grpc.RpcError) as taken:
        stub.LoadLora(pb.LoadLoraRequest(name="terse", path=served["tone"]), metadata=_md(), timeout=60)
    assert taken.value.code() == grpc.StatusCode.ALREADY_EXISTS
    stub.UnloadLora(pb.UnloadLoraRequest(name="terse"), metadata=_md(), timeout=60)
    with pytest.raises(grpc.RpcError) as gone:
        stub.GenerateUnary(_greedy(prompts[0], lora="terse"), metadata=_md(), timeout=60)
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND and "terse" in gone.value.details()


def test_adapter_errors_have_their_status(served):
    from folio.proto.folio.v1 import generation_pb2 as pb

    stub = _stub(served)
    cases = [
        (lambda: stub.UnloadLora(pb.UnloadLoraRequest(name="tone"), metadata=_md(), timeout=60),
         grpc.StatusCode.PERMISSION_DENIED, "server config"),
        (lambda: stub.UnloadLora(pb.UnloadLoraRequest(name="nobody"), metadata=_md(), timeout=60),
         grpc.StatusCode.NOT_FOUND, "nobody"),
        (lambda: stub.LoadLora(pb.LoadLoraRequest(name="bad", path=str(served["root"] / "missing")),
                               metadata=_md(), timeout=60), grpc.StatusCode.INVALID_ARGUMENT, "path"),
        (lambda: stub.LoadLora(pb.LoadLoraRequest(name="two words", path=served["tone"]), metadata=_md(),
                               timeout=60), grpc.StatusCode.INVALID_ARGUMENT, "name"),
        (lambda: stub.GenerateUnary(_greedy([5, 6, 7], lora="unknown"), metadata=_md(), timeout=60),
         grpc.StatusCode.NOT_FOUND, "unknown"),
        (lambda: stub.LoadLora(pb.LoadLoraRequest(name="x", path=served["tone"]), metadata=_md("locked"),
                               timeout=60), grpc.StatusCode.PERMISSION_DENIED, "lora_admin"),
    ]
    for call, code, words in cases:
        with pytest.raises(grpc.RpcError) as failed:
            call()
        assert failed.value.code() == code, failed.value.details()
        assert words in failed.value.details()


def _payload(rows: int, hidden: int, seed: int, position: int):
    import torch

    from folio.proto.folio.v1 import generation_pb2 as pb

    values = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(seed))
    return values, pb.InjectedEmbedding(position=position, rows=rows, dtype="float32",
                                        data=struct.pack(f"<{rows * hidden}f", *values.flatten().tolist()))


def test_injected_embeddings_over_grpc_equal_the_engine(served, engine):
    import folio

    stub = _stub(served)
    hidden = engine.model.config.hidden_size
    prompt = _prompt(engine)
    for seed in (3, 4):  # the same token ids, two payloads: each completion is its own payload's
        values, payload = _payload(4, hidden, seed, position=2)
        served_ids = list(stub.GenerateUnary(_greedy(prompt, embeddings=[payload]), metadata=_md(),
                                             timeout=120).token_ids)
        injected = folio.InjectedEmbeddings(values)
        with_placeholders = prompt[:2] + injected.token_ids + prompt[6:]
        assert served_ids == _expected(engine, with_placeholders, embeddings=[injected])
    _, payload = _payload(4, hidden, 5, position=len(prompt) - 2)  # runs past the prompt's end
    with pytest.raises(grpc.RpcError) as failed:
        stub.GenerateUnary(_greedy(prompt, embeddings=[payload]), metadata=_md(), timeout=60)
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "embeddings[0].position" in \
        failed.value.details()
