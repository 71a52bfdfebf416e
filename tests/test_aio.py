"""The asyncio API: concurrent jobs from separate tasks, cancellation, per-job errors, and a free event loop."""

from __future__ import annotations

import asyncio
import time

import pytest

import folio
from folio.results import EosReason, Stage

GREEDY = folio.SamplerSettings.greedy()


def make_async(parts, **kwargs):
    cache = folio.Cache(parts.model, num_tokens=4096, page_size=16)
    return folio.DynamicGeneratorAsync(model=parts.model, cache=cache, tokenizer=parts.tokenizer,
                                       max_queued_jobs=64, **kwargs)


async def collect(job) -> list:
    return [r async for r in job]


def fail_at_fourth_token(job) -> None:
    """The job's fourth sampled token raises in its own handling (as a filter that blows up would)."""
    original = job.job.receive_token

    def explode(token_id, extras, *rest):
        if job.job.new_tokens == 3:
            raise RuntimeError("filter blew up")
        return original(token_id, extras, *rest)

    job.job.receive_token = explode


def test_32_concurrent_jobs_from_separate_tasks(peaked):
    tok = peaked.tokenizer
    prompt_ids = [tok.encode(f"Story {i}: the tide came in") for i in range(32)]
    lengths = [4 + i % 7 for i in range(32)]

    # Reference: each prompt alone through the synchronous generator.
    sync_gen = folio.DynamicGenerator(model=peaked.model, cache=folio.Cache(peaked.model, num_tokens=4096,
                                      page_size=16), tokenizer=tok)
    expected = []
    for ids, n in zip(prompt_ids, lengths):
        job = folio.DynamicJob(input_ids=ids, max_new_tokens=n, gen_settings=GREEDY, stop_conditions=[])
        sync_gen.enqueue(job)
        while sync_gen.num_remaining_jobs():
            sync_gen.iterate()
        expected.append(job.generated_ids)

    async def main():
        generator = make_async(peaked)

        async def one(i):
            await asyncio.sleep(0.001 * (i % 4))
            job = folio.DynamicJobAsync(generator, input_ids=prompt_ids[i], max_new_tokens=lengths[i],
                                        gen_settings=GREEDY, stop_conditions=[])
            results = await collect(job)
            return job, results

        outs = await asyncio.gather(*(asyncio.create_task(one(i)) for i in range(32)))
        await generator.close()
        return outs

    outs = asyncio.run(main())
    for i, (job, results) in enumerate(outs):
        assert results[0].stage == Stage.STARTED
        assert results[-1].eos and results[-1].eos_reason == EosReason.MAX_NEW_TOKENS
        streamed = [t for r in results if r.stage == Stage.STREAMING for t in r.token_ids]
        assert len(streamed) == lengths[i]
        assert job.job.generated_ids == expected[i]


def test_cancel_mid_stream_frees_pages(peaked):
    async def main():
        generator = make_async(peaked)
        pool = generator.generator.cache_manager
        long_job = folio.DynamicJobAsync(generator, input_ids=peaked.tokenizer.encode("long one"),
                                         max_new_tokens=300, gen_settings=GREEDY, stop_conditions=[])
        seen = 0
        async for result in long_job:
            if result.stage == Stage.STREAMING:
                seen += 1
                if seen == 40:
                    assert pool.num_in_use > 0
                    await long_job.cancel()
        in_use_after = pool.num_in_use
        remaining = generator.num_remaining_jobs
        # A cancelled (or finished) job can be cancelled again harmlessly.
        await long_job.cancel()
        await generator.close()
        return seen, in_use_after, remaining

    seen, in_use_after, remaining = asyncio.run(main())
    assert seen == 40
    assert in_use_after == 0 and remaining == 0


def test_cancel_pending_job_before_it_starts(peaked):
    async def main():
        generator = make_async(peaked)
        job = folio.DynamicJobAsync(generator, input_ids=[5, 6, 7], max_new_tokens=50, stop_conditions=[])
        await job.cancel()
        results = await collect(job)
        await asyncio.sleep(0.05)
        state = (generator.num_remaining_jobs, generator.generator.cache_manager.num_in_use)
        await generator.close()
        return results, state

    results, state = asyncio.run(main())
    assert results == [] and state == (0, 0)


def test_error_in_one_job_fails_only_that_job(peaked, monkeypatch):
    async def main():
        generator = make_async(peaked)
        good = folio.DynamicJobAsync(generator, input_ids=[5, 6, 7], max_new_tokens=20, gen_settings=GREEDY,
                                     stop_conditions=[])
        bad = folio.DynamicJobAsync(generator, input_ids=[8, 9], max_new_tokens=20, gen_settings=GREEDY,
                                    stop_conditions=[])
        fail_at_fourth_token(bad)
        good_task = asyncio.create_task(collect(good))
        with pytest.raises(RuntimeError, match="filter blew up"):
            await collect(bad)
        good_results = await good_task
        in_use = generator.generator.cache_manager.num_in_use
        await generator.close()
        return good_results, in_use

    good_results, in_use = asyncio.run(main())
    assert good_results[-1].eos_reason == EosReason.MAX_NEW_TOKENS
    assert in_use == 0


def test_next_results_takes_what_arrived_in_order_and_raises_after_it(peaked):
    """Results taken in batches (a server pacing its messages) are the ones `async for` yields, in the same order;
    a job's error comes after the results that preceded it, and the job then ends."""
    async def main():
        generator = make_async(peaked)
        kwargs = dict(input_ids=[5, 6, 7], max_new_tokens=12, gen_settings=GREEDY, stop_conditions=[])
        expected = await collect(folio.DynamicJobAsync(generator, **kwargs))
        job = folio.DynamicJobAsync(generator, **kwargs)
        assert job.ready_results() == []  # nothing has arrived yet: no waiting
        batches = []
        while True:
            await asyncio.sleep(0.02)  # (several steps' results pile up meanwhile)
            batch = await job.next_results()
            if not batch:
                break
            batches.append(batch)
        assert await job.next_results() == [] and job.ready_results() == []  # ended: stays ended

        failing = folio.DynamicJobAsync(generator, **kwargs)
        fail_at_fourth_token(failing)
        before = []
        with pytest.raises(RuntimeError, match="filter blew up"):
            while True:  # (however the results and the error are batched on their way)
                batch = await failing.next_results()
                assert batch, "the job ended without its error"
                before += batch
        after = await failing.next_results()
        # an error that arrived with results before it, in one batch: the results first, then the error
        pile = folio.DynamicJobAsync(generator, **kwargs)
        await collect(pile)
        pile._ended = False  # (reopened, fed by hand as _deliver_all feeds it)
        for item in (expected[1], expected[2], RuntimeError("late"), expected[3]):
            pile._put(item)
        piled = await pile.next_results()
        with pytest.raises(RuntimeError, match="late"):
            pile.ready_results()
        assert await pile.next_results() == [] and pile.ready_results() == []  # the error ended it
        await generator.close()
        return expected, batches, before, after, piled

    expected, batches, before, after, piled = asyncio.run(main())
    taken = [r for batch in batches for r in batch]
    assert [(r.stage, r.token_ids if r.stage == Stage.STREAMING else None, r.eos) for r in taken] == [
        (r.stage, r.token_ids if r.stage == Stage.STREAMING else None, r.eos) for r in expected]
    assert any(len(batch) > 1 for batch in batches)  # (otherwise this did not test batching)
    assert taken[-1].eos and taken[-1].eos_reason == EosReason.MAX_NEW_TOKENS
    assert [r.stage for r in before[:1]] == [Stage.STARTED]
    # the three tokens before the failing fourth (fewer where text is held back), as the job without the error
    released = [t for r in before if r.stage == Stage.STREAMING for t in r.token_ids]
    expected_ids = [t for r in expected if r.stage == Stage.STREAMING for t in r.token_ids]
    assert 1 <= len(released) <= 3 and released == expected_ids[:len(released)]
    assert after == []
    assert piled == expected[1:3]


def test_event_loop_stays_free_while_generating(peaked):
    async def main():
        generator = make_async(peaked)
        jobs = [folio.DynamicJobAsync(generator, input_ids=[5 + i, 6, 7], max_new_tokens=60, stop_conditions=[])
                for i in range(8)]
        tasks = [asyncio.create_task(collect(j)) for j in jobs]
        # A ticker on the loop: if the engine ran on the loop, gaps would be as long as whole steps.
        gaps, last = [], time.monotonic()
        while not all(t.done() for t in tasks):
            await asyncio.sleep(0.002)
            now = time.monotonic()
            gaps.append(now - last)
            last = now
        await asyncio.gather(*tasks)
        await generator.close()
        return gaps

    gaps = asyncio.run(main())
    assert len(gaps) > 10
    assert sorted(gaps)[len(gaps) // 2] < 0.05


def test_invalid_job_raises_in_the_caller(peaked):
    async def main():
        generator = make_async(peaked, max_seq_len=64)
        try:
            with pytest.raises(ValueError, match="max_seq_len"):
                folio.DynamicJobAsync(generator, input_ids=list(range(5, 60)), max_new_tokens=20)
        finally:
            await generator.close()

    asyncio.run(main())


def test_run_in_engine_reads_state_between_steps(peaked):
    async def main():
        generator = make_async(peaked)
        assert generator.is_alive
        job = folio.DynamicJobAsync(generator, input_ids=[5, 6, 7] * 10, max_new_tokens=30, stop_conditions=[])
        seen = []
        async for result in job:
            if result.stage == Stage.STREAMING:
                seen.append(await generator.run_in_engine(lambda g: (g.cache_manager.num_in_use, g.num_steps)))
        cached = await generator.run_in_engine(lambda g: list(g.cache_snapshot().cached_hashes()))
        with pytest.raises(ZeroDivisionError):
            await generator.run_in_engine(lambda g: 1 / 0)
        events = generator.generator.drain_page_events()
        await generator.close()
        return seen, cached, events, generator.is_alive

    seen, cached, events, alive_after = asyncio.run(main())
    assert len(seen) == 30 and seen[0][1] >= 1
    assert [steps for _, steps in seen] == sorted(steps for _, steps in seen)
    assert len(cached) >= 2  # 60 tokens of 16-token pages were stored
    assert {e.hash for e in events if e.kind.value == "stored"} >= set(cached)
    assert not alive_after


def test_on_step_sees_every_step(peaked):
    """The engine thread hands each step's StepStats to on_step: together they account for every token."""
    seen = []

    async def main():
        generator = make_async(peaked, on_step=seen.append)
        jobs = [folio.DynamicJobAsync(generator, input_ids=peaked.tokenizer.encode(f"Tide {i}"), max_new_tokens=5,
                                      gen_settings=GREEDY, stop_conditions=[]) for i in range(3)]
        for job in jobs:
            await collect(job)
        steps = generator.generator.num_steps
        await generator.close()
        return jobs, steps

    jobs, steps = asyncio.run(main())
    assert len(seen) == steps and [s.step_idx for s in seen] == list(range(steps))
    assert sum(s.num_sampled for s in seen) == sum(j.job.new_tokens for j in jobs) == 15
    assert sum(s.num_started for s in seen) == 3 and sum(s.num_finished for s in seen) == 3
