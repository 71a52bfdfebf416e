"""Tensor parallelism on the CPU (gloo, 2 processes): the shards reassemble to the whole model; a replica of 2 ranks
gives the logits of one process, prompt and paged decode steps alike, and a DynamicGenerator driving it the same
greedy tokens (partial-page copies and the host tier included); what cannot be split is refused, clearly.

The oracle is always the same model in this process (TP=1). Each spawning test starts its 2 ranks once (launch: a
time limit on the run and on every collective, so nothing hangs) and runs all its cases in them."""

from __future__ import annotations

import dataclasses
import functools
import time

import pytest
import torch
import torch.distributed as dist
from tiny_models import make_hf_model

import folio
from folio.model import fp8
from folio.model.batch import ForwardBatch, SeqChunk
from folio.model.config import ModelConfig
from folio.model.injection import InjectedSpan
from folio.model.tensor_parallel import (
    TensorParallel,
    TensorParallelError,
    local_config,
    shard_weights,
    vocab_shard_size,
)
from folio.tp_launch import launch, replica_main
from folio.tp_worker import HEADER_LEN, Channel, Op, decode_batch, encode_batch

TP = 2
PAGE_SIZE = 16
LAUNCH = dict(num_threads=1, timeout_s=120)  # 2 ranks on a 2-core machine: one thread each
GREEDY = folio.SamplerSettings.greedy()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    # an odd vocabulary (the last lm_head shard padded) and biases on q/k/v and o_proj (o_proj's added once)
    return make_hf_model(tmp_path_factory.mktemp("tp-llama"), "llama", vocab_size=251, attention_bias=True)


# --- (a) sharding ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("weight_format", [None, "fp8"])
def test_shards_reassemble_to_the_whole_model(llama_dir, weight_format):
    model = folio.Model.from_pretrained(llama_dir, progress=False, weight_format=weight_format)
    cfg, whole = model.config, model.weights.layers[0]
    shards = [shard_weights(model.weights, cfg, rank, TP) for rank in range(TP)]
    local = local_config(cfg, TP)
    assert (local.num_q_heads, local.num_kv_heads, local.intermediate_size) == (3, 1, 80)
    q_rows, kv_rows, inter = local.q_size, local.kv_size, local.intermediate_size
    layers = [s.layers[0] for s in shards]

    def dense(w):
        return w.dequantize() if isinstance(w, fp8.Fp8Weight) else w

    # qkv: each rank's [q; k; v] rows; q, k and v each reassemble to the whole model's, rank by rank
    for name, w_local, w_whole in (("qkv", [dense(x.qkv) for x in layers], dense(whole.qkv)),
                                   ("qkv_bias", [x.qkv_bias for x in layers], whole.qkv_bias)):
        assert all(w.shape[0] == q_rows + 2 * kv_rows for w in w_local), name
        q = torch.cat([w[:q_rows] for w in w_local])
        k = torch.cat([w[q_rows:q_rows + kv_rows] for w in w_local])
        v = torch.cat([w[q_rows + kv_rows:] for w in w_local])
        assert torch.equal(torch.cat([q, k, v]), w_whole), name
    # gate/up: gate rows then up rows on each rank, pairing row i with row i
    gate = torch.cat([dense(x.gate_up)[:inter] for x in layers])
    up = torch.cat([dense(x.gate_up)[inter:] for x in layers])
    assert torch.equal(torch.cat([gate, up]), dense(whole.gate_up))
    # o_proj and down: column blocks; FP8 keeps the per-row scales whole
    assert torch.equal(torch.cat([dense(x.o_proj) for x in layers], dim=1), dense(whole.o_proj))
    assert torch.equal(torch.cat([dense(x.down) for x in layers], dim=1), dense(whole.down))
    if weight_format == "fp8":
        assert all(isinstance(x.qkv, fp8.Fp8Weight) and x.qkv.scale.shape == (q_rows + 2 * kv_rows,) for x in layers)
        assert all(torch.equal(x.down.scale, whole.down.scale) for x in layers)
    # o_proj's bias once (rank 0), norms and embeddings whole, lm_head by padded vocabulary rows
    assert torch.equal(layers[0].o_proj_bias, whole.o_proj_bias) and layers[1].o_proj_bias is None
    assert all(torch.equal(x.input_norm, whole.input_norm) for x in layers)
    assert all(torch.equal(s.embed_tokens, model.weights.embed_tokens) for s in shards)
    size = vocab_shard_size(cfg.vocab_size, TP)
    assert size == 126 and all(s.lm_head.shape == (size, cfg.hidden_size) for s in shards)
    heads = torch.cat([dense(s.lm_head) for s in shards])
    assert torch.equal(heads[:cfg.vocab_size], dense(model.weights.lm_head))
    assert not heads[cfg.vocab_size:].any()


def test_the_rank_model_and_cache_hold_their_share(llama_dir):
    tp = TensorParallel(rank=1, world_size=TP)  # (no collective runs: the process group is never used)
    model = folio.Model.from_pretrained(llama_dir, progress=False, tensor_parallel=tp)
    assert model.tensor_parallel is tp and model.config.num_kv_heads == 1
    cache = folio.Cache(model, num_tokens=4 * PAGE_SIZE, page_size=PAGE_SIZE)
    assert cache.k.shape == (3, 4, PAGE_SIZE, 1, 16)
    one = folio.Model.from_pretrained(llama_dir, progress=False, tensor_parallel=TensorParallel(0, 1))
    assert one.tensor_parallel is None and one.config.num_kv_heads == 2  # one rank: the one-process model


@pytest.mark.parametrize("weight_format", [None, "fp8"])
def test_a_rank_loads_its_shard_a_layer_at_a_time(llama_dir, weight_format, monkeypatch):
    """Model.from_pretrained with a rank reads the checkpoint lazily (folio.model.loader.LazyTensors), layer by layer
    in order (each layer is split as soon as it is built: fuse_weights' layer_hook), and its weights equal the
    shard of the whole model's."""
    from folio.model import loader

    whole = folio.Model.from_pretrained(llama_dir, progress=False, weight_format=weight_format)
    reads: list[str] = []
    original = loader._read_lazily

    def counting(path, name, device, finish):
        reads.append(name)
        return original(path, name, device, finish)

    monkeypatch.setattr(loader, "_read_lazily", counting)
    for rank in range(TP):
        reads.clear()
        model = folio.Model.from_pretrained(llama_dir, progress=False, weight_format=weight_format,
                                            tensor_parallel=TensorParallel(rank, TP))
        want = shard_weights(whole.weights, whole.config, rank, TP)
        got_tensors = _flat(model.weights)
        want_tensors = _flat(want)
        assert got_tensors.keys() == want_tensors.keys()
        for name in want_tensors:
            assert torch.equal(got_tensors[name], want_tensors[name]), (rank, name)
        # the checkpoint's tensors were read layer by layer, in order
        layers_read = [int(n.split(".")[2]) for n in reads if n.startswith("model.layers.")]
        assert layers_read == sorted(layers_read) and len(set(layers_read)) == whole.config.num_layers


def _flat(weights) -> dict[str, torch.Tensor]:
    """Every tensor of ModelWeights by a path name (FP8 weights as codes and scales)."""
    out = {}

    def add(name, value):
        if isinstance(value, fp8.Fp8Weight):
            out[name + ".weight"], out[name + ".scale"] = value.weight.view(torch.uint8), value.scale
        elif isinstance(value, torch.Tensor):
            out[name] = value

    for field in ("embed_tokens", "final_norm", "lm_head"):
        add(field, getattr(weights, field))
    for i, layer in enumerate(weights.layers):
        for f in dataclasses.fields(layer):
            add(f"layers.{i}.{f.name}", getattr(layer, f.name))
    return out


class _Loopback:
    """A channel whose receiving end reads what was sent, in order."""

    def __init__(self, tensors):
        self.tensors = list(tensors)

    def receive_tensor(self, shape, dtype):
        tensor = self.tensors.pop(0)
        assert tensor.shape == shape and tensor.dtype == dtype
        return tensor.clone()


@pytest.mark.parametrize("prefill", [True, False])
def test_a_forward_batch_crosses_the_channel_whole(prefill):
    """Every field of a ForwardBatch reaches the workers as it was (a field added to ForwardBatch but not to the
    protocol fails here; LoRA is refused under tensor parallelism instead)."""
    values = torch.randn(3, 8)
    chunks = [SeqChunk(list(range(5, 25)), 4, [2, 0, 7], "all", injected=(InjectedSpan(2, values),)),
              SeqChunk([3, 4, 5], 40, [1, 6, 4], "last")] if prefill else \
        [SeqChunk([9], 20, [3, 1], "last"), SeqChunk([8], 3, [5], "last")]
    batch = ForwardBatch.build(chunks, PAGE_SIZE, "cpu")
    if not prefill:  # as the decode graphs build it: no host copies of the lengths
        batch = dataclasses.replace(batch, seq_q_lens=(), seq_context_lens=(), total_context_len=0)
    args, tensors = encode_batch(batch)
    got = decode_batch(_Loopback(tensors), args)
    for field in dataclasses.fields(ForwardBatch):
        if field.name == "lora":
            continue
        mine, theirs = getattr(batch, field.name), getattr(got, field.name)
        if isinstance(mine, torch.Tensor):
            assert theirs.dtype == mine.dtype and torch.equal(theirs, mine), field.name
        else:
            assert theirs == mine, field.name


def _headers_in_a_burst(tp, count, stall_s):
    """Rank 0 sends `count` headers at once while rank 1 is busy for stall_s: rank 0's sends return without waiting
    for rank 1 (at most MAX_PENDING_HEADERS in flight); rank 1 then reads them all, in order."""
    channel = Channel(tp, torch.device("cpu"))
    if tp.rank == 0:
        started = time.monotonic()
        most_pending = 0
        for i in range(count):
            channel.send(Op.COPY_SLOTS, i, i + 1, 7)
            most_pending = max(most_pending, len(channel._pending))
        sent_s = time.monotonic() - started
        channel.flush()
        return sent_s, most_pending, len(channel._pending)
    time.sleep(stall_s)  # (busy: rank 0's headers wait in gloo)
    return [channel.receive() for _ in range(count)]


def test_headers_are_handed_to_gloo_and_arrive_in_order():
    count, stall_s = Channel.MAX_PENDING_HEADERS // 2, 3.0
    sent_s, most_pending, left = launch(_headers_in_a_burst, TP, (count, stall_s), **LAUNCH)
    assert sent_s < stall_s / 2, f"rank 0 waited {sent_s:.2f} s for a busy peer"  # (wide margin: a loaded machine)
    assert 1 <= most_pending <= Channel.MAX_PENDING_HEADERS and left == 0


def _headers_received(tp, count):
    channel = Channel(tp, torch.device("cpu"))
    if tp.rank == 0:
        for i in range(count):
            channel.send(Op.COPY_SLOTS, i, i + 1, 7)
        channel.flush()
        return None
    return [channel.receive() for _ in range(count)]


def test_more_headers_than_may_be_in_flight_arrive_in_order():
    count = 3 * Channel.MAX_PENDING_HEADERS + 5
    received = launch(_each_rank_result, TP, (_headers_received, count), **LAUNCH)
    assert received == [(Op.COPY_SLOTS, [i, i + 1, 7] + [0] * (HEADER_LEN - 4)) for i in range(count)]


def _each_rank_result(tp, fn, *args):
    """fn's result on rank 1, returned from rank 0 (launch returns rank 0's)."""
    mine = fn(tp, *args)
    everyone = [None] * tp.world_size
    dist.all_gather_object(everyone, mine)
    return everyone[1]


# --- (d) what cannot be split ---------------------------------------------------------------------------------------

def test_indivisible_heads_and_sizes_are_refused(llama_dir, tmp_path):
    cfg = ModelConfig.from_pretrained(llama_dir)
    with pytest.raises(TensorParallelError, match="num_key_value_heads=2 is not divisible by tensor_parallel_size=4"):
        folio.Model.from_pretrained(llama_dir, progress=False, tensor_parallel=TensorParallel(0, 4))
    with pytest.raises(TensorParallelError, match="num_key_value_heads=2 .* tensor_parallel_size=3"):
        local_config(cfg, 3)
    with pytest.raises(TensorParallelError, match="intermediate_size=161"):
        local_config(dataclasses.replace(cfg, intermediate_size=161), TP)
    moe_dir = make_hf_model(tmp_path / "moe", "mixtral")
    with pytest.raises(TensorParallelError, match="routed experts"):
        folio.Model.from_pretrained(moe_dir, progress=False, tensor_parallel=TensorParallel(0, TP))


# --- (b) logits: 2 ranks == 1 process -------------------------------------------------------------------------------

def _forward_steps(model, cache):
    """A prompt step of two sequences over several pages (every row's logits for one of them), a step whose rows
    want no logits, one with embedding rows injected, then decode steps through the paged cache. Returns the logits
    of each step and the K/V of rank 0's cache."""
    device, out = model.device, []
    a, b = list(range(3, 40)), list(range(50, 63))
    step = [SeqChunk(a[:30], 0, [0, 1, 2], "all"), SeqChunk(b, 0, [3], "last")]
    out.append(model.forward(ForwardBatch.build(step, PAGE_SIZE, device), cache))
    out.append(model.forward(ForwardBatch.build([SeqChunk(a[30:34], 30, [0, 1, 2], "none")], PAGE_SIZE, device),
                             cache))
    values = torch.linspace(-1, 1, 2 * model.config.hidden_size, dtype=model.dtype, device=device).view(2, -1)
    step = [SeqChunk(a[34:], 34, [0, 1, 2], "last", injected=(InjectedSpan(1, values),))]
    out.append(model.forward(ForwardBatch.build(step, PAGE_SIZE, device), cache))
    len_a, len_b = len(a), len(b)
    for i in range(4):
        step = [SeqChunk([7 + i], len_a + i, [0, 1, 2], "last"), SeqChunk([90 + i], len_b + i, [3, 4], "last")]
        out.append(model.forward(ForwardBatch.build(step, PAGE_SIZE, device), cache))
    return out, [cache.k.clone(), cache.v.clone()]


def _each_model(tp, entries, drive):
    """replica_main for each (model_dir, model_kwargs, cache_kwargs) in turn, in the same processes."""
    return [replica_main(tp, path, drive, model_kwargs, cache_kwargs)
            for path, model_kwargs, cache_kwargs, _ in entries]


@pytest.mark.timeout(180)
def test_logits_at_tp2_equal_one_process(llama_dir, tmp_path):
    fp32, pages = {"dtype": torch.float32}, {"num_tokens": 8 * PAGE_SIZE, "page_size": PAGE_SIZE}
    # (model_dir, model_kwargs, cache_kwargs, tolerance relative to the logits' largest): the sums over ranks
    # change the order of fp32 additions, so logits agree to fp32's rounding at their scale; a quantized cache
    # rounds K/V that differ by that much to codes that may differ by one step
    entries = [(llama_dir, fp32, pages, 1e-5), (llama_dir, {**fp32, "weight_format": "fp8"}, pages, 1e-5),
               (llama_dir, fp32, {**pages, "kv_format": "fp8"}, 1e-3),
               # tied embeddings (lm_head split from the replicated embedding), Qwen3's per-head q/k norms
               (make_hf_model(tmp_path / "qwen3", "qwen3", tie=True), fp32, pages, 1e-5),
               # Gemma 2: sublayer output norms after the sum, soft-capped attention and logits, scaled embeddings
               (make_hf_model(tmp_path / "gemma2", "gemma2"), fp32, pages, 1e-5)]
    got = launch(_each_model, TP, (entries, _forward_steps), **LAUNCH)
    for (path, model_kwargs, cache_kwargs, tolerance), (logits, kv) in zip(entries, got):
        model = folio.Model.from_pretrained(path, progress=False, **model_kwargs)
        want, want_kv = _forward_steps(model, folio.Cache(model, **cache_kwargs))
        assert [t.shape for t in logits] == [t.shape for t in want]
        assert want[1].shape == (0, model.config.vocab_size)
        for step, (g, w) in enumerate(zip(logits, want)):
            scale = float(w.abs().max()) if w.numel() else 1.0
            torch.testing.assert_close(g, w, rtol=tolerance, atol=tolerance * scale,
                                       msg=f"{path.name} {model_kwargs} {cache_kwargs} step {step}")
        if "kv_format" not in cache_kwargs:  # rank 0's cache holds kv head 0 of every page the steps wrote
            for g, w in zip(kv, want_kv):
                torch.testing.assert_close(g, w[:, :, :, :1], rtol=tolerance, atol=tolerance)


# --- (c) a DynamicGenerator on rank 0 -------------------------------------------------------------------------------

def _scenario_prompts(tokenizer):
    """Prompts run one after another: each prefix returns after others evicted it (to the host tier, and back),
    and one prompt extends an earlier one inside its last, partial page (a partial-page slot copy)."""
    prefixes = [tokenizer.encode(f"Preamble {k}: the keeper counted ships, storms and gulls on the rock " * 2)
                for k in range(3)]
    lists = [p + tokenizer.encode(f" question {i}?") for i in range(2) for p in prefixes]
    base = tokenizer.encode("A lighthouse stood on the rock where the gulls gathered every evening")
    return lists + [base, base + tokenizer.encode(" and sang")]


def _generate(model, cache, model_dir, modes):
    """Greedy tokens of each prompt, run one at a time, by a generator built with each mode's arguments in turn;
    what rank 0 sent the other ranks (None in one process); and the steps launched ahead and tokens drafted."""
    from folio.model.decode_graphs import DecodeGraphs

    tokenizer = folio.Tokenizer.from_pretrained(model_dir)
    tokens, counts = [], {"ahead": 0, "drafted": 0}
    for mode in modes:
        kwargs = {k: v for k, v in mode.items() if k != "graphs"}
        gen = folio.DynamicGenerator(model=model, cache=cache, tokenizer=tokenizer, cuda_graphs=False, **kwargs)
        if mode.get("graphs"):  # decode steps through DecodeGraphs' static buffers (eager replays: the CPU)
            gen.runner.graphs = DecodeGraphs(model, cache, gen.max_batch_size, 128, capture=False)
        for ids in _scenario_prompts(tokenizer):
            job = folio.DynamicJob(input_ids=ids, max_new_tokens=8, gen_settings=GREEDY, stop_conditions=[])
            gen.enqueue(job)
            while gen.num_remaining_jobs():
                gen.iterate()
                gen.cache_manager.check()
            tokens.append(job.generated_ids)
        counts["ahead"] += gen.pipeline.num_steps_ahead
        counts["drafted"] += gen.speculator.num_drafted if gen.speculator is not None else 0
    sent = None if cache.mirror is None else {op.name: n for op, n in cache.mirror.num_sent.items()}
    return tokens, sent, counts


@pytest.mark.timeout(180)
def test_generator_at_tp2_gives_the_tokens_of_one_process(peaked_dir):
    host = {"host_cache_bytes": 8 << 20}
    # plain steps; steps launched ahead (decode rows fed the sampled ids on the device); verify rows of n-gram drafts
    modes = [host, {**host, "decode_ahead": True, "prefill_ahead": True}, {"use_ngram_draft": True},
             {"graphs": True, "decode_ahead": True}]
    cache_kwargs = {"num_tokens": 10 * PAGE_SIZE, "page_size": PAGE_SIZE}
    drive = functools.partial(_generate, model_dir=peaked_dir, modes=modes)
    tokens, sent, counts = launch(replica_main, TP, (peaked_dir, drive, {"dtype": torch.float32}, cache_kwargs),
                                  **LAUNCH)
    model = folio.Model.from_pretrained(peaked_dir, progress=False, dtype=torch.float32)
    want, _, _ = _generate(model, folio.Cache(model, **cache_kwargs), peaked_dir, modes)
    assert tokens == want
    assert all(len(t) == 8 for t in tokens) and counts["ahead"] > 0 and counts["drafted"] > 0
    # every kind of cache write reached the worker: forwards, slot copies, host write-backs and fetches
    for op in (Op.FORWARD, Op.COPY_SLOTS, Op.WRITE_BACK, Op.FETCH, Op.REPLAY):
        assert sent.get(op.name, 0) > 0, sent
    assert sent[Op.SETUP_GRAPHS.name] == 1  # decode graphs: every rank built its own; replays announced
    assert sent[Op.SETUP_CACHE.name] == 1 and sent[Op.SETUP_HOST.name] == 2  # (a host tier per generator with one)


# --- the launcher ---------------------------------------------------------------------------------------------------

def _fail_on_rank_1(tp):
    if tp.rank == 1:
        raise ValueError("rank 1 cannot go on")
    torch.distributed.barrier()  # rank 0 waits for rank 1, which never comes: the launcher ends it
    return "unreachable"


@pytest.mark.timeout(120)
def test_a_failing_rank_fails_the_launch_with_its_traceback():
    with pytest.raises(RuntimeError, match="(?s)rank 1 failed.*ValueError: rank 1 cannot go on"):
        launch(_fail_on_rank_1, TP, **LAUNCH)
