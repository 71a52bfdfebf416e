"""The host tier (folio.cache.host_tier, folio.host_pages): exact bookkeeping (which slot, which events, which
copies), K/V bit-exact through GPU pool -> host -> pool, and the generator reusing a prefix evicted to the host:
fewer prompt tokens computed, the same greedy outputs as without the tier."""

from __future__ import annotations

import pytest
import torch

import folio
from folio.cache import PageEvent, PageEventKind, PagePool
from folio.cache.host_tier import HostTransfers, promote, take_transfers
from folio.cache.manager import KVCacheManager
from folio.hashing import prompt_page_hashes
from folio.host_pages import resolve_num_host_pages
from folio.sequence import Sequence

PAGE_SIZE = 4
STORED, EVICTED, MOVED = PageEventKind.STORED, PageEventKind.EVICTED, PageEventKind.MOVED_TO_HOST


def fill(pool: PagePool, tokens: list[int]) -> tuple[list[int], list[bytes]]:
    """A job that computed the full pages of `tokens` and finished: its pages are cached."""
    hashes = prompt_page_hashes(tokens + [0], PAGE_SIZE)
    pages = pool.allocate(len(hashes))
    for idx, (page, page_hash) in enumerate(zip(pages, hashes)):
        parent = hashes[idx - 1] if idx else None
        assert pool.set_ready(page, page_hash, parent, tokens[idx * PAGE_SIZE:(idx + 1) * PAGE_SIZE])
    pool.release(pages)
    return pages, hashes


def test_evicted_pages_move_to_host_and_come_back():
    pool = PagePool(4, PAGE_SIZE, num_host_pages=3)
    pages_a, a = fill(pool, list(range(8)))  # 2 pages
    pages_b, b = fill(pool, list(range(100, 108)))  # 2 pages, released after a's
    pool.drain_events()
    # leaf first, least recently released first: a's leaf, then a's root (a leaf now, older than b's), then b's leaf
    taken = pool.allocate(3)
    assert taken == [pages_a[1], pages_a[0], pages_b[1]]
    assert pool.drain_events() == [PageEvent(MOVED, a[1]), PageEvent(MOVED, a[0]), PageEvent(MOVED, b[1])]
    assert pool.host.hashes() == (a[1], a[0], b[1])
    assert pool.lookup(a).num_ready == 0 and pool.host.num_leading(a) == 2
    pool.check()
    assert take_transfers(pool) == HostTransfers(to_host=((pages_a[1], 0), (pages_a[0], 1), (pages_b[1], 2)),
                                                 ticket=0)
    pool.release(taken)
    # the host is full: b's root, evicted after the free pages are gone, recycles the oldest slot (a's leaf: lost)
    taken = pool.allocate(4)
    assert pool.drain_events() == [PageEvent(EVICTED, a[1]), PageEvent(MOVED, b[0])]
    assert pool.host.hashes() == (a[0], b[1], b[0])
    assert take_transfers(pool).to_host == ((pages_b[0], 0),)
    pool.release(taken)
    pool.check()
    # prefix hits: a's root only (its leaf is gone), b's two pages; each ready at once, filled by a scheduled copy,
    # its host entry now a mirror of the GPU page (the slot keeps its copy)
    promoted_a = promote(pool, a)
    promoted_b = promote(pool, b)
    assert promoted_a == [0] and promoted_b == [1, 2]
    assert pool.lookup(a).num_ready == 1 and pool.lookup(b).num_ready == 2 and pool.host.num_used == 3
    assert pool.host.mirrors() == {a[0]: 0, b[0]: 1, b[1]: 2} and pool.host.num_leading(b) == 0
    pool.check()
    assert take_transfers(pool).from_host == ((1, 0), (0, 1), (2, 2))  # (slot, page): a0, b0, b1
    pool.release(promoted_a + promoted_b)
    assert pool.num_cached == 3 and pool.num_free == 1
    pool.check()


def test_promote_takes_the_host_run_and_pins_until_the_plan_takes_it():
    pool = PagePool(3, PAGE_SIZE, num_host_pages=4)
    pages_a, a = fill(pool, list(range(12)))  # 3 pages: the whole pool
    pool.release(pool.allocate(3))  # evicts all three to the host (leaf first), then frees them
    assert pool.host.hashes() == (a[2], a[1], a[0]) and pool.num_free == 3
    take_transfers(pool)
    pool.drain_events()
    promoted = promote(pool, a)
    assert promoted == [0, 1, 2]
    assert pool.drain_events() == [PageEvent(STORED, a[0]), PageEvent(STORED, a[1]), PageEvent(STORED, a[2])]
    assert [pool.refcount(p) for p in promoted] == [2, 2, 2]  # the caller's reference and the pin
    assert pool.host.mirrors() == {a[0]: 0, a[1]: 1, a[2]: 2} and pool.lookup(a).num_ready == 3
    assert all(pool.host.is_arriving(p) for p in promoted)
    pool.check()
    transfers = take_transfers(pool)
    # slots were handed out lowest first when the pages moved: a[2] -> 0, a[1] -> 1, a[0] -> 2
    assert transfers.from_host == ((2, 0), (1, 1), (0, 2)) and transfers.to_host == ()
    assert [pool.refcount(p) for p in promoted] == [1, 1, 1] and not pool.host.is_arriving(0)
    pool.release(promoted)
    assert pool.host.hashes() == (a[2], a[1], a[0]) and pool.num_cached == 3
    # evicted again: no copy (the mirrors have it), each entry now the newest host-only one
    pool.drain_events()
    pool.release(pool.allocate(3))
    assert pool.drain_events() == [PageEvent(MOVED, a[2]), PageEvent(MOVED, a[1]), PageEvent(MOVED, a[0])]
    assert take_transfers(pool) == HostTransfers(ticket=2, wait_ticket=0)  # (the write-backs of plan 0 filled them)
    assert pool.host.mirrors() == {} and pool.host.num_leading(a) == 3
    pool.check()


def test_slots_read_by_a_plan_are_not_reused_by_the_same_plan():
    pool = PagePool(2, PAGE_SIZE, num_host_pages=2)
    _, a = fill(pool, list(range(4)))
    _, b = fill(pool, list(range(50, 54)))
    pool.release(pool.allocate(2))  # both to the host: slots 0 (a) and 1 (b)
    take_transfers(pool)
    _, c = fill(pool, list(range(70, 74)))  # page 0 holds c, page 1 free
    pool.drain_events()
    # promoting a needs one page: the free one; then a second allocation evicts c; the only slot that could take it
    # is b's (a's slot is read by this plan's host -> GPU copy): b is dropped, c takes slot 1
    (page_a,) = promote(pool, a)
    (other,) = pool.allocate(1)
    assert pool.drain_events() == [PageEvent(STORED, a[0]), PageEvent(EVICTED, b[0]), PageEvent(MOVED, c[0])]
    transfers = take_transfers(pool)
    assert transfers == HostTransfers(to_host=((other, 1),), from_host=((0, page_a),), ticket=1)
    pool.check()


def test_a_recomputed_hash_keeps_its_host_entry_as_a_mirror_and_reset_forgets_the_host():
    pool = PagePool(2, PAGE_SIZE, num_host_pages=2)
    _, a = fill(pool, list(range(4)))
    pool.release(pool.allocate(2))
    assert a[0] in pool.host
    take_transfers(pool)
    pages, again = fill(pool, list(range(4)))  # computed again on the GPU
    assert again == a and pool.host.mirrors() == {a[0]: pages[0]} and pool.host.num_used == 1
    pool.check()
    pool.drain_events()
    pool.release(pool.allocate(2))
    assert pool.drain_events() == [PageEvent(MOVED, a[0])] and take_transfers(pool) == HostTransfers(
        ticket=1, wait_ticket=0)  # no copy
    pool.reset()
    assert pool.drain_events() == [PageEvent(EVICTED, a[0])] and pool.host.num_used == 0
    pool.check()


def test_write_through_mirrors_each_computed_page_so_that_evicting_it_copies_nothing():
    pool = PagePool(3, PAGE_SIZE, num_host_pages=3, host_write_through=True)
    pages_a, a = fill(pool, list(range(8)))  # 2 pages: each gets a slot and a mirror copy at once
    assert pool.host.mirrors() == {a[0]: pages_a[0], a[1]: pages_a[1]} and pool.host.num_leading(a) == 0
    pool.check()
    assert take_transfers(pool) == HostTransfers(mirror=((pages_a[0], 0), (pages_a[1], 1)), ticket=0)
    pool.drain_events()
    # evicting a's leaf: no copy, the forward must not overwrite the page before plan 0's mirror copy ran
    (taken,) = [p for p in pool.allocate(2) if p == pages_a[1]]
    assert pool.drain_events() == [PageEvent(MOVED, a[1])]
    assert pool.host.mirrors() == {a[0]: pages_a[0]} and pool.host.hashes() == (a[0], a[1])
    assert take_transfers(pool) == HostTransfers(ticket=1, wait_ticket=0)
    pool.check()


def test_a_recycled_mirror_loses_nothing_and_its_unmade_copy_is_dropped():
    pool = PagePool(2, PAGE_SIZE, num_host_pages=1, host_write_through=True)
    (page_a,), a = fill(pool, list(range(4)))
    (page_b,), b = fill(pool, list(range(50, 54)))  # the one slot goes to b: a's mirror is recycled, no event
    assert pool.drain_events() == [PageEvent(STORED, a[0]), PageEvent(STORED, b[0])]
    assert pool.host.mirrors() == {b[0]: page_b} and pool.lookup(a).num_ready == 1
    pool.check()
    assert take_transfers(pool) == HostTransfers(mirror=((page_b, 0),), ticket=0)  # a's copy is not made


def test_manager_counts_host_hits_and_skips_partial_copies_from_arriving_pages():
    manager = KVCacheManager(4, PAGE_SIZE, num_host_pages=8)
    tokens = list(range(13))
    seq = _seq(tokens)
    manager.start(seq)
    assert manager.allocate(seq, 12)
    manager.commit(seq, 12)
    manager.free(seq)
    other = _seq(list(range(200, 216)))
    manager.start(other)
    assert manager.allocate(other, 16)  # evicts the three pages of `seq` to the host
    manager.free(other)
    transfers = manager.take_transfers()
    assert len(transfers.to_host) == 3
    again = _seq(tokens)
    manager.start(again)
    advanced, copies = manager.reuse_prefix(again)
    assert advanced and again.num_cached_tokens == 12 and copies == []
    stats = manager.stats()
    assert stats.num_host_hit_pages == 3 and stats.num_pages_to_host == 3 + 0 and stats.num_pages_from_host == 3
    manager.check()
    assert len(manager.take_transfers().from_host) == 3
    manager.check()


def _seq(tokens: list[int]) -> Sequence:
    from types import SimpleNamespace

    job = SimpleNamespace(max_new_tokens=1, prompt_tokens=len(tokens))
    return Sequence(job=job, token_ids=list(tokens))


# --- the device side (CPU: plain copies) -------------------------------------------------------------------------

@pytest.mark.parametrize("write_through", [True, False])
def test_kv_pages_round_trip_bit_exactly(peaked, write_through):
    """K/V of a model run, moved GPU pool -> host (mirrored as computed, or written back as evicted) -> other pages
    of the pool, equal the originals bit for bit."""
    gen = peaked.generator(num_tokens=16 * 8, page_size=16, host_cache_bytes=1 << 20, host_write_through=write_through)
    _check_round_trip(gen, peaked.tokenizer)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("write_through", [True, False])
def test_kv_pages_round_trip_bit_exactly_on_cuda(peaked_dir, write_through):
    """The same through pinned buffers and the copy stream."""
    model = folio.Model.from_pretrained(peaked_dir, device="cuda", progress=False)
    tokenizer = folio.Tokenizer.from_pretrained(peaked_dir)
    cache = folio.Cache(model, num_tokens=16 * 8, page_size=16)
    gen = folio.DynamicGenerator(model, cache, tokenizer, host_cache_bytes=1 << 20, host_write_through=write_through)
    assert gen.host_pages.stream is not None
    _check_round_trip(gen, tokenizer)


def _check_round_trip(gen, tokenizer):
    assert gen.host_pages is not None and gen.host_pages.num_host_pages >= 4
    ids = tokenizer.encode("A lighthouse stood on the rock where the gulls gathered every evening " * 2)
    job = folio.DynamicJob(input_ids=ids, max_new_tokens=2, gen_settings=folio.SamplerSettings.greedy(),
                           stop_conditions=[])
    gen.enqueue(job)
    while gen.num_remaining_jobs():
        gen.step()
    manager = gen.cache_manager
    hashes = prompt_page_hashes(ids, 16)
    pool = manager._pool
    pages = [pool._ready[h] for h in hashes]
    before = [t[:, pages].clone() for t in gen.cache.page_tensors()]
    assert all(t.abs().sum() > 0 for t in before)
    host = gen.host_pages
    evicting = pool.allocate(pool.num_allocatable)  # every cached page moves to the host
    transfers = take_transfers(pool)  # (with write-through: the mirror copies of the last forward's pages only)
    assert (transfers.to_host == ()) == pool.host.write_through
    host.write_back(transfers)
    for t in gen.cache.page_tensors():
        t.fill_(float("nan"))  # whatever the pool holds now is garbage
    pool.release(evicting)
    pool.allocate(1)  # page 0 stays taken: the pages come back elsewhere
    promoted = promote(pool, hashes)
    assert len(promoted) == len(hashes) and set(promoted).isdisjoint({0})
    host.fetch(take_transfers(pool))
    if host.stream is not None:
        torch.cuda.synchronize()
    after = [t[:, promoted] for t in gen.cache.page_tensors()]
    for b, a in zip(before, after):
        assert torch.equal(b, a)


def test_host_cache_bytes_resolution(peaked):
    cache = folio.Cache(peaked.model, num_tokens=16 * 4, page_size=16)
    page = sum(t[:, 0].numel() * t.element_size() for t in cache.page_tensors())
    assert resolve_num_host_pages(cache, None) == 0  # off on the CPU unless given
    assert resolve_num_host_pages(cache, 5 * page + 1) == 5
    with pytest.raises(ValueError):
        resolve_num_host_pages(cache, -1)


# --- the generator ------------------------------------------------------------------------------------------------

def _run(gen, token_lists, stats):
    from test_generator import make_jobs, run_to_end

    outs = []
    for ids in token_lists:  # one after another: each prefix is evicted by the next ones
        jobs = make_jobs([ids], max_new_tokens=8)
        run_to_end(gen, jobs, stats=stats)
        outs.append(jobs[0].generated_ids)
    return outs


@pytest.mark.parametrize("ahead,write_through", [(False, True), (True, True), (True, False)])
def test_generator_reuses_a_prefix_from_the_host(peaked, ahead, write_through):
    tok = peaked.tokenizer
    prefixes = [tok.encode(f"Preamble {k}: the keeper counted ships, storms and gulls on the rock " * 2)
                for k in range(3)]
    token_lists = [p + tok.encode(f" question {i}?") for i in range(2) for p in prefixes]
    kwargs = dict(num_tokens=16 * 10, page_size=16, decode_ahead=ahead, prefill_ahead=ahead)
    with_stats, without_stats = [], []
    gen = peaked.generator(host_cache_bytes=8 << 20, host_write_through=write_through, **kwargs)
    with_host = _run(gen, token_lists, with_stats)
    without = _run(peaked.generator(**kwargs), token_lists, without_stats)
    assert with_host == without
    computed = sum(s.num_prompt_tokens for s in with_stats)
    computed_without = sum(s.num_prompt_tokens for s in without_stats)
    stats = gen.prefix_cache_stats()
    assert stats.num_host_hit_pages > 0 and stats.num_pages_to_host > 0
    assert stats.num_pages_from_host >= stats.num_host_hit_pages
    # the second round finds each prefix's full pages on the host: only the questions are computed
    saved = computed_without - computed
    assert saved >= stats.num_host_hit_pages * 16 * 0.75, (computed, computed_without, stats)
    assert computed < 0.75 * computed_without


# --- what routers learn ------------------------------------------------------------------------------------------

def test_router_events_keep_host_pages_held_and_say_which():
    import json

    from folio.router.digest import build_digest, parse_digest
    from folio.router.events import CacheEvents
    from folio.router.index import PrefixIndex
    from folio.router.keys import page_key

    pool = PagePool(2, 64, num_host_pages=2)
    events = CacheEvents(64, block_tokens=64, dense_tokens=0, dense_key_tokens=64)
    index = PrefixIndex(clock=lambda: 0.0)
    epoch = [0]

    def publish():
        events.add(pool.drain_events())
        epoch[0] += 1
        report = json.loads(json.dumps(build_digest(pool, events, 0, 0, epoch[0], instance_id="a")))
        digest = parse_digest(report)
        index.report("r", digest)
        return report, digest

    tokens = list(range(128))
    hashes = prompt_page_hashes(tokens + [0], 64)
    keys = [page_key(h) for h in hashes]
    pages = pool.allocate(2)
    for idx, page in enumerate(pages):
        pool.set_ready(page, hashes[idx], hashes[idx - 1] if idx else None, tokens[idx * 64:(idx + 1) * 64])
    pool.release(pages)
    report, digest = publish()
    assert [len(b) for b in report["batches"]] == [3]  # no host pages yet: batches as before
    assert set(digest.batches[-1].stored) == set(keys)
    pool.release(pool.allocate(2))  # both pages move to the host
    take_transfers(pool)
    report, digest = publish()
    batch = digest.batches[-1]
    assert set(batch.moved) == set(keys) and len(batch.stored) == 0 and len(batch.evicted) == 0
    assert index.match(keys)[index.slot_of("r")].num_blocks == 2  # still a prefix hit for the router
    promoted = promote(pool, hashes[:1])  # the first page comes back to the GPU
    take_transfers(pool)
    _, digest = publish()
    assert list(digest.batches[-1].stored) == keys[:1] and len(digest.batches[-1].evicted) == 0
    pool.release(promoted)
    pool.release(pool.allocate(2))  # the GPU page goes back to the host (its entry, a mirror since, without a copy)
    take_transfers(pool)
    _, digest = publish()
    assert len(digest.batches[-1].evicted) == 0 and list(digest.batches[-1].moved) == keys[:1]
    pool.reset()  # the host forgets too
    _, digest = publish()
    assert set(digest.batches[-1].evicted) == set(keys)
    assert index.slot_of("r") not in index.match(keys)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("ahead,write_through", [(False, True), (True, True), (True, False)])
def test_cuda_generator_with_the_host_tier_equals_without(peaked_dir, ahead, write_through):
    """On CUDA: pinned buffers, the copy stream, decode graphs and launch-ahead; outputs equal, prompt work drops."""
    parts = folio.Model.from_pretrained(peaked_dir, device="cuda", progress=False)
    tokenizer = folio.Tokenizer.from_pretrained(peaked_dir)

    def generator(**kwargs):
        cache = folio.Cache(parts, num_tokens=16 * 10, page_size=16)
        return folio.DynamicGenerator(parts, cache, tokenizer, decode_ahead=ahead, prefill_ahead=ahead, **kwargs)

    prefixes = [tokenizer.encode(f"Preamble {k}: the keeper counted ships, storms and gulls on the rock " * 2)
                for k in range(3)]
    token_lists = [p + tokenizer.encode(f" question {i}?") for i in range(2) for p in prefixes]
    with_stats, without_stats = [], []
    gen = generator(host_cache_bytes=8 << 20, host_write_through=write_through)
    assert gen.host_pages.stream is not None and gen.host_pages.buffers[0].is_pinned()
    assert _run(gen, token_lists, with_stats) == _run(generator(), token_lists, without_stats)
    stats = gen.prefix_cache_stats()
    computed = sum(s.num_prompt_tokens for s in with_stats)
    computed_without = sum(s.num_prompt_tokens for s in without_stats)
    assert stats.num_host_hit_pages > 0 and stats.num_pages_from_host >= stats.num_host_hit_pages
    # The host tier never costs prompt work. (On an H200 this configuration did not make the GPU-only run lose
    # pages it needed again: both computed 216 prompt tokens. The saving is asserted on the CPU by
    # test_generator_reuses_a_prefix_from_the_host and measured at scale by bench/host_tier.py.)
    assert computed <= computed_without, (computed, computed_without, stats)


def test_the_default_host_tier_follows_a_containers_memory_limit(tmp_path, monkeypatch):
    """In a pod, the container's cgroup limit, not the machine's RAM, bounds the default host tier."""
    from folio import host_pages

    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    assert host_pages.container_memory_limit((str(v2), str(v1))) is None  # no file: no limit
    v1.write_text(str(1 << 63) + "\n")
    assert host_pages.container_memory_limit((str(v2), str(v1))) is None  # cgroup v1's "unlimited"
    v1.write_text("8589934592\n")
    assert host_pages.container_memory_limit((str(v2), str(v1))) == 8 << 30
    v2.write_text("max\n")
    assert host_pages.container_memory_limit((str(v2), str(v1))) is None  # v2 first: unlimited there
    v2.write_text("4294967296\n")
    assert host_pages.container_memory_limit((str(v2), str(v1))) == 4 << 30
    monkeypatch.setattr(host_pages, "CGROUP_MEMORY_LIMIT_FILES", (str(v2),))
    monkeypatch.setattr(host_pages, "_available_bytes", lambda: None)
    # 4 GiB container: a quarter of it, whatever the machine has and however large the GPU cache
    assert host_pages.default_host_cache_bytes(gpu_cache_bytes=100 << 30) == 1 << 30


def test_the_trace_overlap_counts_copies_off_the_compute_stream(tmp_path):
    """bench/host_tier.py --trace: copies on the copy stream against the compute stream's kernels (the stream with
    the most kernel time); the compute stream's own copies are not the host tier's."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "host_tier.py"
    spec = importlib.util.spec_from_file_location("bench_host_tier", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    events = [{"cat": "kernel", "ts": 0, "dur": 100, "args": {"stream": 7}},
              {"cat": "kernel", "ts": 150, "dur": 50, "args": {"stream": 7}},
              {"cat": "kernel", "ts": 55, "dur": 5, "args": {"stream": 53}},  # the copy stream's strided-copy kernel
              {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 50, "dur": 110,
               "args": {"stream": 53}},
              {"cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 300, "dur": 10,
               "args": {"stream": 53}},
              {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 120, "dur": 5,
               "args": {"stream": 7}}]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    got = bench.copy_overlap(str(trace))
    # copies 110 + 10 us; under compute kernels: 50..100 and 150..160
    assert got["copies"] == 2 and got["copy_streams"] == [53] and got["compute_stream"] == 7
    assert got["copy_ms"] == pytest.approx(0.12) and got["overlapped_ms"] == pytest.approx(0.06)
    assert got["fraction"] == pytest.approx(0.5)
    assert got["by_direction"]["HtoD"] == pytest.approx([0.11, 0.06]) and got["by_direction"]["DtoH"] == pytest.approx(
        [0.01, 0.0])
    assert got["compute_busy"] == pytest.approx(150 / 200)
