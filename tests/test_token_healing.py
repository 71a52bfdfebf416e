"""Token healing (DynamicJob(token_healing=True)): the last prompt token is generated again as a token starting
with its bytes, only the added bytes are output, the healed token is not counted in max_new_tokens; filters start
after it; with banned strings, launch-ahead and overlapped emission."""

from __future__ import annotations

import pytest
from test_filters_engine import Cycle
from test_generator import GREEDY, run_to_end

import folio
from folio.constrain.healing import HealingFilter, PrefixIndex
from folio.results import Stage

CUT = "Once upon a time the vill"  # ends in the token " vill", a prefix of " village", which the model prefers


def make(ids, heal=True, max_new_tokens=8, **kwargs):
    return folio.DynamicJob(input_ids=ids, max_new_tokens=max_new_tokens, gen_settings=kwargs.pop("settings", GREEDY),
                            stop_conditions=[], token_healing=heal, **kwargs)


def streamed_text(results):
    return "".join(r.text for r in results if r.stage == Stage.STREAMING)


def test_a_prompt_cut_mid_word_completes_the_word(peaked):
    tok = peaked.tokenizer
    ids = tok.encode(CUT)
    removed = tok.token_bytes(ids[-1])
    assert removed == b" vill"
    job = make(ids)
    results = run_to_end(peaked.generator(), [job])[job.serial]
    healed = job.generated_ids[0]
    assert job.healing_token_id == ids[-1] and job.input_ids == ids[:-1]
    assert healed != ids[-1] and tok.token_bytes(healed).startswith(removed)
    assert healed in PrefixIndex.of(tok).starting_with(removed)
    text = streamed_text(results)
    assert text == job.full_completion
    # the removed piece plus the emitted text starts with the healed vocabulary token
    assert (removed + text.encode()).startswith(tok.token_bytes(healed))
    assert (tok.decode(ids[:-1]) + tok.token_bytes(ids[-1]).decode() + text).startswith("Once upon a time the village")
    # max_new_tokens counts the tokens after the healed one
    last = results[-1]
    assert len(job.generated_ids) == 9 and last.new_tokens == 8


def test_without_healing_the_prompt_runs_as_before(peaked):
    tok = peaked.tokenizer
    ids = tok.encode(CUT)
    plain = make(ids, heal=False)
    run_to_end(peaked.generator(), [plain])
    assert tok.token_bytes(plain.generated_ids[0]) != b" village"
    # the healed job's continuation after its first token is the plain model run on the healed prompt
    healed = make(ids)
    run_to_end(peaked.generator(), [healed])
    again = make(ids[:-1] + healed.generated_ids[:1], heal=False, max_new_tokens=8)
    run_to_end(peaked.generator(), [again])
    assert again.generated_ids == healed.generated_ids[1:]


def test_healing_only_allows_tokens_starting_with_the_removed_one(peaked):
    tok = peaked.tokenizer
    f = HealingFilter(tok.encode(CUT)[-1])
    f.bind(tok, tok.vocab_size)
    allowed = set(f.allowed_tokens())
    want = {t for t in range(tok.vocab_size)
            if t not in tok.special_ids and tok.token_bytes(t).startswith(b" vill")}
    assert allowed == want and f.token_id in allowed and len(allowed) >= 2
    special = HealingFilter(tok.eos_token_ids[0])
    special.bind(tok, tok.vocab_size)
    assert list(special.allowed_tokens()) == [tok.eos_token_ids[0]]
    assert PrefixIndex.of(tok) is PrefixIndex.of(tok)  # built once per tokenizer


def test_a_one_token_prompt_cannot_heal():
    with pytest.raises(ValueError, match="at least 2 tokens"):
        folio.DynamicJob(input_ids=[5], max_new_tokens=3, token_healing=True)


def test_filters_start_after_the_healed_token(peaked):
    tok = peaked.tokenizer
    ids = tok.encode(CUT)
    job = make(ids, max_new_tokens=20, filters=[Cycle([5, 17, 42], length=4)])
    run_to_end(peaked.generator(), [job])
    assert tok.token_bytes(job.generated_ids[0]).startswith(b" vill")
    assert job.generated_ids[1:] == [5, 17, 42, 5]


@pytest.mark.parametrize("ahead", [False, True])
def test_healing_with_banned_strings_and_launch_ahead(peaked, ahead):
    """A ban on the healed word's completion rolls back to the healed token itself: healing applies again there,
    with " village" blocked; other prompts in the batch heal alongside, equal to the plain pipeline's runs."""
    tok = peaked.tokenizer
    ids = tok.encode(CUT)
    others = [tok.encode(t) for t in ("She walked to the har", "The lighthouse keeper walked along the sh")]

    def jobs():
        return [make(ids, banned_strings=["AGE"])] + [
            make(o, settings=folio.SamplerSettings(temperature=1.0, top_k=20), seed=i, max_new_tokens=12)
            for i, o in enumerate(others)]

    js = jobs()
    gen = peaked.generator(decode_ahead=ahead, overlap_emit=ahead)
    results = run_to_end(gen, js)
    assert gen.cache_manager.num_in_use == 0
    first = js[0]
    assert any(r.suppressed_tokens for r in results[first.serial] if r.stage == Stage.STREAMING)
    assert tok.token_bytes(first.generated_ids[0]).startswith(b" vill")
    assert tok.token_bytes(first.generated_ids[0]) != b" village"
    assert "age" not in first.full_completion.lower()
    for j, o in zip(js[1:], others):
        assert tok.token_bytes(j.generated_ids[0]).startswith(tok.token_bytes(o[-1]))
        assert streamed_text(results[j.serial]) == j.full_completion
    plain = jobs()
    run_to_end(peaked.generator(decode_ahead=False, overlap_emit=False), plain)
    assert [j.generated_ids for j in plain] == [j.generated_ids for j in js]
