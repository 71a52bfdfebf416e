"""DynamicGenerator end to end on the CPU: equivalences under greedy sampling, preemption, admission, stop
conditions, cancellation, and the errors users see. The page pool's invariants are checked after every step."""

from __future__ import annotations

import pytest
import torch
from tiny_models import hf_logits, load_hf_model

import folio
from folio.generator import QueueFull
from folio.job import JobState
from folio.results import EosReason, Stage

GREEDY = folio.SamplerSettings.greedy()


def prompts(tokenizer, n: int, base: str = "The lighthouse keeper") -> list[list[int]]:
    texts = [f"{base} number {i} walked {'far ' * (i % 5)}along the shore" for i in range(n)]
    return [tokenizer.encode(t) for t in texts]


def run_to_end(generator, jobs, check_every_step: bool = True, stats: list | None = None) -> dict[int, list]:
    """Enqueue jobs, step until all finish; returns {serial: [results]} (the pool's invariants checked after every
    step); each step's StepStats go to `stats` if given."""
    results: dict[int, list] = {}
    for job in jobs:
        generator.enqueue(job)
    steps = 0
    while generator.num_remaining_jobs():
        out = generator.step()
        if stats is not None:
            stats.append(out.stats)
        for r in out.results:
            results.setdefault(r.serial, []).append(r)
        if check_every_step:
            generator.cache_manager.check()
        steps += 1
        assert steps < 10_000, "generator made no progress"
    return results


def generated_ids(results: list) -> list[int]:
    return [t for r in results if r.stage == Stage.STREAMING for t in r.token_ids] + (
        [results[-1].eos_triggering_token_id] if results[-1].eos_reason == EosReason.STOP_TOKEN else [])


def make_jobs(token_lists, max_new_tokens=24, **kwargs):
    return [folio.DynamicJob(input_ids=ids, max_new_tokens=max_new_tokens, gen_settings=GREEDY,
                             stop_conditions=[], **kwargs) for ids in token_lists]


def outputs(generator, token_lists, **kwargs) -> list[list[int]]:
    jobs = make_jobs(token_lists, **kwargs)
    res = run_to_end(generator, jobs)
    return [job.generated_ids for job in jobs] if res else []


# --- equivalences (greedy) ---

def test_batched_equals_each_alone(peaked):
    token_lists = prompts(peaked.tokenizer, 6)
    alone = []
    for ids in token_lists:
        alone += outputs(peaked.generator(), [ids])
    batched = outputs(peaked.generator(), token_lists)
    assert batched == alone
    assert all(len(o) == 24 for o in batched)


def test_prefix_cache_on_equals_off_and_hits(peaked):
    shared = peaked.tokenizer.encode("A long shared preamble about ships and harbours and the sea " * 3)
    token_lists = [shared + peaked.tokenizer.encode(f" question {i}?") for i in range(4)]
    gen_on = peaked.generator()
    on = []
    for ids in token_lists:  # one after another, so later jobs find the first one's pages cached
        jobs = make_jobs([ids])
        res = run_to_end(gen_on, jobs)
        on.append(jobs[0].generated_ids)
        final = res[jobs[0].serial][-1]
        if ids is not token_lists[0]:
            assert final.cached_pages >= len(shared) // 16 - 1
            assert final.cached_tokens >= final.cached_pages * 16
    off = []
    gen_off = peaked.generator(prefix_cache=False)
    for ids in token_lists:
        jobs = make_jobs([ids])
        res = run_to_end(gen_off, jobs)
        off.append(jobs[0].generated_ids)
        assert res[jobs[0].serial][-1].cached_tokens == 0
    assert on == off


def test_in_flight_jobs_share_prefix_pages(peaked):
    shared = peaked.tokenizer.encode("Shared context for every request in this batch, long enough. " * 3)
    token_lists = [shared + peaked.tokenizer.encode(f" tail {i}") for i in range(4)]
    gen = peaked.generator()
    jobs = make_jobs(token_lists, max_new_tokens=4)
    for job in jobs:
        gen.enqueue(job)
    peak_shared = 0
    while gen.num_remaining_jobs():
        gen.iterate()
        gen.cache_manager.check()
        tables = [s.block_table for s in gen.scheduler.active]
        if len(tables) > 1:
            first_pages = [t[0] for t in tables if t]
            peak_shared = max(peak_shared, max(first_pages.count(p) for p in first_pages))
    assert peak_shared == 4, "all four running jobs should reference the same first page"
    alone = outputs(peaked.generator(), token_lists, max_new_tokens=4)
    assert [j.generated_ids for j in jobs] == alone


def test_preempted_and_resumed_equals_uninterrupted(peaked):
    token_lists = prompts(peaked.tokenizer, 6)
    reference = outputs(peaked.generator(num_tokens=4096), token_lists, max_new_tokens=40)
    # 12 pages of 16 tokens: all six jobs are admitted, then run out of room while decoding.
    small = peaked.generator(num_tokens=12 * 16)
    got = outputs(small, token_lists, max_new_tokens=40)
    assert small.scheduler.num_preemptions > 0
    assert got == reference


def test_chunked_prefill_equals_whole(peaked):
    long_prompt = peaked.tokenizer.encode("Every harbour has its own story to tell, and ours is long. " * 4)
    assert len(long_prompt) > 64
    whole = outputs(peaked.generator(max_chunk_size=2048), [long_prompt])
    gen = peaked.generator(max_chunk_size=16)
    jobs = make_jobs([long_prompt])
    res = run_to_end(gen, jobs)
    prefill = [r for r in res[jobs[0].serial] if r.stage == Stage.PREFILL]
    assert len(prefill) >= len(long_prompt) // 16  # one chunk of at most 16 tokens per step
    assert [r.curr_progress for r in prefill] == sorted(r.curr_progress for r in prefill)
    assert jobs[0].generated_ids == whole[0]


def test_return_logits_match_transformers(peaked):
    ids = peaked.tokenizer.encode("The keeper lit the lamp")
    job = folio.DynamicJob(input_ids=ids, max_new_tokens=8, gen_settings=GREEDY, stop_conditions=[],
                           return_logits=True, return_probs=True, return_top_tokens=3)
    res = run_to_end(peaked.generator(), [job])[job.serial]
    ours = torch.cat([r.logits for r in res if r.stage == Stage.STREAMING and r.logits is not None])
    assert ours.shape[0] == 8
    hf = hf_logits(load_hf_model(peaked.path), ids + job.generated_ids)[len(ids) - 1:len(ids) + 7]
    vocab = peaked.tokenizer.vocab_size
    rel = (ours[:, :vocab] - hf[:, :vocab]).abs().max() / hf[:, :vocab].abs().max()
    assert rel <= 1e-4
    streaming = [r for r in res if r.stage == Stage.STREAMING and r.token_ids]
    for r in streaming:
        assert len(r.token_probs) == len(r.token_ids)
        for tokens, token in zip(r.top_k_tokens, r.token_ids):
            assert tokens[0] == token  # greedy: the chosen token is the most probable
        assert all(p == pytest.approx(1.0) for p in r.token_probs)  # top-k 1 leaves one candidate


@pytest.mark.parametrize("settings", [
    folio.SamplerSettings.greedy(token_repetition_penalty=1.3, token_frequency_penalty=0.2),
    folio.SamplerSettings.greedy(token_repetition_penalty=1.2, token_presence_penalty=0.5,
                                 token_repetition_range=3, token_repetition_decay=4),
])
def test_penalised_logits_match_transformers_with_host_penalties(peaked, settings):
    """The generator keeps penalty histories on the device (prompt copied once, sampled ids appended there);
    its penalised logits equal transformers' logits penalised by the host path over prompt + generated ids."""
    from folio.sampling.penalties import apply_penalties

    ids = peaked.tokenizer.encode("The keeper lit the lamp, the lamp, the lamp")
    jobs = [folio.DynamicJob(input_ids=ids, max_new_tokens=10, gen_settings=settings, stop_conditions=[],
                             return_logits=True),
            folio.DynamicJob(input_ids=ids[:5], max_new_tokens=6, gen_settings=GREEDY, stop_conditions=[])]
    res = run_to_end(peaked.generator(decode_ahead=True, overlap_emit=True), jobs)[jobs[0].serial]
    ours = torch.cat([r.logits for r in res if r.stage == Stage.STREAMING and r.logits is not None])
    full = ids + jobs[0].generated_ids
    raw = hf_logits(load_hf_model(peaked.path), full)[len(ids) - 1:len(full) - 1]
    want = torch.nn.functional.pad(raw, (0, 1))
    apply_penalties(want, [settings] * len(raw), [full[:len(ids) + i] for i in range(len(raw))])
    want = want[:, :-1]
    vocab = peaked.tokenizer.vocab_size
    assert ours.shape == want.shape
    scale = want[:, :vocab].abs().max()
    assert (ours[:, :vocab] - want[:, :vocab]).abs().max() / scale <= 1e-4
    # and the penalties did change something
    assert (raw[:, :vocab] - want[:, :vocab]).abs().max() / scale > 1e-2


# --- capacity ---

def test_cache_smaller_than_worst_case_still_runs_every_job(peaked):
    token_lists = prompts(peaked.tokenizer, 8)
    worst_case_pages = sum(-(-(len(ids) + 60) // 16) for ids in token_lists)
    gen = peaked.generator(num_tokens=16 * 16)
    assert worst_case_pages > 2 * gen.cache.num_pages
    got = outputs(gen, token_lists, max_new_tokens=60)
    assert [len(o) for o in got] == [60] * 8
    assert gen.cache_manager.num_in_use == 0


def test_more_jobs_run_concurrently_than_reservation_allows(peaked):
    # Worst-case reservation (prompt + max_new_tokens up front) would fit two of these jobs in 24 pages; on-demand
    # allocation runs all ten at once while their sequences are short.
    token_lists = prompts(peaked.tokenizer, 10)
    gen = peaked.generator(num_tokens=24 * 16, max_q_size=16)
    per_job_worst = max(-(-(len(ids) + 150) // 16) for ids in token_lists)
    reservation_limit = gen.cache.num_pages // per_job_worst
    jobs = make_jobs(token_lists, max_new_tokens=150)
    for job in jobs:
        gen.enqueue(job)
    peak_decoding = 0
    for _ in range(6):
        gen.iterate()
        peak_decoding = max(peak_decoding, sum(1 for s in gen.scheduler.active if s.is_decoding))
    assert reservation_limit <= 2
    assert peak_decoding == 10
    gen.clear_queue()
    gen.cache_manager.check()


# --- stop conditions and text ---

def test_stop_string_split_across_tokens(peaked):
    ids = peaked.tokenizer.encode("Once upon a time")
    free = make_jobs([ids], max_new_tokens=30)[0]
    run_to_end(peaked.generator(), [free])
    pieces = [peaked.tokenizer.decode([t]) for t in free.generated_ids]
    # A stop string that starts inside token 3 and ends inside token 5.
    boundary = len("".join(pieces[:3]))
    text = "".join(pieces)
    assert len(pieces[2]) >= 1 and len(pieces[4]) >= 1
    stop = text[boundary - 1:boundary + len(pieces[3]) + 1]
    assert stop and text.find(stop) == boundary - 1
    job = make_jobs([ids], max_new_tokens=30)[0]
    job.stop_strings = (stop,)
    job2 = folio.DynamicJob(input_ids=ids, max_new_tokens=30, gen_settings=GREEDY, stop_conditions=[stop])
    res = run_to_end(peaked.generator(), [job2])[job2.serial]
    final = res[-1]
    assert final.eos_reason == EosReason.STOP_STRING
    assert final.eos_triggering_string == stop
    assert final.full_completion == text[:boundary - 1]
    assert "".join(r.text for r in res if r.stage == Stage.STREAMING) == text[:boundary - 1]
    assert final.new_tokens == 5


def test_stop_token_and_min_new_tokens(peaked):
    ids = peaked.tokenizer.encode("Once upon a time")
    free = make_jobs([ids], max_new_tokens=12)[0]
    run_to_end(peaked.generator(), [free])
    first = free.generated_ids[0]
    stopped = folio.DynamicJob(input_ids=ids, max_new_tokens=12, gen_settings=GREEDY, stop_conditions=[first])
    final = run_to_end(peaked.generator(), [stopped])[stopped.serial][-1]
    assert final.eos_reason == EosReason.STOP_TOKEN and final.eos_triggering_token_id == first
    assert final.new_tokens == 1 and final.full_completion == ""
    held_back = folio.DynamicJob(input_ids=ids, max_new_tokens=12, gen_settings=GREEDY, stop_conditions=[first],
                                 min_new_tokens=5)
    res = run_to_end(peaked.generator(), [held_back])[held_back.serial]
    assert first not in held_back.generated_ids[:5]
    assert held_back.new_tokens >= 5
    assert res[-1].full_completion == "".join(r.text for r in res if r.stage == Stage.STREAMING)


def test_streamed_text_equals_decoded_tokens(demo):
    # The demo model's random weights emit arbitrary byte tokens, so multi-byte characters get split; whatever
    # arrives in pieces must add up to the decode of all tokens, and no chunk may end inside a character.
    gen = demo.generator()
    jobs = [folio.DynamicJob(input_ids=demo.tokenizer.encode(p), max_new_tokens=80, stop_conditions=[], seed=i,
                             gen_settings=folio.SamplerSettings(temperature=1.5, top_k=0, top_p=0))
            for i, p in enumerate(["Héllo wörld ☃", "日本語のテキスト", "emoji 🎉 time"])]
    res = run_to_end(gen, jobs)
    for job in jobs:
        streamed = "".join(r.text for r in res[job.serial] if r.stage == Stage.STREAMING)
        assert streamed == demo.tokenizer.decode(job.generated_ids)


# --- admission ---

def test_max_skips_bounds_overtaking(peaked):
    gen = peaked.generator(num_tokens=12 * 16)
    # The hog holds 6 pages and grows; the big job needs 7 + 1, so it cannot start while the hog runs, but the
    # small ones (1 + 1 pages) can — at most max_skips of them may go first.
    hog = folio.DynamicJob(input_ids=list(range(10, 106)), max_new_tokens=80, gen_settings=GREEDY,
                           stop_conditions=[])
    big = folio.DynamicJob(input_ids=list(range(200, 300)), max_new_tokens=8, gen_settings=GREEDY,
                           stop_conditions=[], max_skips=2)
    smalls = [folio.DynamicJob(input_ids=[300 + i, 301 + i], max_new_tokens=2, gen_settings=GREEDY,
                               stop_conditions=[]) for i in range(5)]
    gen.max_q_size = 16
    gen.enqueue(hog)
    gen.iterate()
    gen.enqueue(big)
    gen.enqueue(smalls)
    started_order = []
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            if r.stage == Stage.STARTED:
                started_order.append(r.job)
        gen.cache_manager.check()
    assert started_order.index(big) <= 2  # at most max_skips small jobs went first
    assert big.sequence.num_skips == 2
    assert all(j.state == JobState.FINISHED for j in [hog, big, *smalls])


# --- cancellation ---

def test_cancel_in_every_state(peaked):
    tok = peaked.tokenizer
    gen = peaked.generator(max_chunk_size=16)
    long_ids = tok.encode("cancel me while I am still reading my very long prompt " * 3)

    pending = make_jobs([long_ids])[0]
    gen.enqueue(pending)
    gen.cancel(pending)
    assert gen.num_remaining_jobs() == 0 and pending.state == JobState.CANCELLED

    prefilling = make_jobs([long_ids])[0]
    gen.enqueue(prefilling)
    gen.iterate()
    assert gen.cache_manager.num_in_use > 0 and not gen.scheduler.active[0].is_decoding
    gen.cancel(prefilling)
    assert gen.cache_manager.num_in_use == 0

    decoding = make_jobs([tok.encode("short")], max_new_tokens=50)[0]
    gen.enqueue(decoding)
    for _ in range(5):
        gen.iterate()
    assert decoding.new_tokens > 0
    gen.cancel(decoding)
    assert gen.cache_manager.num_in_use == 0 and gen.num_remaining_jobs() == 0

    finished = make_jobs([tok.encode("done")], max_new_tokens=2)[0]
    run_to_end(gen, [finished])
    gen.cancel(finished)  # no-op
    assert finished.state == JobState.FINISHED
    gen.cache_manager.check()


# --- errors users see ---

def test_queue_full(peaked):
    gen = peaked.generator(max_queued_jobs=2)
    jobs = make_jobs(prompts(peaked.tokenizer, 3))
    gen.enqueue(jobs[0])
    gen.enqueue(jobs[1])
    with pytest.raises(QueueFull, match="queue is full"):
        gen.enqueue(jobs[2])


def test_max_q_size_is_tokens_per_sequence_not_the_queue_bound(peaked):
    """Code written for the reference sets max_q_size=1 (one token per sequence per forward) and enqueues many
    jobs at once: that must work, and give what the default gives."""
    token_lists = prompts(peaked.tokenizer, 5)
    gen = peaked.generator(max_q_size=1)
    assert gen.max_queued_jobs is None
    assert outputs(gen, token_lists, max_new_tokens=6) == outputs(peaked.generator(), token_lists, max_new_tokens=6)
    with pytest.raises(ValueError, match="max_q_size"):
        peaked.generator(max_q_size=0)


def test_over_long_prompt_rejected(peaked):
    gen = peaked.generator(num_tokens=1024, max_seq_len=200)
    with pytest.raises(ValueError, match="exceeds max_seq_len 200"):
        gen.enqueue(folio.DynamicJob(input_ids=list(range(3, 190)), max_new_tokens=20))
    small = peaked.generator(num_tokens=64)
    with pytest.raises(ValueError, match="pages"):
        small.enqueue(folio.DynamicJob(input_ids=list(range(3, 60)), max_new_tokens=20))


def test_bad_job_arguments():
    with pytest.raises(ValueError, match="input_ids is empty"):
        folio.DynamicJob(input_ids=[], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        folio.DynamicJob(input_ids=[1], max_new_tokens=0)
    with pytest.raises(ValueError, match="stop condition"):
        folio.DynamicJob(input_ids=[1], max_new_tokens=4, stop_conditions=[1.5])
    with pytest.raises(ValueError, match="must not be empty"):
        folio.DynamicJob(input_ids=[1], max_new_tokens=4, stop_conditions=[""])


def test_generate_runs_alongside_other_jobs(peaked):
    gen = peaked.generator()
    other = make_jobs([peaked.tokenizer.encode("background job")], max_new_tokens=30)[0]
    gen.enqueue(other)
    gen.iterate()
    text = gen.generate(["One", "Two"], max_new_tokens=6, gen_settings=GREEDY, stop_conditions=[],
                        completion_only=True)
    assert len(text) == 2
    results = []
    while gen.num_remaining_jobs():
        results += gen.iterate()
    results_other = [r for r in results if r.job is other]
    assert results_other[-1].eos and other.new_tokens == 30


def test_unpaged_runs_one_job_at_a_time_and_reuses_prefix(peaked):
    gen = peaked.generator(paged=False)
    assert gen.max_batch_size == 1
    shared = peaked.tokenizer.encode("The same long opening line, again and again, for every job. " * 2)
    jobs = make_jobs([shared + [5], shared + [6]], max_new_tokens=4)
    for job in jobs:
        gen.enqueue(job)
    peak_active, finals = 0, {}
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            if r.eos:
                finals[r.serial] = r
        peak_active = max(peak_active, len(gen.scheduler.active))
    assert peak_active == 1
    assert finals[jobs[1].serial].cached_tokens >= (len(shared) // 16) * 16


def test_warmup_and_reset_page_table_leave_no_cached_pages(peaked):
    gen = peaked.generator()
    gen.warmup()
    assert gen.cache_manager.num_cached == 0 and gen.cache_manager.num_in_use == 0
    outputs(gen, prompts(peaked.tokenizer, 2))
    assert gen.cache_manager.num_cached > 0
    gen.reset_page_table()
    assert gen.cache_manager.num_cached == 0
    gen.cache_manager.check()
    gen.enqueue(make_jobs(prompts(peaked.tokenizer, 1))[0])
    with pytest.raises(RuntimeError, match="empty queue"):
        gen.reset_page_table()


def test_warmup_runs_a_mixed_step_and_sampled_settings(peaked):
    """The warm-up must launch what serving launches (CUDA loads each kernel at its first launch, waiting for the
    device): a step with a prompt chunk beside a decode row, and the default (sampled, penalised) settings."""
    gen = peaked.generator()
    steps, settings = [], []
    step, sample = gen.step, gen.runner.sample
    gen.step = lambda: steps.append(step()) or steps[-1]
    gen.runner.sample = lambda chunks, logits: settings.extend(c.seq.job.gen_settings for c in chunks) or sample(
        chunks, logits)
    gen.warmup()
    stats = [out.stats for out in steps]
    assert any(s.num_prompt_tokens > 0 and s.num_decode_rows > 0 for s in stats), stats
    # one step of long prompts, as long as the chunk allows (its GEMMs take other kernels than short steps')
    length = min(gen.max_seq_len - 1, gen.max_chunk_size)
    assert max(s.num_prompt_tokens for s in stats) == (gen.max_chunk_size // length) * length, stats
    assert any(s == folio.SamplerSettings() for s in settings)
    assert gen.cache_manager.num_cached == 0 and gen.cache_manager.num_in_use == 0


def test_generate_abort_and_last_results(peaked):
    import threading

    gen = peaked.generator()
    text, last = gen.generate("Once upon a time", max_new_tokens=5, gen_settings=GREEDY, stop_conditions=[],
                              return_last_results=True)
    assert text.startswith("Once upon a time") and last[0].new_tokens == 5
    assert last[0].eos_reason == EosReason.MAX_NEW_TOKENS
    aborted = threading.Event()
    aborted.set()
    assert gen.generate(["a", "b"], max_new_tokens=50, abort_event=aborted) is None
    assert gen.num_remaining_jobs() == 0 and gen.cache_manager.num_in_use == 0


# --- overlapped emission (on by default with CUDA graphs; forced here on the CPU) ---

def _overlap_jobs(tokenizer):
    lists = prompts(tokenizer, 7, base="A quiet harbour")
    sampled = folio.SamplerSettings(temperature=0.9, top_p=0.9, token_repetition_penalty=1.1)
    eos = list(tokenizer.eos_token_ids)
    return [
        folio.DynamicJob(input_ids=lists[0], max_new_tokens=20, gen_settings=GREEDY, stop_conditions=[]),
        folio.DynamicJob(input_ids=lists[1], max_new_tokens=30, gen_settings=sampled, seed=5, stop_conditions=[]),
        folio.DynamicJob(input_ids=lists[2], max_new_tokens=40, gen_settings=sampled, seed=6,
                         stop_conditions=eos, min_new_tokens=12),
        folio.DynamicJob(input_ids=lists[3], max_new_tokens=40, gen_settings=sampled, seed=7,
                         stop_conditions=["e", " the"]),
        folio.DynamicJob(input_ids=lists[4], max_new_tokens=1, gen_settings=sampled, seed=8, stop_conditions=[]),
        folio.DynamicJob(input_ids=lists[5], max_new_tokens=25, gen_settings=sampled, seed=9, return_probs=True,
                         return_top_tokens=3, stop_conditions=None),
        folio.DynamicJob(input_ids=lists[6], max_new_tokens=33, gen_settings=sampled, seed=10, stop_conditions=[]),
    ]


def _summary(results: dict) -> list:
    out = []
    for serial in sorted(results):
        rs = results[serial]
        last = rs[-1]
        out.append((generated_ids(rs), last.full_completion, last.eos_reason, last.new_tokens,
                    [p for r in rs if r.stage == Stage.STREAMING for p in (r.token_probs or [])]))
    return out


def assert_same_runs(got: list, want: list) -> None:
    """Tokens, text, reasons and counts equal; probabilities within float tolerance, since runs that batch rows
    differently (steps launched ahead, emission a step later) may round them differently in the last bits."""
    assert [r[:4] for r in got] == [r[:4] for r in want]
    for g, w in zip(got, want):
        assert g[4] == pytest.approx(w[4], rel=1e-5, abs=1e-7)


def test_overlapped_emission_gives_the_same_results(demo):
    runs = {}
    for overlap in (False, True):
        gen = demo.generator(num_tokens=2048, page_size=16, max_batch_size=4, overlap_emit=overlap)
        assert gen.overlap_emit is overlap
        runs[overlap] = _summary(run_to_end(gen, _overlap_jobs(demo.tokenizer)))
        assert gen.cache_manager.num_in_use == 0 and gen.num_remaining_jobs() == 0
    assert_same_runs(runs[True], runs[False])
    reasons = {r[2] for r in runs[True]}
    assert EosReason.MAX_NEW_TOKENS in reasons and EosReason.STOP_STRING in reasons


@pytest.mark.parametrize("overlap", [False, True])
def test_decode_ahead_gives_the_same_results(demo, overlap):
    """Steps launched before the previous tokens are read back (fed from the device) change no token, text or
    result, with a queue longer than the batch, prompts prefilled over several steps while others decode, stop
    tokens and strings, and the pool checked every step; without prefill_ahead only all-decode steps go ahead."""
    runs = {}
    for ahead, prefill_ahead in ((False, True), (True, False), (True, True)):
        gen = demo.generator(num_tokens=2048, page_size=16, max_batch_size=4, overlap_emit=overlap,
                             decode_ahead=ahead, prefill_ahead=prefill_ahead, max_chunk_size=32)
        steps = []
        results = run_to_end(gen, _overlap_jobs(demo.tokenizer), stats=steps)
        admitted_ahead = [s for s in steps if s.launched_ahead and s.num_started]
        # a job that a stop token ends frees its slot for a queued job in a step launched ahead
        assert bool(admitted_ahead) is (ahead and prefill_ahead)
        runs[ahead, prefill_ahead] = _summary(results)
        assert all(sum(r.stage == Stage.STARTED for r in rs) == 1 for rs in results.values())
        assert gen.cache_manager.num_in_use == 0 and gen.num_remaining_jobs() == 0
        assert any(s.launched_ahead for s in steps) is ahead
        assert any(s.launched_ahead and s.num_prompt_tokens for s in steps) is (ahead and prefill_ahead)
    assert_same_runs(runs[True, False], runs[False, True])
    assert_same_runs(runs[True, True], runs[False, True])


@pytest.mark.parametrize("ahead", [False, True])
def test_gathering_prompts_gives_the_same_results_in_fewer_prompt_steps(demo, ahead):
    """Prompt tokens held back while rows decode (gather_prompt_rows / _steps) change no token, text or result;
    queued jobs' prompts then share steps, so fewer steps carry prompt tokens."""
    runs, prompt_steps = {}, {}
    for rows, steps in ((0, 0), (2, 12)):
        gen = demo.generator(num_tokens=2048, page_size=16, max_batch_size=4, decode_ahead=ahead,
                             overlap_emit=ahead, max_chunk_size=32, gather_prompt_rows=rows,
                             gather_prompt_steps=steps)
        stats = []
        runs[rows] = _summary(run_to_end(gen, _overlap_jobs(demo.tokenizer), stats=stats))
        prompt_steps[rows] = sum(1 for s in stats if s.num_prompt_tokens)
        assert gen.cache_manager.num_in_use == 0 and gen.num_remaining_jobs() == 0
    assert_same_runs(runs[2], runs[0])
    assert prompt_steps[2] < prompt_steps[0]


def test_gathering_settings_are_checked_and_default_to_off_without_graphs(peaked):
    gen = peaked.generator()
    assert (gen.scheduler.gather_rows, gen.scheduler.gather_steps) == (0, 0)  # (no CUDA graphs on the CPU)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="gather_prompt_rows"):
            peaked.generator(gather_prompt_rows=bad)
        with pytest.raises(ValueError, match="gather_prompt_steps"):
            peaked.generator(gather_prompt_steps=bad)


def test_decode_ahead_with_a_small_cache_and_cancel(demo):
    """Too few free pages for a step ahead means planning the usual way (which may preempt); a cancel between
    steps drops the cancelled job's row of the step already launched."""
    jobs = _overlap_jobs(demo.tokenizer)
    plain = _summary(run_to_end(demo.generator(num_tokens=128, page_size=16, max_batch_size=4,
                                               decode_ahead=False), _overlap_jobs(demo.tokenizer)))
    gen = demo.generator(num_tokens=128, page_size=16, max_batch_size=4, decode_ahead=True)
    steps = []
    ahead = _summary(run_to_end(gen, jobs, stats=steps))
    assert any(s.launched_ahead for s in steps) and sum(s.num_preemptions for s in steps) > 0
    # Preemptions fall on other steps (planning ahead never preempts), so re-prefilled K/V, and with them the
    # probabilities, may differ in the last bits; tokens, text and reasons may not.
    assert_same_runs(ahead, plain)
    jobs = _overlap_jobs(demo.tokenizer)[:3]
    for job in jobs:
        gen.enqueue(job)
    while gen.pipeline.step is None:
        gen.iterate()
    gen.cancel(jobs[1])
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            assert r.job is not jobs[1]
        gen.cache_manager.check()
    assert jobs[1].state == JobState.CANCELLED and gen.cache_manager.num_in_use == 0


def test_overlapped_emission_cancel_and_generate(demo):
    gen = demo.generator(num_tokens=2048, page_size=16, max_batch_size=4, overlap_emit=True)
    jobs = _overlap_jobs(demo.tokenizer)[:3]
    for job in jobs:
        gen.enqueue(job)
    for _ in range(6):
        gen.iterate()
    gen.cancel(jobs[1])
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            assert r.job is not jobs[1]
    assert jobs[1].state == JobState.CANCELLED and gen.cache_manager.num_in_use == 0
    plain = demo.generator(num_tokens=2048, page_size=16, overlap_emit=False)
    prompt = "The lighthouse keeper"
    assert gen.generate(prompt, max_new_tokens=12, gen_settings=GREEDY) == \
        plain.generate(prompt, max_new_tokens=12, gen_settings=GREEDY)


def test_cancel_while_its_prompt_chunk_is_in_a_step_launched_ahead(demo):
    """A job cancelled while the step launched ahead holds a chunk of its prompt: that chunk is dropped (never
    committed, its pages released), and the other jobs get what they get without it."""
    def jobs():
        lists = prompts(demo.tokenizer, 3, base="Along the northern coast of the island, past the old lighthouse")
        return [folio.DynamicJob(input_ids=ids * 3, max_new_tokens=12, gen_settings=GREEDY, stop_conditions=[])
                for ids in lists]

    want = _summary(run_to_end(demo.generator(max_batch_size=4, decode_ahead=False, max_chunk_size=32),
                               [j for k, j in enumerate(jobs()) if k != 2]))
    gen = demo.generator(max_batch_size=4, decode_ahead=True, max_chunk_size=32)
    mine = jobs()
    for job in mine:
        gen.enqueue(job)
    results: dict[int, list] = {}

    def prefilling_ahead(job):
        ahead = gen.pipeline.step
        return ahead is not None and any(c.seq.job is job and c.num_tokens > 1 for c in ahead.plan.chunks)
    steps = 0
    while not prefilling_ahead(mine[2]):
        for r in gen.iterate():
            results.setdefault(r.serial, []).append(r)
        steps += 1
        assert steps < 100, "no step launched ahead held a prompt chunk of the third job"
    gen.cancel(mine[2])
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            assert r.job is not mine[2]
            results.setdefault(r.serial, []).append(r)
        gen.cache_manager.check()
    assert mine[2].state == JobState.CANCELLED and gen.cache_manager.num_in_use == 0
    assert _summary({s: rs for s, rs in results.items() if s != mine[2].serial}) == want


# --- verify rows (speculative decoding's: several tokens of one sequence, every logit wanted) ---

def test_verify_rows_equal_one_token_steps(peaked_dir):
    from runner_helpers import verify_rows_logits

    verify, steps, used_graph = verify_rows_logits(peaked_dir, "cpu", torch.float32, graphs=False)
    assert not used_graph
    for got, want in zip(verify, steps):
        assert got.shape == want.shape and got.shape[0] > 1
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# --- a failure inside a step fails only its job ---

@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("presence", [-1e308, float("nan")])  # the sampler raises / leaves nothing to pick
def test_a_job_that_breaks_the_sampler_fails_alone(demo, ahead, presence):
    """A value that got past validation (here: mutated after enqueue) and breaks the sampler fails that job with
    an error result; the others finish with exactly the tokens they get without it, and nothing wedges."""
    lists = prompts(demo.tokenizer, 4, base="A quiet harbour")
    sampled = folio.SamplerSettings(temperature=0.9, top_p=0.9, token_repetition_penalty=1.1)

    def jobs(with_bad: bool):
        good = [folio.DynamicJob(input_ids=ids, max_new_tokens=12, gen_settings=sampled, seed=i,
                                 stop_conditions=[]) for i, ids in enumerate(lists[:3])]
        bad = folio.DynamicJob(input_ids=lists[3], max_new_tokens=12, gen_settings=folio.SamplerSettings(),
                               stop_conditions=[])
        return good, bad

    good, _ = jobs(False)
    want = _summary(run_to_end(demo.generator(decode_ahead=ahead), good))
    gen = demo.generator(decode_ahead=ahead)
    good, bad = jobs(True)
    for job in good + [bad]:
        gen.enqueue(job)
    object.__setattr__(bad.gen_settings, "token_presence_penalty", presence)
    results: dict[int, list] = {}
    steps = 0
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            results.setdefault(r.serial, []).append(r)
        gen.cache_manager.check()
        steps += 1
        assert steps < 500, "the generator wedged"
    final = results[bad.serial][-1]
    assert final.eos and final.eos_reason == EosReason.ERROR and final.error is not None
    assert_same_runs(_summary({s: rs for s, rs in results.items() if s != bad.serial}), want)
    assert gen.cache_manager.num_in_use == 0


def test_a_job_that_breaks_the_forward_fails_alone(demo):
    """A forward that fails is retried chunk by chunk: the job whose chunk fails again (here a token id that got
    past validation: the embedding raises) fails, the others finish as they would without it."""
    lists = prompts(demo.tokenizer, 3, base="A quiet harbour")
    want = outputs(demo.generator(), lists[:2], max_new_tokens=8)
    gen = demo.generator()
    jobs = make_jobs(lists, max_new_tokens=8)
    for job in jobs:
        gen.enqueue(job)
    jobs[2].sequence.token_ids[3] = 10**9
    results = run_to_end(gen, [])
    final = results[jobs[2].serial][-1]
    assert final.eos_reason == EosReason.ERROR and final.error is not None
    assert [j.generated_ids for j in jobs[:2]] == want


def test_generator_options_are_the_models(peaked):
    model = peaked.model
    gen = folio.DynamicGenerator(model, folio.Cache(model, num_tokens=1024, page_size=16), peaked.tokenizer,
                                 options=model.options)
    assert gen.options == model.options
    with pytest.raises(ValueError, match="with_options"):
        folio.DynamicGenerator(model, folio.Cache(model, num_tokens=1024, page_size=16), peaked.tokenizer,
                               options=folio.EngineOptions(ops_backend="reference"))
    reference = model.with_options(folio.EngineOptions(ops_backend="reference"))
    gen = folio.DynamicGenerator(reference, folio.Cache(reference, num_tokens=1024, page_size=16),
                                 peaked.tokenizer, options=folio.EngineOptions(ops_backend="reference"))
    assert gen.runner.graphs is None and gen.options.ops_backend == "reference"


def test_a_job_that_fills_the_whole_cache_runs_and_one_that_cannot_fit_fails(peaked):
    """A job whose prompt and tokens fill every page exactly is admitted (it needs no page to grow into); one that
    got past the checks at enqueue and fits no cache fails with an error result instead of waiting forever."""
    gen = peaked.generator(num_tokens=64)  # 4 pages of 16
    exact = folio.DynamicJob(input_ids=list(range(3, 66)), max_new_tokens=1, gen_settings=GREEDY, stop_conditions=[])
    results = run_to_end(gen, [exact])
    assert results[exact.serial][-1].eos_reason == EosReason.MAX_NEW_TOKENS and len(exact.generated_ids) == 1
    huge = folio.DynamicJob(input_ids=[5] * 10, max_new_tokens=4, gen_settings=GREEDY, stop_conditions=[])
    gen.enqueue(huge)
    huge.sequence.token_ids.extend([5] * 100)  # past the checks at enqueue
    final = run_to_end(gen, [])[huge.serial][-1]
    assert final.eos_reason == EosReason.ERROR and "cannot be admitted" in str(final.error)
