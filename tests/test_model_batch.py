"""ForwardBatch building (exact tensors) and the device K/V Cache."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_hf_model

from folio.kv_cache import Cache
from folio.model.batch import ForwardBatch, SeqChunk
from folio.model.model import Model


def test_build_exact_tensors() -> None:
    chunks = [
        SeqChunk([11, 12, 13], start_pos=14, block_table=[5, 2, 9], logits="all"),  # crosses 16 -> page 2
        SeqChunk([21], start_pos=0, block_table=[7], logits="none"),
        SeqChunk([31, 32], start_pos=3, block_table=[4], logits="last"),
    ]
    batch = ForwardBatch.build(chunks, page_size=16, device="cpu")
    assert batch.input_ids.tolist() == [11, 12, 13, 21, 31, 32]
    assert batch.positions.tolist() == [14, 15, 16, 0, 3, 4]
    assert batch.slot_mapping.tolist() == [5 * 16 + 14, 5 * 16 + 15, 2 * 16 + 0, 7 * 16, 4 * 16 + 3, 4 * 16 + 4]
    # sequence 0 uses 2 of its 3 pages; rows are padded with page 0
    assert batch.block_tables.tolist() == [[5, 2], [7, 0], [4, 0]]
    assert batch.cu_seqlens_q.tolist() == [0, 3, 4, 6]
    assert batch.context_lens.tolist() == [17, 1, 5]
    assert batch.logits_idx.tolist() == [0, 1, 2, 5]
    assert (batch.max_q_len, batch.max_context_len, batch.num_tokens, batch.num_seqs) == (3, 17, 6, 3)
    dtypes = [t.dtype for t in (batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables,
                                batch.cu_seqlens_q, batch.context_lens, batch.logits_idx)]
    assert dtypes == [torch.int64] * 3 + [torch.int32] * 3 + [torch.int64]


def test_build_decode_batch() -> None:
    chunks = [SeqChunk([9], pos, [3, 1, 0], "last") for pos in (0, 15, 16, 40)]
    batch = ForwardBatch.build(chunks, page_size=16, device="cpu")
    assert batch.slot_mapping.tolist() == [48, 63, 16, 8]
    assert batch.max_q_len == 1 and batch.logits_idx.tolist() == [0, 1, 2, 3]
    assert batch.block_tables.tolist() == [[3, 0, 0], [3, 0, 0], [3, 1, 0], [3, 1, 0]]


@pytest.mark.parametrize("seed", range(5))
def test_build_matches_a_per_token_reference(seed) -> None:
    """Random mixes of prompt chunks (fresh or continuing), decode rows and logits modes, against the definition
    written out token by token."""
    rng = torch.Generator().manual_seed(seed)

    def randint(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=rng))

    page_size = [1, 4, 16, 256][seed % 4]
    chunks = []
    for _ in range(randint(1, 40)):
        q_len = 1 if randint(0, 3) == 0 else randint(1, 300)
        start = randint(0, 600)
        pages = -(-(start + q_len) // page_size) + randint(0, 3)  # spare pages past the context are allowed
        chunks.append(SeqChunk([randint(0, 50000) for _ in range(q_len)], start,
                               [randint(0, 10**6) for _ in range(pages)], ["all", "last", "none"][randint(0, 3)]))
    batch = ForwardBatch.build(chunks, page_size, "cpu")
    ids, positions, slots, logits_idx, row = [], [], [], [], 0
    for c in chunks:
        for i, token in enumerate(c.token_ids):
            pos = c.start_pos + i
            ids.append(token)
            positions.append(pos)
            slots.append(c.block_table[pos // page_size] * page_size + pos % page_size)
            if c.logits == "all" or (c.logits == "last" and i == len(c.token_ids) - 1):
                logits_idx.append(row)
            row += 1
    context_lens = [c.start_pos + len(c.token_ids) for c in chunks]
    width = max(-(-n // page_size) for n in context_lens)
    tables = [list(c.block_table[: -(-n // page_size)]) for c, n in zip(chunks, context_lens)]
    assert batch.input_ids.tolist() == ids
    assert batch.positions.tolist() == positions
    assert batch.slot_mapping.tolist() == slots
    assert batch.logits_idx.tolist() == logits_idx
    assert batch.block_tables.tolist() == [t + [0] * (width - len(t)) for t in tables]
    assert batch.context_lens.tolist() == context_lens
    cu = [0]
    for c in chunks:
        cu.append(cu[-1] + len(c.token_ids))
    assert batch.cu_seqlens_q.tolist() == cu


@pytest.mark.parametrize("chunks, message", [
    ([], "at least one chunk"),
    ([SeqChunk([], 0, [0])], "chunk 0: no token_ids"),
    ([SeqChunk([1], 0, [0]), SeqChunk([1], -1, [0])], "chunk 1: start_pos=-1 is negative"),
    ([SeqChunk([1], 0, [0], "first")], "chunk 0: logits='first'"),
    ([SeqChunk([1, 2], 15, [0])], "chunk 0: positions up to 16 need 2 pages of 16 but block_table has 1"),
    ([SeqChunk([1, 2], 15, [3, -1])], r"chunk 0: negative page id in block_table \[3, -1\]"),
])
def test_build_errors(chunks, message) -> None:
    with pytest.raises(ValueError, match=message):
        ForwardBatch.build(chunks, page_size=16, device="cpu")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Model:
    return Model.from_pretrained(make_hf_model(tmp_path_factory.mktemp("m"), "qwen3"), progress=False)


def test_cache_shapes(model) -> None:
    cache = Cache(model, num_tokens=96, page_size=32)
    assert cache.k.shape == cache.v.shape == (3, 3, 32, 2, 16)
    assert (cache.num_pages, cache.page_size, cache.num_tokens) == (3, 32, 96)
    assert cache.bytes == 2 * 3 * 3 * 32 * 2 * 16 * 4
    assert cache.k.dtype == model.dtype and cache.k.device == model.device


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(num_tokens=64, page_size=24), ValueError, "page_size=24 must be a power of two >= 16"),
    (dict(num_tokens=64, page_size=8), ValueError, "page_size=8 must be a power of two >= 16"),
    (dict(num_tokens=64, page_size=16.0), TypeError, "page_size must be an int"),
    (dict(num_tokens=40, page_size=16), ValueError, "num_tokens=40 must be a positive multiple of page_size=16"),
    (dict(num_tokens=0, page_size=16), ValueError, "num_tokens=0 must be a positive multiple"),
    (dict(page_size=16), ValueError, "give num_tokens"),
    (dict(max_memory_fraction=0.5), ValueError, "max_memory_fraction needs a CUDA device"),
    (dict(num_tokens=256, max_memory_fraction=0.5), ValueError, "either num_tokens or max_memory_fraction"),
    (dict(num_tokens=256, reserve_bytes=1 << 20), ValueError, "reserve_bytes needs a CUDA device"),
    (dict(num_tokens=256, reserve_bytes=-1), ValueError, "reserve_bytes must be an int >= 0"),
])
def test_cache_errors(model, kwargs, error, message) -> None:
    with pytest.raises(error, match=message):
        Cache(model, **kwargs)


def test_step_activation_bytes_grows_with_the_step_and_is_what_a_generator_reserves(model) -> None:
    from folio import activation_reserve_bytes

    small, large = model.step_activation_bytes(64, 4), model.step_activation_bytes(4096, 4)
    assert 0 < small < large
    assert model.step_activation_bytes(64, 8) > small  # more logit rows, more sampler buffers
    assert model.step_activation_bytes(64, 4, max_context_tokens=64) <= small
    assert model.step_activation_bytes(64, 4, sampling=False) < small
    with pytest.raises(ValueError, match="num_logit_rows <= num_tokens"):
        model.step_activation_bytes(4, 5)
    # a generator's largest eager step: a full chunk (the default 2048, or the given one) plus a decode row per
    # other sequence; no decode graphs on a CPU
    assert activation_reserve_bytes(model, 8, page_size=256) == model.step_activation_bytes(2048 + 8, 8)
    assert activation_reserve_bytes(model, 8, 4096, page_size=256) == model.step_activation_bytes(4096 + 8, 8)
    with pytest.raises(ValueError, match="max_chunk_size must be a positive multiple"):
        activation_reserve_bytes(model, 8, 1000, page_size=256)
    with pytest.raises(ValueError, match="max_batch_size must be an integer"):
        activation_reserve_bytes(model, 0)


def test_cache_copy_page_slots(model) -> None:
    cache = Cache(model, num_tokens=64, page_size=16)
    cache.k.copy_(torch.randn(cache.k.shape))
    cache.v.copy_(torch.randn(cache.v.shape))
    k_before, v_before = cache.k.clone(), cache.v.clone()
    cache.copy_page_slots(src_page=3, dst_page=0, num_slots=5)
    assert torch.equal(cache.k[:, 0, :5], k_before[:, 3, :5]) and torch.equal(cache.v[:, 0, :5], v_before[:, 3, :5])
    assert torch.equal(cache.k[:, 0, 5:], k_before[:, 0, 5:]) and torch.equal(cache.k[:, 1:], k_before[:, 1:])
    with pytest.raises(IndexError, match=r"page 4 outside \[0, num_pages=4\)"):
        cache.copy_page_slots(4, 0, 1)


def test_forward_rejects_a_foreign_cache(model, tmp_path) -> None:
    other = Model.from_pretrained(make_hf_model(tmp_path, "llama", num_key_value_heads=3), progress=False)
    batch = ForwardBatch.build([SeqChunk([1, 2], 0, [0])], 16, "cpu")
    with pytest.raises(ValueError, match="does not fit the model"):
        model.forward(batch, Cache(other, num_tokens=16, page_size=16))
    with pytest.raises(ValueError, match="cache is torch.bfloat16 on cpu, model is torch.float32 on cpu"):
        model.forward(batch, Cache(Model(model.config, model.weights, model.device, torch.bfloat16), 16, 16))


def test_logits_none_only(model) -> None:
    cache = Cache(model, num_tokens=32, page_size=16)
    logits = model.forward(ForwardBatch.build([SeqChunk([1, 2, 3], 0, [1], "none")], 16, "cpu"), cache)
    assert logits.shape == (0, 250) and logits.dtype == torch.float32
    assert cache.k[:, 1, :3].abs().sum() > 0 and (cache.k[:, 0] == 0).all()  # K/V are written regardless
