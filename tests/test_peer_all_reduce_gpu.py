"""The all-reduce through the peers' memory (folio.model.peer_all_reduce, native/cuda/peer_all_reduce.cu) on two
GPUs: its sums equal the sum of the ranks' inputs computed here (and NCCL's), bit for bit alike on every rank, for
every dtype, for messages of many sizes one after another (the kernel's two slots and its count of calls), for views,
and replayed from a CUDA graph with new inputs; a model split over two GPUs gives the same logits through it as
through NCCL and as one process. Needs two GPUs with peer access (skipped otherwise)."""

from __future__ import annotations

import dataclasses
import faulthandler

import pytest
import torch
import torch.distributed as dist
from test_tensor_parallel import PAGE_SIZE, _forward_steps, llama_dir  # noqa: F401 - the fixture

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
# the largest message the slots take (8 MiB in float32), one over it (NCCL)
SIZES = [8, 4096, 64 * 4096 + 8, 3 * 512 * 8, peer_all_reduce.MAX_BYTES // 4, peer_all_reduce.MAX_BYTES // 4 + 8]
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
            assert took == (numel * torch.empty((), dtype=dtype).element_size() <= peer_all_reduce.MAX_BYTES)
            # two ranks: a + b rounded once, as the oracle: equal bits
            assert torch.equal(got, want), f"{dtype} {numel}: {(got.float() - want.float()).abs().max()}"
    rows, want, untouched, before = rank0["view_rows"]
    assert torch.equal(rows, want) and torch.equal(untouched, before)
    for replay in rank0["graph"]:
        for got, want in replay:
            assert torch.equal(got, want)


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
