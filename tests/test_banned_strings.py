"""Banned strings (DynamicJob(banned_strings=)): never in the output, matched case-insensitively; rollback through
the cache manager (pages checked every step, none in use at the end), with filters, preemption, launch-ahead and
overlapped emission; a job with nothing left to pick fails alone."""

from __future__ import annotations

import random

import pytest
from test_generator import GREEDY, prompts, run_to_end

import folio
from folio.constrain.base import Filter
from folio.results import EosReason, Stage

SAMPLED = folio.SamplerSettings(temperature=1.0, top_k=40, top_p=0.95)


def streamed(results):
    rs = [r for r in results if r.stage == Stage.STREAMING]
    return "".join(r.text for r in rs), [t for r in rs for t in r.token_ids]


def make(ids, banned=None, settings=GREEDY, seed=0, max_new_tokens=32, **kwargs):
    return folio.DynamicJob(input_ids=ids, max_new_tokens=max_new_tokens, gen_settings=settings, seed=seed,
                            stop_conditions=[], banned_strings=banned, **kwargs)


def check_clean(job, results, banned):
    text, ids = streamed(results)
    last = results[-1]
    assert last.eos and last.eos_reason != EosReason.ERROR, last.error
    assert text == job.full_completion == last.full_completion
    assert ids == job.generated_ids
    for s in banned:
        assert s.lower() not in text.lower()
    return sum(bool(r.suppressed_tokens) for r in results if r.stage == Stage.STREAMING)


def substrings(text, rng, n):
    """n short substrings of text with some letters, in random case."""
    words = [w for w in text.split() if len(w) >= 3] or [text[:4]]
    out = []
    for _ in range(n):
        w = rng.choice(words)
        start = rng.randrange(0, len(w) - 2)
        s = w[start:start + rng.randint(2, 4)]
        out.append("".join(c.upper() if rng.random() < 0.5 else c for c in s))
    return out


@pytest.mark.parametrize("ahead", [False, True])
def test_banned_strings_never_appear(demo, ahead):
    """Many seeds with sampled settings: strings the unbanned run produces are banned (in random case), so the ban
    bites; the banned runs never contain them, report what they suppressed, and equal each other with and without
    launch-ahead and overlapped emission."""
    tok = demo.tokenizer
    rng = random.Random(1)
    base = prompts(tok, 6)
    free = [make(base[i % 6], settings=SAMPLED, seed=i) for i in range(12)]
    run_to_end(demo.generator(max_batch_size=6), free)
    banned = [substrings(f.full_completion, rng, 2) for f in free]
    runs = {}
    for decode_ahead in ((False, True) if ahead else (False,)):
        jobs = [make(base[i % 6], banned=banned[i], settings=SAMPLED, seed=i) for i in range(12)]
        gen = demo.generator(max_batch_size=6, decode_ahead=decode_ahead, overlap_emit=decode_ahead)
        steps = []
        results = run_to_end(gen, jobs, stats=steps)
        assert gen.cache_manager.num_in_use == 0 and gen.num_remaining_jobs() == 0
        suppressed = [check_clean(j, results[j.serial], banned[i]) for i, j in enumerate(jobs)]
        assert sum(s > 0 for s in suppressed) >= len(jobs) // 2  # the ban bit
        assert sum(s.num_rolled_back for s in steps) > 0
        if decode_ahead:
            assert not any(s.launched_ahead for s in steps)  # every step had a job with banned strings
        runs[decode_ahead] = [(j.generated_ids, j.full_completion) for j in jobs]
    if ahead:
        assert runs[True] == runs[False]


def test_output_without_banned_text_is_unchanged(peaked):
    """Greedy: a ban on strings the run never produces (some of whose prefixes it does produce, so text is held and
    released later) changes nothing: same tokens, same text."""
    tok = peaked.tokenizer
    token_lists = prompts(tok, 4)
    free = [make(ids) for ids in token_lists]
    run_to_end(peaked.generator(), free)
    jobs = []
    for f, ids in zip(free, token_lists):
        text = f.full_completion
        banned = [text[5:8] + "\u2603", text[10:12].upper() + "\u2603q", "zzqzz"]
        assert not any(b.lower() in text.lower() for b in banned)
        jobs.append(make(ids, banned=banned))
    results = run_to_end(peaked.generator(), jobs)
    for f, j in zip(free, jobs):
        assert j.generated_ids == f.generated_ids and j.full_completion == f.full_completion
        assert check_clean(j, results[j.serial], j.banned_strings) == 0


def test_suppressed_text_is_reported(peaked):
    tok = peaked.tokenizer
    ids = prompts(tok, 1)[0]
    free = make(ids)
    run_to_end(peaked.generator(), [free])
    word = free.full_completion.split()[1]
    job = make(ids, banned=[word.upper()])
    results = run_to_end(peaked.generator(), [job])[job.serial]
    assert check_clean(job, results, [word]) > 0
    rolled = [r for r in results if r.stage == Stage.STREAMING and r.suppressed_tokens]
    assert word.lower() in rolled[0].suppressed_text.lower()
    assert tok.decode(rolled[0].suppressed_tokens).startswith(rolled[0].suppressed_text[:1])
    assert not rolled[0].text and not rolled[0].token_ids
    # up to the rollback the output is the unbanned one's
    assert job.full_completion.startswith(free.full_completion[:free.full_completion.lower().index(word.lower())]
                                          [:1])


class NoRepeat(Filter):
    """Allows any token of `allowed` but the one fed last (stateful: a rollback must restore it)."""

    def __init__(self, allowed):
        super().__init__()
        self.allowed = frozenset(allowed)

    def allowed_tokens(self):
        return self.allowed - set(self._fed[-1:])

    def feed(self, token_id):
        assert token_id in self.allowed_tokens(), "filter fed a token it does not allow"
        super().feed(token_id)

    def reset(self):
        self._fed = []


def test_banned_strings_with_a_filter_and_preemption(peaked):
    """Filtered jobs with banned strings in a cache small enough to preempt: the filter holds (it is rolled back
    with the job), nothing banned appears, pages are checked every step, and greedy outputs equal those of each
    job alone."""
    tok = peaked.tokenizer
    allowed = [t for t in range(3, 400) if tok.token_bytes(t).strip()]
    token_lists = prompts(tok, 6)

    def jobs_for(banned_lists):
        return [make(ids, banned=b, filters=[NoRepeat(allowed)], max_new_tokens=40)
                for ids, b in zip(token_lists, banned_lists)]

    free = jobs_for([None] * 6)
    run_to_end(peaked.generator(), free)
    rng = random.Random(3)
    banned_lists = [substrings(f.full_completion, rng, 2) for f in free]
    alone = []
    for job in jobs_for(banned_lists):
        run_to_end(peaked.generator(), [job])
        alone.append(job.generated_ids)
    jobs = jobs_for(banned_lists)
    steps = []
    gen = peaked.generator(num_tokens=160, page_size=16)
    results = run_to_end(gen, jobs, stats=steps)
    assert sum(s.num_preemptions for s in steps) > 0
    assert gen.cache_manager.num_in_use == 0
    assert sum(check_clean(j, results[j.serial], j.banned_strings) for j in jobs) > 0
    for j in jobs:
        assert all(t in allowed for t in j.generated_ids)
        assert all(a != b for a, b in zip(j.generated_ids, j.generated_ids[1:]))
    assert [j.generated_ids for j in jobs] == alone


class Only(Filter):
    def __init__(self, allowed):
        super().__init__()
        self.allowed = allowed

    def allowed_tokens(self):
        return self.allowed

    def reset(self):
        self._fed = []


def test_a_job_with_every_alternative_banned_fails_alone(peaked):
    tok = peaked.tokenizer
    allowed = [t for t in range(3, 300) if tok.token_bytes(t).strip().isalpha()][:5]
    token_lists = prompts(tok, 3)
    banned = [tok.token_bytes(t).decode().strip()[:1] for t in allowed]
    jobs = [make(token_lists[0]), make(token_lists[1], banned=banned, filters=[Only(allowed)]),
            make(token_lists[2], banned=["the"], settings=SAMPLED, seed=5)]
    results = run_to_end(peaked.generator(decode_ahead=True, overlap_emit=True), jobs)
    failed = results[jobs[1].serial][-1]
    assert failed.eos_reason == EosReason.ERROR and "banned string" in str(failed.error)
    assert len(jobs[0].generated_ids) == 32
    check_clean(jobs[2], results[jobs[2].serial], ["the"])


def test_launch_ahead_resumes_after_the_banned_job_ends(demo):
    """Steps that sample a job with banned strings are neither launched ahead nor emitted late; once it ends, the
    others' steps are again; outputs equal the plain pipeline's."""
    tok = demo.tokenizer
    token_lists = prompts(tok, 3)

    def jobs():
        return [make(token_lists[0], banned=["est", "ES T"], max_new_tokens=8),
                make(token_lists[1], settings=SAMPLED, seed=2, max_new_tokens=30),
                make(token_lists[2], max_new_tokens=30)]

    outs = []
    for ahead in (False, True):
        js, steps = jobs(), []
        gen = demo.generator(decode_ahead=ahead, overlap_emit=ahead)
        results = run_to_end(gen, js, stats=steps)
        check_clean(js[0], results[js[0].serial], ["est", "es t"])
        assert any(s.launched_ahead for s in steps) is ahead
        assert gen.emitter.num_rolling_back == 0  # (the banned job ended: the steps' check is a counter's)
        outs.append([(j.generated_ids, j.full_completion) for j in js])
    assert outs[0] == outs[1]


def test_jobs_that_roll_back_are_counted_while_live(demo):
    """The emitter counts the live jobs that may roll back (the step asks its rows only while there are some):
    enqueued, cancelled, failed and finished jobs all keep the count right."""
    tok = demo.tokenizer
    token_lists = prompts(tok, 3)
    gen = demo.generator()
    banned = [make(token_lists[0], banned=["est"], max_new_tokens=6), make(token_lists[1], banned=["a"])]
    plain = make(token_lists[2], max_new_tokens=6)
    gen.enqueue(banned + [plain])
    assert gen.emitter.num_rolling_back == 2
    gen.cancel(banned[1])
    gen.cancel(banned[1])  # (twice: counted once)
    assert gen.emitter.num_rolling_back == 1
    run_to_end(gen, [])
    assert gen.emitter.num_rolling_back == 0 and banned[0].generated_ids and plain.generated_ids


def test_bad_banned_strings():
    with pytest.raises(TypeError):
        folio.DynamicJob(input_ids=[1, 2], max_new_tokens=3, banned_strings="abc")
    with pytest.raises(ValueError, match="empty"):
        folio.DynamicJob(input_ids=[1, 2], max_new_tokens=3, banned_strings=[""])
    job = folio.DynamicJob(input_ids=[1, 2], max_new_tokens=3, banned_strings=["AbC", "abc"])
    assert job.banned_strings == ("abc",) and not job.takes_drafts


class _Bytes:
    """A tokenizer of raw byte strings (id -> bytes)."""

    special_ids = frozenset()

    def __init__(self, table):
        self.table = table

    def token_bytes(self, token_id):
        return self.table[token_id]

    def id_to_piece(self, token_id):
        return self.table[token_id].decode("utf-8", "replace")


def test_text_stream_holds_whole_tokens_and_rewinds_split_characters():
    from folio.banned import BannedStrings, BannedTextStream

    snow = "\u2603".encode()  # three bytes, split over two tokens
    tok = _Bytes({1: b"ab", 2: b"xyF", 3: b"oO", 4: snow[:2], 5: snow[2:] + b"!", 6: b"c"})
    stream = BannedTextStream(tok, BannedStrings(("foo", "\u2603!")), stop_strings=["zz"])
    assert stream.push(1).text == "ab"
    held = stream.push(2)  # "xyF" could start "foo": the whole token is held, "xy" with it
    assert held.text == "" and held.token_ids == []
    event = stream.push(3)
    assert event.suppressed_text == "xyFoO" and event.suppressed_token_ids == [2, 3] and event.text == ""
    assert stream.push(4).text == ""
    event = stream.push(5)
    assert event.suppressed_text == "\u2603!" and event.suppressed_token_ids == [4, 5]
    assert stream.push(6).text == "c" and stream.flush().text == ""


def test_rollback_undoes_mirostat_state(demo):
    """A mirostat job with banned strings: after its rollbacks, its mu is the chain of updates over the tokens it
    kept (the suppressed tokens' updates are undone), recomputed from the probabilities it reports."""
    from folio.sampling.state import mirostat_mu, mirostat_update

    tok = demo.tokenizer
    rng = random.Random(4)
    settings = folio.SamplerSettings(temperature=1.0, top_k=0, top_p=1.0, mirostat=2, mirostat_tau=3.0,
                                     token_repetition_penalty=1.0)
    base = prompts(tok, 4)
    free = [make(base[i], settings=settings, seed=10 + i, max_new_tokens=40) for i in range(4)]
    run_to_end(demo.generator(), free)
    banned = [substrings(f.full_completion, rng, 3) for f in free]
    jobs = [make(base[i], banned=banned[i], settings=settings, seed=10 + i, max_new_tokens=40, return_probs=True)
            for i in range(4)]
    results = run_to_end(demo.generator(), jobs)
    rolled_back = 0
    for job in jobs:
        rolled_back += check_clean(job, results[job.serial], banned[jobs.index(job)])
        probs = [p for r in results[job.serial] if r.stage == Stage.STREAMING for p in (r.token_probs or [])]
        assert len(probs) == len(job.generated_ids)
        mu = mirostat_mu(settings, None)
        for p in probs:
            mu = mirostat_update(settings, mu, p)
        assert job.sequence.sampler_state.mirostat_mu == pytest.approx(mu, rel=1e-5, abs=1e-5)
        assert len(job.sequence.sampler_state.mu_before) == len(probs)
    assert rolled_back > 0  # the ban bit
