"""The all-reduce through the peers' memory (folio.model.peer_all_reduce, native/cuda/peer_all_reduce.cu) on two
GPUs: its sums equal the sum of the ranks' inputs computed here (and NCCL's), bit for bit alike on every rank, for
every dtype, for messages of many sizes one after another (the kernel's two slots and its count of calls), for views,
and replayed from a CUDA graph with new inputs; its broadcasts from rank 0 reach every rank; its form fused with the
residual add and RMSNorm gives the sum, the add and the norm computed here; a model split over two GPUs gives the
same logits through it (the fused form, and the decode graphs' inputs broadcast through it) as through NCCL and as
one process. Needs two GPUs with peer access (skipped otherwise)."""

from __future__ import annotations

import dataclasses
import faulthandler
import functools

import pytest
import torch
import torch.distributed as dist
from test_tensor_parallel import GREEDY, PAGE_SIZE, _forward_steps, _scenario_prompts, llama_dir  # noqa: F401

import folio
from folio.model import peer_all_reduce
from folio.options import EngineOptions
from folio.tp_launch import launch, replica_main

TP = 2
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < TP
                       or not torch.cuda.can_device_access_peer(0, 1), reason="needs two GPUs with peer access"),
]
LAUNCH = dict(backend="nccl", timeout_s=120)
STACKS_AFTER_S = 50  # a rank still running then prints its threads' stacks (where a hang waits)
# element counts: one vector, a decode row of hidden 4096, rows of several blocks, a size that leaves blocks idle,
# the largest message the slots take between two ranks (32 MiB in float32), one over it (NCCL)
MAX_BYTES = peer_all_reduce.max_bytes_for(TP)
SIZES = [8, 4096, 64 * 4096 + 8, 3 * 512 * 8, MAX_BYTES // 4, MAX_BYTES // 4 + 8]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _inputs(rank: int, numel: int, dtype: torch.dtype, call: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(1000 * call + 17 * rank + numel)
    return torch.randn(numel, device="cuda", generator=gen).to(dtype)


def _sum_here(tp, x: torch.Tensor) -> torch.Tensor:
    """The oracle: every rank's input gathered, summed in float32 in rank order, rounded once."""
    parts = [torch.empty_like(x) for _ in range(tp.world_size)]
    dist.all_gather(parts, x)
    return torch.stack([p.float() for p in parts]).sum(0).to(x.dtype)


def _rank_checks(tp):
    faulthandler.dump_traceback_later(STACKS_AFTER_S, exit=False)
    peer = peer_all_reduce.connect(tp, torch.device("cuda", tp.rank), "peer")
    tp = dataclasses.replace(tp, peer=peer)
    results = {}
    call = 0
    for dtype in DTYPES:
        for numel in SIZES:  # sizes one after another: the calls' slots alternate with other grids in between
            x = _inputs(tp.rank, numel, dtype, call)
            want = _sum_here(tp, x)
            took = peer.takes(x)
            tp.all_reduce(x)
            results[(str(dtype), numel)] = (took, x.cpu(), want.cpu())
            call += 1
    # a view (every other row of a matrix): summed through a copy, the rest of the matrix untouched
    matrix = _inputs(tp.rank, 64 * 256, torch.bfloat16, call).view(64, 256)
    before = matrix.clone()
    want = _sum_here(tp, matrix[::2].contiguous())
    tp.all_reduce(matrix[::2])
    results["view_rows"] = (matrix[::2].cpu(), want.cpu(), matrix[1::2].cpu(), before[1::2].cpu())
    # broadcasts from rank 0 (bytes of any type; sizes one after another, sums between them), and one it leaves
    # to NCCL (not whole 16-byte vectors)
    broadcasts = []
    for dtype, numel in ((torch.int32, 4), (torch.int64, 4096 + 2), (torch.uint8, 3 * 512 * 16), (torch.int32, 3)):
        x = torch.arange(numel, device="cuda").to(dtype) * (tp.rank + 1) + 7 * tp.rank
        took = tp.peer.broadcast(x)
        if not took:
            tp.broadcast(x)  # (through NCCL)
        everyone = [torch.empty_like(x) for _ in range(tp.world_size)]
        dist.all_gather(everyone, x)
        broadcasts.append((took, [t.cpu() for t in everyone], torch.arange(numel).to(dtype)))
        tp.all_reduce(_inputs(tp.rank, 4096, torch.bfloat16, call))
        call += 1
    results["broadcasts"] = broadcasts
    # a CUDA graph of three sums of different sizes, replayed with new inputs
    buffers = [torch.zeros(n, device="cuda", dtype=torch.bfloat16) for n in (4096, 8 * 4096, 4096)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for b in buffers:  # warm-up outside the capture (same calls on every rank)
            tp.all_reduce(b)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for b in buffers:
            tp.all_reduce(b)
    replays = []
    for replay in range(5):
        inputs = [_inputs(tp.rank, b.numel(), b.dtype, 100 + 10 * replay + i) for i, b in enumerate(buffers)]
        wants = [_sum_here(tp, x) for x in inputs]
        for b, x in zip(buffers, inputs):
            b.copy_(x)
        graph.replay()
        if replay == 2:  # eager calls between replays keep the counts in step with the graph's
            extra = _inputs(tp.rank, 4096, torch.bfloat16, 999)
            tp.all_reduce(extra)
        replays.append([(b.cpu(), w.cpu()) for b, w in zip(buffers, wants)])
    torch.cuda.synchronize()
    del graph
    results["graph"] = replays
    return results


@pytest.mark.timeout(300)
def test_sums_equal_the_oracle_on_every_rank():
    rank0 = launch(_rank_checks, TP, (), **LAUNCH)
    for dtype in DTYPES:
        for numel in SIZES:
            took, got, want = rank0[(str(dtype), numel)]
            assert took == (numel * torch.empty((), dtype=dtype).element_size() <= MAX_BYTES)
            # two ranks: a + b rounded once, as the oracle: equal bits
            assert torch.equal(got, want), f"{dtype} {numel}: {(got.float() - want.float()).abs().max()}"
    for took, everyone, want in rank0["broadcasts"]:
        assert took == (want.numel() * want.element_size() % 16 == 0)
        assert all(torch.equal(got, want) for got in everyone), f"{want.dtype} {want.numel()}: rank 0's values"
    rows, want, untouched, before = rank0["view_rows"]
    assert torch.equal(rows, want) and torch.equal(untouched, before)
    for replay in rank0["graph"]:
        for got, want in replay:
            assert torch.equal(got, want)


# [rows, hidden] of the fused form: one row (decode), rows of several blocks, more rows than blocks (64), a row of one
# 16-byte vector in bfloat16, and a hidden size of several vectors a thread (8192)
NORM_SHAPES = [(1, 4096), (7, 4096), (130, 512), (3, 8), (2, 8192)]
NORM_EPS = 1e-5


def _norm_here(residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    r = residual.float()
    return (r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + NORM_EPS) * weight.float()).to(residual.dtype)


def _norm_checks(tp):
    faulthandler.dump_traceback_later(STACKS_AFTER_S, exit=False)
    peer = peer_all_reduce.connect(tp, torch.device("cuda", tp.rank), "peer")
    tp = dataclasses.replace(tp, peer=peer)
    results, call = [], 0
    for dtype in DTYPES:
        for rows, hidden in NORM_SHAPES:
            x = _inputs(tp.rank, rows * hidden, dtype, call).view(rows, hidden)
            residual = _inputs(0, rows * hidden, dtype, call + 500).view(rows, hidden)  # the same on every rank
            weight = 1 + 0.1 * _inputs(0, hidden, dtype, call + 900)
            total = _sum_here(tp, x)
            want_residual = (residual.float() + total.float()).to(dtype)
            want_x = _norm_here(want_residual, weight)
            fused = tp.all_reduce_add_rms_norm(x, residual, weight, NORM_EPS)
            plain = _inputs(tp.rank, 4096, dtype, call + 300)  # a plain sum between fused ones (one count of calls)
            want_plain = _sum_here(tp, plain)
            tp.all_reduce(plain)
            gathered = [torch.empty_like(x) for _ in range(tp.world_size)]
            dist.all_gather(gathered, x)
            alike = all(torch.equal(g, x) for g in gathered)
            results.append((str(dtype), rows, hidden, fused, alike, x.cpu(), want_x.cpu(), residual.cpu(),
                            want_residual.cpu(), torch.equal(plain, want_plain)))
            call += 1
    # captured in a CUDA graph (as decode runs it), replayed with new inputs
    x = torch.zeros(4, 4096, device="cuda", dtype=torch.bfloat16)
    residual, weight = torch.zeros_like(x), torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tp.all_reduce_add_rms_norm(x, residual, weight, NORM_EPS)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tp.all_reduce_add_rms_norm(x, residual, weight, NORM_EPS)
    replays = []
    for replay in range(3):
        new_x = _inputs(tp.rank, x.numel(), x.dtype, 700 + replay).view_as(x)
        new_residual = _inputs(0, x.numel(), x.dtype, 800 + replay).view_as(x)
        want_residual = (new_residual.float() + _sum_here(tp, new_x).float()).to(x.dtype)
        x.copy_(new_x)
        residual.copy_(new_residual)
        graph.replay()
        replays.append((x.cpu(), _norm_here(want_residual, weight).cpu(), residual.cpu(), want_residual.cpu()))
    torch.cuda.synchronize()
    del graph
    return results, replays


@pytest.mark.timeout(300)
def test_the_fused_sum_add_and_norm_equal_the_three_done_here():
    results, replays = launch(_norm_checks, TP, (), **LAUNCH)
    tolerance = {"torch.bfloat16": 1e-2, "torch.float16": 2e-3, "torch.float32": 1e-5}
    for dtype, rows, hidden, fused, alike, got, want, residual, want_residual, plain_ok in results:
        where = f"{dtype} [{rows}, {hidden}]"
        assert fused, f"{where}: not taken by the fused kernel"
        assert alike, f"{where}: the ranks' outputs differ"
        assert plain_ok, f"{where}: the plain sum after it is wrong"
        # the residual: a + b rounded, then residual + that rounded, as the kernel: equal bits
        off = (residual.float() - want_residual.float()).abs().max()
        assert torch.equal(residual, want_residual), f"{where}: residual off by {off}"
        # the norm: the sum of squares in another order (a last-bit difference of the scale)
        torch.testing.assert_close(got, want, rtol=tolerance[dtype], atol=tolerance[dtype], msg=where)
    for got, want, residual, want_residual in replays:
        assert torch.equal(residual, want_residual)
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def _logits(model, cache):
    logits, _ = _forward_steps(model, cache)
    return [t.cpu() for t in logits]


@pytest.mark.timeout(300)
def test_a_split_model_gives_the_logits_of_nccl_and_of_one_process(llama_dir):  # noqa: F811
    cache_kwargs = {"num_tokens": 8 * PAGE_SIZE, "page_size": PAGE_SIZE}

    def kwargs(mode):
        return {"dtype": torch.float32, "device": "cuda", "options": EngineOptions(tp_all_reduce=mode)}

    got = launch(_two_models, TP, (llama_dir, [kwargs("peer"), kwargs("nccl")], cache_kwargs, _logits), **LAUNCH)
    model = folio.Model.from_pretrained(llama_dir, progress=False, dtype=torch.float32, device="cuda")
    want = _logits(model, folio.Cache(model, **cache_kwargs))
    peer, nccl, used_peer = got
    assert used_peer, "the peer model summed through NCCL"
    for step, (p, n, w) in enumerate(zip(peer, nccl, want)):
        scale = float(w.abs().max()) if w.numel() else 1.0
        torch.testing.assert_close(p, n, rtol=1e-5, atol=1e-5 * scale, msg=f"step {step}: peer against NCCL")
        torch.testing.assert_close(p, w, rtol=1e-5, atol=1e-5 * scale, msg=f"step {step}: against one process")


def _two_models(tp, model_dir, model_kwargs_list, cache_kwargs, drive):
    faulthandler.dump_traceback_later(STACKS_AFTER_S, exit=False)
    def drive_and_report(model, cache):
        return drive(model, cache), model.tensor_parallel.peer is not None

    out = [replica_main(tp, model_dir, drive_and_report, kw, cache_kwargs) for kw in model_kwargs_list]
    if tp.rank != 0:
        return None
    (peer, used_peer), (nccl, used_nccl_peer) = out
    assert not used_nccl_peer
    return peer, nccl, used_peer


def _graph_tokens(model, cache, model_dir):
    """Greedy tokens of the scenario's prompts, one at a time, decoded through captured CUDA graphs (under tensor
    parallelism: their inputs broadcast and their sums made inside the graphs), and whether the peers' memory was
    used (None in one process)."""
    tokenizer = folio.Tokenizer.from_pretrained(model_dir)
    gen = folio.DynamicGenerator(model=model, cache=cache, tokenizer=tokenizer, cuda_graphs=True, max_batch_size=4,
                                 max_seq_len=256)
    tokens = []
    for ids in _scenario_prompts(tokenizer):
        job = folio.DynamicJob(input_ids=ids, max_new_tokens=12, gen_settings=GREEDY, stop_conditions=[])
        gen.enqueue(job)
        while gen.num_remaining_jobs():
            gen.iterate()
        tokens.append(job.generated_ids)
    tp = model.tensor_parallel
    return tokens, None if tp is None else tp.peer is not None


@pytest.mark.timeout(300)
def test_a_split_generator_decodes_through_graphs_the_tokens_of_one_process(peaked_dir):
    cache_kwargs = {"num_tokens": 16 * PAGE_SIZE, "page_size": PAGE_SIZE}
    model_kwargs = {"dtype": torch.float32, "device": "cuda", "options": EngineOptions(tp_all_reduce="peer")}
    drive = functools.partial(_graph_tokens, model_dir=peaked_dir)
    tokens, used_peer = launch(replica_main, TP, (peaked_dir, drive, model_kwargs, cache_kwargs), **LAUNCH)
    model = folio.Model.from_pretrained(peaked_dir, progress=False, dtype=torch.float32, device="cuda")
    want, _ = _graph_tokens(model, folio.Cache(model, **cache_kwargs), peaked_dir)
    assert used_peer
    assert all(len(t) == 12 for t in tokens) and tokens == want
