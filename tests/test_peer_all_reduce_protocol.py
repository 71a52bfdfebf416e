"""The protocol of native/cuda/peer_all_reduce.cu, modelled step by step on the CPU and run under every kind of
interleaving hypothesis can find: ranks run their calls in stream order, the blocks of one call in any order and at
any relative speed. The model is the kernel's algorithm, written again in Python (one thread a block, the same
grid-stride partition, the same flag words, call counts and two slots). What it checks:

- every value a block reads from a rank's slot is that rank's input of the same call (no rank overwrote it with a
  later call's input first: the reason for the two slots);
- the sums are right, and the same on every rank;
- nothing waits for ever (some block can always move until every call is done).

The GPU test (test_peer_all_reduce_gpu.py) runs the kernel itself, but only under the interleavings the hardware
happens to produce. Here, broken variants (one slot; signalling before copying) are caught, which shows the checks
can fail; and the kernel's counting of calls by blocks past the message turns out not to be needed for safety."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

BLOCKS = 3  # the kernel's grid (kPeerBlocks), small enough for the search to reach every block's corner cases


@dataclass
class Rank:
    rank: int
    slots: list[dict[int, tuple]] = field(default_factory=lambda: [{}, {}])  # slot -> index -> (rank, call, index)
    flags: dict[tuple[int, int], int] = field(default_factory=dict)  # (block, peer) -> the peer's call number
    counts: list[int] = field(default_factory=lambda: [0] * BLOCKS)
    call: int = 0  # index of the call this rank's stream runs now
    blocks: dict[int, Block] = field(default_factory=dict)  # the running call's blocks


@dataclass
class Block:
    index: int
    state: str = "start"
    number: int = 0  # the call's number, from this block's count
    sums: dict[int, int] = field(default_factory=dict)


class Protocol:
    """world ranks making the same calls (lengths in vectors); variant names a broken rule to check it is caught."""

    def __init__(self, world: int, lengths: list[int], variant: str = "kernel") -> None:
        self.world, self.lengths, self.variant = world, lengths, variant
        self.ranks = [Rank(r) for r in range(world)]
        self.results: dict[tuple[int, int], dict[int, int]] = {}  # (rank, call) -> index -> sum
        for r in self.ranks:
            self._start_call(r)

    @staticmethod
    def value(rank: int, call: int, index: int) -> int:
        return 1000 * rank + 10 * call + index % 7 + 1

    def _start_call(self, r: Rank) -> None:
        r.blocks = {b: Block(b) for b in range(BLOCKS)} if r.call < len(self.lengths) else {}

    def _partition(self, block: int, n: int) -> range:
        return range(block, n, BLOCKS)  # grid stride, one thread a block

    def _slot(self, number: int) -> int:
        return 0 if self.variant == "one_slot" else number & 1

    def enabled(self) -> list[tuple[int, int]]:
        """(rank, block) pairs that can take their next step."""
        moves = []
        for r in self.ranks:
            for b, blk in r.blocks.items():
                if blk.state == "wait" and not all(r.flags.get((b, p), 0) >= blk.number
                                                   for p in range(self.world) if p != r.rank):
                    continue
                if blk.state != "done":
                    moves.append((r.rank, b))
        return moves

    def step(self, rank: int, b: int) -> None:
        r = self.ranks[rank]
        blk = r.blocks[b]
        n = self.lengths[r.call]
        has_work = b < n
        if blk.state == "start":
            blk.number = r.counts[b] + 1
            if not has_work:
                if self.variant != "idle_blocks_skip_count":
                    r.counts[b] = blk.number
                blk.state = "done"
            else:
                blk.state = "copy"
        elif blk.state == "copy":
            if self.variant == "signal_before_copy":
                self._signal(rank, b, blk.number)
                blk.state = "late_copy"
                return
            self._copy(r, b, n, blk.number)
            self._signal(rank, b, blk.number)
            blk.state = "wait"
        elif blk.state == "late_copy":
            self._copy(r, b, n, blk.number)
            blk.state = "wait"
        elif blk.state == "wait":  # (enabled only once every peer's flag word holds this call's number)
            for i in self._partition(b, n):
                total = 0
                for p in range(self.world):
                    got = self.ranks[p].slots[self._slot(blk.number)].get(i)
                    assert got == (p, r.call, i), (f"rank {rank} block {b} call {r.call}: read {got} from rank {p}'s "
                                                   f"slot at {i}, expected its input of this call")
                    total += self.value(p, r.call, i)
                blk.sums[i] = total
            r.counts[b] = blk.number
            blk.state = "done"
        if all(x.state == "done" for x in r.blocks.values()):  # the call ends: the stream starts the next
            self.results[(rank, r.call)] = {i: s for x in r.blocks.values() for i, s in x.sums.items()}
            r.call += 1
            self._start_call(r)

    def _copy(self, r: Rank, b: int, n: int, number: int) -> None:
        slot = r.slots[self._slot(number)]
        for i in self._partition(b, n):
            slot[i] = (r.rank, r.call, i)

    def _signal(self, rank: int, b: int, number: int) -> None:
        for p in range(self.world):  # release stores into every peer's flag word [b][rank]
            if p != rank:
                self.ranks[p].flags[(b, rank)] = number

    def run(self, choose) -> None:
        while True:
            moves = self.enabled()
            if not moves:
                break
            self.step(*moves[choose(len(moves))])
        assert all(r.call == len(self.lengths) for r in self.ranks), "a call waits for ever"
        for call, n in enumerate(self.lengths):
            want = {i: sum(self.value(p, call, i) for p in range(self.world)) for i in range(n)}
            for r in range(self.world):
                assert self.results[(r, call)] == want


# call lengths in vectors: 1 (one block works), BLOCKS - 1, BLOCKS and more (every block, several passes)
LENGTHS = st.lists(st.integers(1, 2 * BLOCKS + 1), min_size=1, max_size=8)


@settings(max_examples=400, deadline=None)
@given(world=st.integers(2, 3), lengths=LENGTHS, data=st.data())
def test_every_interleaving_reads_the_right_call_and_sums_right(world, lengths, data):
    def choose(n: int) -> int:
        return data.draw(st.integers(0, n - 1))

    Protocol(world, lengths).run(choose)


@settings(max_examples=200, deadline=None)
@given(world=st.integers(2, 3), lengths=LENGTHS, data=st.data())
def test_blocks_past_the_message_need_not_count_the_call(world, lengths, data):
    """The kernel's blocks past the message count the call anyway, but safety does not rest on it: a block's vectors
    are the same whatever the length (grid stride over a fixed grid), so a block's slot only follows its own calls."""
    Protocol(world, lengths, "idle_blocks_skip_count").run(lambda n: data.draw(st.integers(0, n - 1)))


@pytest.mark.parametrize("variant", ["one_slot", "signal_before_copy"])
def test_the_rules_the_kernel_relies_on_are_needed(variant):
    """Each broken variant is caught: rank 0 runs ahead whenever it can; rank 1 starts and copies its blocks before
    it lets any of them read."""
    protocol = Protocol(2, [BLOCKS, BLOCKS, BLOCKS], variant)

    def rank_0_ahead(n: int) -> int:
        moves = protocol.enabled()
        fast = [k for k, (rank, _) in enumerate(moves) if rank == 0]
        if fast:
            return fast[0]
        not_reading = [k for k, (rank, b) in enumerate(moves) if protocol.ranks[rank].blocks[b].state != "wait"]
        return not_reading[0] if not_reading else 0

    with pytest.raises(AssertionError, match="expected its input of this call"):
        protocol.run(rank_0_ahead)
