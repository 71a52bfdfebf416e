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
