"""The decode graphs' input buffer (folio.model.decode_graphs._InputRegion): every input of rows [0, b) lies in one
prefix of one buffer, which is what lets a step copy its inputs from the host in one copy and a tensor-parallel rank 0
broadcast them in one message. Checked by copying prefixes between two regions, as the host and device sides do."""

from __future__ import annotations

import pytest
import torch

from folio.model.decode_graphs import _InputRegion

ROWS, MAX_BLOCKS = 9, 5  # (a table row of 20 bytes: prefixes end inside a row, rounded to whole 16-byte vectors)


def _filled(seed: int) -> _InputRegion:
    region = _InputRegion(ROWS, MAX_BLOCKS, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    region.ids.copy_(torch.randint(-5, 10**6, region.ids.shape, generator=gen))
    region.lens.copy_(torch.randint(1, 10**4, region.lens.shape, generator=gen, dtype=torch.int32))
    region.tables.copy_(torch.randint(0, 10**4, region.tables.shape, generator=gen, dtype=torch.int32))
    return region


def test_a_new_region_writes_nowhere_and_reads_one_slot():
    region = _InputRegion(ROWS, MAX_BLOCKS, torch.device("cpu"))
    assert region.ids.shape == (4, ROWS) and region.ids.dtype == torch.int64
    assert region.tables.shape == (ROWS, MAX_BLOCKS) and region.tables.dtype == torch.int32
    assert (region.ids[:2] == 0).all() and (region.ids[2:] == -1).all()  # cache slots and LoRA slots: -1
    assert (region.lens == 1).all() and (region.tables == 0).all()
    assert region.bytes.numel() % 16 == 0


def test_the_inputs_do_not_overlap():
    region = _filled(1)
    before = [region.ids.clone(), region.lens.clone(), region.tables.clone()]
    region.lens.fill_(-7)
    assert torch.equal(region.ids, before[0]) and torch.equal(region.tables, before[2])
    region.tables.fill_(-9)
    region.ids.fill_(-11)
    assert (region.lens == -7).all() and (region.tables == -9).all()


@pytest.mark.parametrize("rows", range(1, ROWS + 1))
def test_a_prefix_carries_every_input_of_its_rows(rows):
    source, target = _filled(rows), _InputRegion(ROWS, MAX_BLOCKS, torch.device("cpu"))
    prefix = source.prefix(rows)
    assert prefix.numel() % 16 == 0 and prefix.data_ptr() == source.bytes.data_ptr()
    assert prefix.numel() <= source.bytes.numel()
    target.prefix(rows).copy_(prefix)
    assert torch.equal(target.ids[:, :rows], source.ids[:, :rows])
    assert torch.equal(target.lens[:rows], source.lens[:rows])
    assert torch.equal(target.tables[:rows], source.tables[:rows])
    if rows + 1 < ROWS:  # a prefix stops within the next table row: the rows after it are not sent
        assert (target.tables[rows + 1:] == 0).all()


class _Recorder:
    """Stands in for DecodeGraphs in ModelRunner._replay: records what a replay would be given."""

    lora_slots = None

    def run(self, ids, positions, tables, row_slots=None):
        self.got = (ids.tolist() if isinstance(ids, torch.Tensor) else list(ids), list(positions),
                    [list(t) for t in tables], row_slots)
        return torch.zeros(len(positions), 4)


@pytest.mark.parametrize("num_fed, verify", [(0, False), (2, False), (3, False), (0, True), (1, True)])
def test_a_replay_gets_each_row_s_ids_positions_and_tables(num_fed, verify):
    """ModelRunner._replay packs decode rows (one token each) and verify rows (n tokens: n one-token rows over the
    same table) as the per-row loop it replaced did (the oracle here); rows fed from the device come first."""
    from folio.runner import ModelRunner
    from folio.scheduler import Chunk
    from folio.sequence import Sequence

    class Job:
        prompt_tokens, cfg_negative_ids = 3, ()

    seqs = [Sequence(job=Job(), token_ids=[10 * k + j for j in range(6 + k)], block_table=[k, 7 + k]) for k in range(3)]
    rows = [Chunk(s, len(s.token_ids) - 1, len(s.token_ids)) for s in seqs]
    if verify:  # the last row drafts three tokens
        rows[2] = Chunk(seqs[2], len(seqs[2].token_ids) - 1, len(seqs[2].token_ids), verify=True, drafts=(1, 2, 3))
    fed = torch.arange(100, 100 + num_fed) if num_fed else None
    runner = object.__new__(ModelRunner)
    runner.graphs = _Recorder()
    ModelRunner._replay(runner, rows, fed, num_fed, None)
    known, positions, tables = [], [], []
    for k, c in enumerate(rows):
        if k >= num_fed:
            known.extend(c.token_ids)
        positions.extend(range(c.start, c.stop))
        tables.extend([c.seq.block_table] * c.num_tokens)
    assert runner.graphs.got == (list(range(100, 100 + num_fed)) + known, positions, tables, None)
