"""Embeddings injected at placeholder tokens (folio.embeddings) against transformers given `inputs_embeds`: the
token embeddings of the prompt with the payload rows in place of the placeholders. Logits through the Model (fp32,
whole, chunked across payloads, batched beside other sequences), greedy generation through the generator (chunked
prefill, batched jobs, n-gram drafting), page sharing by content, and the errors users see."""

from __future__ import annotations

import pytest
import torch
from tiny_models import load_hf_model, make_hf_model

import folio
from folio.embeddings import MAX_ROWS, PLACEHOLDER_BASE, InjectedEmbeddings
from folio.kv_cache import Cache
from folio.model.batch import ForwardBatch, SeqChunk
from folio.model.model import Model
from folio.results import Stage

GREEDY = folio.SamplerSettings.greedy()
MAX_REL_ERR = 1e-4
HIDDEN = 96  # tiny_models' hidden_size


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    return ((got - want).abs().max() / want.abs().max()).item()


def payload(num_rows: int, seed: int, hidden: int = HIDDEN) -> InjectedEmbeddings:
    return InjectedEmbeddings(torch.randn(num_rows, hidden, generator=torch.Generator().manual_seed(seed)))


def text_ids(n: int, seed: int, vocab: int = 250) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def hf_inputs_embeds(hf, prompt: list[int], payloads: list[InjectedEmbeddings]) -> torch.Tensor:
    """The oracle's input: the model's token embeddings (scaled where its family scales them), with each
    placeholder's payload row in its place (as given: inputs_embeds are not scaled)."""
    rows = {}
    for p in payloads:
        rows.update({t: p.embeddings[k] for k, t in enumerate(p.token_ids)})
    embeds = hf.get_input_embeddings()(torch.tensor([0 if t in rows else t for t in prompt]))
    for i, t in enumerate(prompt):
        if t in rows:
            embeds[i] = rows[t]
    return embeds


@torch.no_grad()
def hf_logits_embeds(hf, embeds: torch.Tensor) -> torch.Tensor:
    return hf(inputs_embeds=embeds[None]).logits[0].float()


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], payloads: list[InjectedEmbeddings], num_tokens: int) -> list[int]:
    embeds = hf_inputs_embeds(hf, prompt, payloads)
    out = []
    for _ in range(num_tokens):
        token = int(hf_logits_embeds(hf, embeds)[-1].argmax())
        out.append(token)
        embeds = torch.cat([embeds, hf.get_input_embeddings()(torch.tensor([token]))])
    return out


# --- the Model ---

@pytest.fixture(scope="module", params=["llama", "gemma2"])  # gemma2: token embeddings scaled, payloads not
def tiny(request, tmp_path_factory):
    path = make_hf_model(tmp_path_factory.mktemp(f"tiny-{request.param}"), request.param)
    return Model.from_pretrained(path, progress=False), load_hf_model(path)


def _job_embeddings(prompt: list[int], payloads: list[InjectedEmbeddings], model: Model):
    job = folio.DynamicJob(prompt, max_new_tokens=1, embeddings=payloads)
    job.embeddings.bind(model.device, model.dtype)
    return job.embeddings


def _cache(model: Model, num_pages: int, page_size: int) -> Cache:
    cache = Cache(model, num_tokens=num_pages * page_size, page_size=page_size)
    cache.k.fill_(float("nan"))  # a slot read before it is written poisons the logits
    cache.v.fill_(float("nan"))
    return cache


@pytest.mark.parametrize("page_size", [16, 256])
@pytest.mark.parametrize("chunk_sizes", [None, (8, 10, 5, 1, 6, 100)], ids=["whole", "chunked"])
def test_model_logits_equal_transformers_inputs_embeds(tiny, page_size, chunk_sizes):
    """Two payloads, one straddling chunk boundaries, one ending the prompt; fed whole or in chunks."""
    model, hf = tiny
    a, b = payload(7, 1), payload(12, 2)
    prompt = text_ids(5, 3) + a.token_ids + text_ids(10, 4) + b.token_ids
    want = hf_logits_embeds(hf, hf_inputs_embeds(hf, prompt, [a, b]))
    placed = _job_embeddings(prompt, [a, b], model)
    cache = _cache(model, 2 * -(-len(prompt) // page_size), page_size)
    table = list(range(cache.num_pages))[::-1][: -(-len(prompt) // page_size)]
    got, start = [], 0
    for size in chunk_sizes or (len(prompt),):
        end = min(start + size, len(prompt))
        chunk = SeqChunk(prompt[start:end], start, table, "all", injected=placed.spans(start, end))
        got.append(model.forward(ForwardBatch.build([chunk], page_size, model.device), cache))
        start = end
    assert start == len(prompt)
    assert rel_err(torch.cat(got), want) <= MAX_REL_ERR


def test_model_logits_batched_beside_other_sequences(tiny):
    """One forward: a plain prompt, a later chunk of an injected prompt (its payload split by the earlier chunk),
    and a second injected prompt whole; every row against its own oracle."""
    model, hf = tiny
    page_size = 16
    a, b, c = payload(9, 5), payload(4, 6), payload(3, 7)
    p0 = text_ids(30, 8)
    p1 = text_ids(6, 9) + a.token_ids + text_ids(4, 10) + b.token_ids + text_ids(5, 11)
    p2 = c.token_ids + text_ids(20, 12) + c.token_ids  # the same payload twice
    want0 = hf_logits_embeds(hf, hf_inputs_embeds(hf, p0, []))
    want1 = hf_logits_embeds(hf, hf_inputs_embeds(hf, p1, [a, b]))
    want2 = hf_logits_embeds(hf, hf_inputs_embeds(hf, p2, [c]))
    e1, e2 = _job_embeddings(p1, [a, b], model), _job_embeddings(p2, [c], model)
    cache = _cache(model, 12, page_size)
    tables = [[0, 5, 9], [2, 7, 1], [11, 3, 6]]
    split = 10  # inside payload a
    first = model.forward(ForwardBatch.build(
        [SeqChunk(p1[:split], 0, tables[1], "all", injected=e1.spans(0, split))], page_size, model.device), cache)
    got = model.forward(ForwardBatch.build([
        SeqChunk(p0, 0, tables[0], "all"),
        SeqChunk(p1[split:], split, tables[1], "all", injected=e1.spans(split, len(p1))),
        SeqChunk(p2, 0, tables[2], "all", injected=e2.spans(0, len(p2))),
    ], page_size, model.device), cache)
    assert rel_err(first, want1[:split]) <= MAX_REL_ERR
    n0, n1 = len(p0), len(p1) - split
    assert rel_err(got[:n0], want0) <= MAX_REL_ERR
    assert rel_err(got[n0:n0 + n1], want1[split:]) <= MAX_REL_ERR
    assert rel_err(got[n0 + n1:], want2) <= MAX_REL_ERR


# --- the generator ---

def _run(generator, jobs) -> None:
    for job in jobs:
        generator.enqueue(job)
    for _ in range(10_000):
        if not generator.num_remaining_jobs():
            break
        for r in generator.step().results:
            assert r.stage != Stage.STREAMING or r.error is None, r.error
        generator.cache_manager.check()
    assert not generator.num_remaining_jobs()


def _job(prompt, payloads, max_new_tokens=10, **kwargs):
    return folio.DynamicJob(prompt, max_new_tokens=max_new_tokens, gen_settings=kwargs.pop("gen_settings", GREEDY),
                            stop_conditions=[], embeddings=payloads, **kwargs)


def _ending_alone(text: list[int], p: InjectedEmbeddings, chunk: int = 16) -> list[int]:
    """text, padded, then p's placeholders: chunks of `chunk` tokens leave its last placeholder alone in the last
    chunk (fed like a decode row)."""
    return text + [text[-1]] * ((1 - len(text) - p.num_tokens) % chunk) + p.token_ids


def _prompts(peaked):
    tok = peaked.tokenizer
    a, b = payload(12, 20), payload(5, 21)
    return [
        (tok.encode("The lighthouse keeper saw") + a.token_ids + tok.encode(" and then") + b.token_ids, [a, b]),
        (_ending_alone(tok.encode("A ship"), b), [b]),
        (tok.encode("The lighthouse keeper walked along the shore"), None),
    ]


def test_greedy_generation_equals_transformers(peaked):
    """Chunks of 16 tokens (payload a straddles one), all jobs batched together."""
    hf = load_hf_model(peaked.path)
    cases = _prompts(peaked)
    jobs = [_job(p, e) for p, e in cases]
    _run(peaked.generator(page_size=16, max_chunk_size=16), jobs)
    for job, (prompt, payloads) in zip(jobs, cases):
        assert job.generated_ids == hf_greedy(hf, prompt, payloads or [], 10)


def test_preempted_and_resumed_equals_uninterrupted(peaked):
    """A small cache: jobs are preempted while decoding and prefill their prompts (payloads included) again."""
    cases = [(p, e) for p, e in _prompts(peaked) for _ in range(2)]
    runs = []
    for num_pages in (256, 10):
        generator = peaked.generator(num_tokens=num_pages * 16)
        jobs = [_job(p, e, max_new_tokens=30) for p, e in cases]
        _run(generator, jobs)
        runs.append([job.generated_ids for job in jobs])
    assert generator.scheduler.num_preemptions > 0
    assert runs[0] == runs[1]


def test_ngram_drafting_never_drafts_a_placeholder(peaked):
    """The prompt's suffix after the first sampled token matches the prompt's start, which a placeholder run
    follows: prompt lookup would propose its ids. Drafting stops before them; output as without drafting."""
    t = 77
    a = payload(6, 22)
    prompt = [t, t] + a.token_ids + [9, t]
    settings = folio.SamplerSettings.greedy(token_bias={t: 100.0})
    outs = []
    for drafting in (False, True):
        job = _job(prompt, [a], max_new_tokens=8, gen_settings=settings)
        _run(peaked.generator(use_ngram_draft=drafting), [job])
        outs.append(job.generated_ids)
    assert outs[0] == outs[1] == [t] * 8


class _EagerGraphs:
    """Stands in for the captured decode graphs on the CPU (same call, run eagerly), recording the ids fed."""

    def __init__(self, model: Model, cache: Cache):
        self.model, self.cache, self.fed_ids = model, cache, []

    def bucket_for(self, num_rows: int) -> int:
        return num_rows

    def run(self, token_ids, positions, block_tables, row_slots=None) -> torch.Tensor:
        assert row_slots is None  # (no LoRA adapter here)
        ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
        self.fed_ids += ids
        chunks = [SeqChunk([t], p, table) for t, p, table in zip(ids, positions, block_tables)]
        return self.model.forward(ForwardBatch.build(chunks, self.cache.page_size, self.model.device), self.cache)


def test_rows_with_injections_never_replay_a_graph(peaked):
    """A prompt whose last chunk is its last placeholder alone is fed like a decode row, which would replay a
    captured graph (token ids only): it must run eagerly. Greedy ids as transformers'."""
    hf = load_hf_model(peaked.path)
    generator = peaked.generator(page_size=16, max_chunk_size=16)
    graphs = generator.runner.graphs = _EagerGraphs(peaked.model, generator.cache)
    cases = _prompts(peaked)
    jobs = [_job(p, e) for p, e in cases]
    _run(generator, jobs[1:2])  # alone, so that its chunks are its own 16 tokens each
    _run(generator, jobs[:1] + jobs[2:])
    assert graphs.fed_ids and not any(t >= PLACEHOLDER_BASE for t in graphs.fed_ids)
    for job, (prompt, payloads) in zip(jobs, cases):
        assert job.generated_ids == hf_greedy(hf, prompt, payloads or [], 10)


# --- pages ---

def test_pages_are_shared_by_content_only(peaked):
    """Equal token ids with other content (forced: a collision of the id blocks) share no page; a new object with
    the same content shares the prompt's pages."""
    tok = peaked.tokenizer
    hf = load_hf_model(peaked.path)
    a = payload(20, 30)
    other = payload(20, 31)
    other.first_token_id = a.first_token_id  # what a chance collision of the digests' id blocks would give
    prompt = tok.encode("The lighthouse keeper saw the ship") + a.token_ids + tok.encode(" far away at sea")
    generator = peaked.generator(page_size=16)
    first = _job(prompt, [a])
    _run(generator, [first])
    clash = _job(prompt, [other])
    _run(generator, [clash])
    assert clash.sequence.page_hashes[0] != first.sequence.page_hashes[0]
    assert clash.cached_tokens == 0
    assert clash.generated_ids == hf_greedy(hf, prompt, [other], 10)
    same = _job(prompt, [InjectedEmbeddings(a.embeddings.clone())])
    _run(generator, [same])
    assert same.sequence.page_hashes == first.sequence.page_hashes[: len(same.sequence.page_hashes)]
    assert same.cached_tokens >= (len(prompt) - 1) // 16 * 16  # (and the partial last page, reused in part)
    assert same.generated_ids == first.generated_ids


def test_same_content_gives_same_ids_and_digest():
    x = torch.randn(4, HIDDEN)
    a, b = InjectedEmbeddings(x), InjectedEmbeddings(x.clone())
    assert a.token_ids == b.token_ids and a.digest == b.digest
    c = InjectedEmbeddings(x.to(torch.bfloat16))
    assert c.digest != a.digest
    assert all(PLACEHOLDER_BASE <= t < 2**63 for t in a.token_ids + c.token_ids)
    x += 1  # the payload was copied: the caller's tensor may change
    assert InjectedEmbeddings(x).digest != a.digest and torch.equal(a.embeddings, b.embeddings)


# --- errors ---

@pytest.mark.parametrize("tensor, error", [
    ([[0.0] * 4], TypeError),
    (torch.zeros(4), ValueError),
    (torch.zeros(0, 4), ValueError),
    (torch.zeros(2, 4, dtype=torch.int64), ValueError),
    (torch.tensor([[0.0, float("nan")]]), ValueError),
])
def test_bad_payloads_refused(tensor, error):
    with pytest.raises(error, match="embeddings"):
        InjectedEmbeddings(tensor)


def test_bad_prompts_refused():
    a, b = payload(4, 40), payload(3, 41)
    ids = a.token_ids
    cases = [
        ([5] + ids, None, "no embeddings"),
        ([5, 6], [a], "no placeholder run"),
        ([5] + ids[:2] + [6], [a], "breaks off after 2"),
        ([5] + ids[1:], [a], "starts at row 1"),
        ([5] + ids + b.token_ids, [a], "no payload in embeddings owns"),
        ([5] + ids, a, "list of folio.InjectedEmbeddings"),
        ([5] + ids, [ids], "must be a folio.InjectedEmbeddings"),
    ]
    for prompt, payloads, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            folio.DynamicJob(prompt, max_new_tokens=1, embeddings=payloads)
    with pytest.raises(ValueError, match="classifier-free guidance"):
        folio.DynamicJob([[5] + ids, [5, 6]], max_new_tokens=1, embeddings=[a],
                         gen_settings=folio.SamplerSettings(cfg_scale=1.5))
    with pytest.raises(ValueError, match="token_healing"):
        folio.DynamicJob([5] + ids, max_new_tokens=1, embeddings=[a], token_healing=True)
    healed = folio.DynamicJob([5] + ids + [6, 7], max_new_tokens=1, embeddings=[a], token_healing=True)
    assert healed.healing_token_id == 7
    # the same content twice in the list counts once; a placeholder block collision of different content is refused
    assert len(folio.DynamicJob([5] + ids, max_new_tokens=1, embeddings=[a, payload(4, 40)]).embeddings.payloads) == 1
    clash = payload(4, 42)
    clash.first_token_id = a.first_token_id
    with pytest.raises(ValueError, match="same placeholder ids"):
        folio.DynamicJob([5] + ids, max_new_tokens=1, embeddings=[a, clash])
    assert MAX_ROWS >= 1 << 20


def test_refused_at_enqueue(peaked):
    a = payload(4, 50, hidden=HIDDEN + 1)
    generator = peaked.generator()
    with pytest.raises(ValueError, match="hidden_size"):
        generator.enqueue(folio.DynamicJob([5] + a.token_ids, max_new_tokens=1, embeddings=[a]))
    vocab = generator.vocab_size
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        generator.enqueue(folio.DynamicJob([5, vocab], max_new_tokens=1))
    b = payload(4, 51)
    drafting = peaked.generator(draft_model=peaked.model)
    with pytest.raises(ValueError, match="draft model"):
        drafting.enqueue(folio.DynamicJob([5] + b.token_ids, max_new_tokens=1, embeddings=[b]))
    assert generator.num_remaining_jobs() == drafting.num_remaining_jobs() == 0


# --- GPU ---

@pytest.mark.gpu
def test_cuda_generation_with_graphs_equals_transformers(peaked_dir):
    """On CUDA with captured decode graphs and launch-ahead: a prompt whose last chunk is its last placeholder
    alone (fed as a decode row would be, which must not replay a graph) and chunked prefill, batched; greedy ids
    against transformers on the CPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    tokenizer = folio.Tokenizer.from_pretrained(peaked_dir)
    model = folio.Model.from_pretrained(peaked_dir, device="cuda", dtype=torch.float32, progress=False)
    hf = load_hf_model(peaked_dir)
    generator = folio.DynamicGenerator(model, folio.Cache(model, num_tokens=4096, page_size=16), tokenizer,
                                       max_chunk_size=16)
    assert generator.runner.graphs is not None
    a, b = payload(15, 60), payload(17, 61)
    cases = [(tokenizer.encode("The lighthouse keeper saw") + a.token_ids, [a]),
             (_ending_alone(tokenizer.encode("A ship far away"), b), [b]),
             (tokenizer.encode("The lighthouse keeper walked along the shore"), None)]
    jobs = [_job(p, e) for p, e in cases]
    _run(generator, jobs[1:2])  # alone, so that its chunks are its own 16 tokens each
    _run(generator, jobs[:1] + jobs[2:])
    for job, (prompt, payloads) in zip(jobs, cases):
        assert job.generated_ids == hf_greedy(hf, prompt, payloads or [], 10)
