"""folio's forward over the paged cache against Hugging Face transformers' logits (fp32, tiny random models).

Every scenario runs with page sizes 16 (prompts cross several pages) and 256, with shuffled block tables, and with
the cache pre-filled with NaN so that reading any slot that was never written poisons the result.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from tiny_models import LLAMA3_ROPE, hf_logits, load_hf_model, make_hf_model, nan_cache
from tiny_models import run_chunks as run

from folio.kv_cache import Cache
from folio.model.batch import SeqChunk
from folio.model.model import Model
from folio.options import EngineOptions

VARIANTS: dict[str, dict] = {
    "llama": dict(arch="llama"),
    "llama-tied": dict(arch="llama", tie=True),
    "llama-rope3": dict(arch="llama", rope_parameters=LLAMA3_ROPE),
    "llama-attn-bias": dict(arch="llama", attention_bias=True),
    "mistral": dict(arch="mistral"),
    "mistral-tied": dict(arch="mistral", tie=True),
    "qwen2": dict(arch="qwen2"),
    "qwen2-tied": dict(arch="qwen2", tie=True),
    "qwen3": dict(arch="qwen3"),
    "qwen3-tied": dict(arch="qwen3", tie=True),
}
PROMPT_LENS = (67, 41, 53, 58)
PAGE_SIZES = (16, 256)
MAX_REL_ERR = 1e-4


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    return ((got - want).abs().max() / want.abs().max()).item()


@dataclass
class Case:
    model: Model
    prompts: list[list[int]]
    want: list[torch.Tensor]  # HF logits per prompt, [len, vocab]


@pytest.fixture(scope="module", params=list(VARIANTS))
def case(request, tmp_path_factory) -> Case:
    spec = dict(VARIANTS[request.param])
    path = make_hf_model(tmp_path_factory.mktemp(request.param), spec.pop("arch"), **spec)
    hf = load_hf_model(path)
    gen = torch.Generator().manual_seed(len(request.param))
    prompts = [torch.randint(0, 250, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    return Case(Model.from_pretrained(path, progress=False), prompts, [hf_logits(hf, p) for p in prompts])


def shuffled_block_tables(page_size: int, seed: int) -> tuple[list[list[int]], int]:
    """Each prompt gets its pages from a random permutation: non-contiguous and out of order."""
    pages_per_seq = [-(-n // page_size) for n in PROMPT_LENS]
    num_pages = sum(pages_per_seq) + 3  # a few pages nobody uses
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, offset = [], 0
    for n in pages_per_seq:
        tables.append(perm[offset : offset + n])
        offset += n
    return tables, num_pages


def new_cache(model: Model, page_size: int, seed: int = 0) -> tuple[Cache, list[list[int]]]:
    tables, num_pages = shuffled_block_tables(page_size, seed)
    return nan_cache(model, num_pages, page_size), tables


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_whole_prompt(case: Case, page_size: int) -> None:
    cache, tables = new_cache(case.model, page_size)
    got = run(case.model, cache, [SeqChunk(case.prompts[0], 0, tables[0], "all")])
    assert got.dtype == torch.float32
    assert rel_err(got, case.want[0]) <= MAX_REL_ERR


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_chunked_prompt(case: Case, page_size: int) -> None:
    """Chunks start mid-page and read K/V that earlier forward calls wrote."""
    cache, tables = new_cache(case.model, page_size, seed=1)
    prompt, got, start = case.prompts[0], [], 0
    for size in (5, 16, 20, 1, 25):
        chunk = SeqChunk(prompt[start : start + size], start, tables[0], "all")
        got.append(run(case.model, cache, [chunk]))
        start += size
    assert start == len(prompt)
    assert rel_err(torch.cat(got), case.want[0]) <= MAX_REL_ERR


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_token_by_token_decode(case: Case, page_size: int) -> None:
    """All prompts decoded together one token per step (variable lengths; shorter ones drop out)."""
    cache, tables = new_cache(case.model, page_size, seed=2)
    got: list[list[torch.Tensor]] = [[] for _ in case.prompts]
    for pos in range(max(PROMPT_LENS)):
        active = [i for i, p in enumerate(case.prompts) if pos < len(p)]
        chunks = [SeqChunk([case.prompts[i][pos]], pos, tables[i], "last") for i in active]
        logits = run(case.model, cache, chunks)
        for row, i in enumerate(active):
            got[i].append(logits[row])
    for i, want in enumerate(case.want):
        assert rel_err(torch.stack(got[i]), want) <= MAX_REL_ERR, f"prompt {i}"


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_mixed_batch(case: Case, page_size: int) -> None:
    """One forward with a whole prompt, a later chunk of a second prompt and decode rows of two more."""
    cache, tables = new_cache(case.model, page_size, seed=3)
    p0, p1, p2, p3 = case.prompts
    first = run(case.model, cache, [
        SeqChunk(p1[:30], 0, tables[1], "last"),
        SeqChunk(p2[:-1], 0, tables[2], "none"),
        SeqChunk(p3[:-1], 0, tables[3], "none"),
    ])
    assert first.shape == (1, 250)
    assert rel_err(first, case.want[1][29:30]) <= MAX_REL_ERR

    got = run(case.model, cache, [
        SeqChunk(p2[-1:], len(p2) - 1, tables[2], "last"),
        SeqChunk(p0, 0, tables[0], "all"),
        SeqChunk(p1[30:47], 30, tables[1], "all"),
        SeqChunk(p3[-1:], len(p3) - 1, tables[3], "last"),
    ])
    want = torch.cat([case.want[2][-1:], case.want[0], case.want[1][30:47], case.want[3][-1:]])
    assert rel_err(got, want) <= MAX_REL_ERR


def test_reference_ops_backend(case: Case) -> None:
    """EngineOptions(ops_backend="reference"): the same weights on the torch reference ops (no native kernel, even
    where the CPU module is built) match transformers too, prompt and then one-token decode steps."""
    model = case.model.with_options(EngineOptions(ops_backend="reference"))
    assert model.ops.backend == "reference" and case.model.ops.backend == "auto"
    cache, tables = new_cache(model, 16, seed=4)
    prompt, split = case.prompts[0], len(case.prompts[0]) - 3
    got = [run(model, cache, [SeqChunk(prompt[:split], 0, tables[0], "all")])]
    got += [run(model, cache, [SeqChunk([prompt[pos]], pos, tables[0], "last")]) for pos in range(split, len(prompt))]
    assert all(model.ops.implementation_name(op, "cpu") == "reference"
               for op in ("rms_norm", "rotary_cache_write", "paged_attention", "paged_attention_decode"))
    assert rel_err(torch.cat(got), case.want[0]) <= MAX_REL_ERR
