"""The router's cost of a replica for one request: its predicted time to first token, in seconds.

    ttft(r) = wait(r) + uncached_prompt_tokens(r) / prefill_rate(r)
    wait(r) = max(0, prefill_busy_until(r) - now)                          prompts ahead of this one
            + max(0, jobs(r) + 1 - max_running(r)) / max_running(r)
              * mean_new_tokens(r) * decode_step_s(r)                      waiting for a batch slot to free
            + jobs(r) / max_running(r) * decode_step_s(r)                   a fuller batch steps slower
    plus, when r lacks the pages for the uncached part, one job's decode time (it waits for pages to free).

Rates come from the replicas' reports (folio.router.rates, measured on their engine steps); a replica that has not
measured one yet gets the median of the fleet's, and only a fleet that has measured nothing uses the defaults. A
replica's own value is weighed against the fleet's median by its count of observations n(r),
    rate(r) = (n(r) x own(r) + RATE_PRIOR_SAMPLES x fleet) / (n(r) + RATE_PRIOR_SAMPLES),
since a replica's first steps measure it poorly (the replicas of one deployment run one model on one kind of
device): two idle replicas whose first prefill steps read 700 and 2,300 tokens/s would otherwise send a request away
from the one holding most of its prompt. After a few dozen steps a replica's own rate decides.
prefill_busy_until is a FIFO model of the replica's prefill work: a report sets it to the report's arrival plus its
backlog at the replica's rate, and each request this router sends there pushes it by that request's uncached
tokens at that rate; it drains as time passes, so work routed half a period ago and prefilled since no longer
counts as waiting (reports are a period old). jobs are the last report's plus what this router sent the replica
since, or fresher counts from the caller (Ray's queue-length cache). One unit, seconds, so no weight needs tuning per
workload: a shared prefix is worth exactly the prefill time it saves, against exactly the wait it costs.

Several routers (one per ingress replica) share a fleet and see the same reports, but each knows only its own
requests between them. Each counts the routers sharing the fleet (num_routers: what the replicas report receiving
against what it sent them, over the last half minute of reports) and weighs a request it routes that many times
until the next report, since the others, seeing what it sees, send as many meanwhile.

Per-replica values live in flat numpy arrays indexed by the index's slots. A decision's pass over every candidate
(each one's wait, and the k that wait least: least_waiting) is one native call where folio's CPU module is built
(folio._native_cpu.CandidateWaits.least: a loop and a selection, where numpy paid its fixed cost on half a dozen
whole-array operations and a partial sort), else the same in numpy.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain

import numpy as np

from folio.router.digest import NUMBER_FIELDS, ReplicaDigest


@dataclass(frozen=True)
class CostDefaults:
    """Rates assumed before any replica of the fleet has measured its own."""

    prefill_tokens_per_s: float = 4096.0
    decode_step_s: float = 0.02
    mean_new_tokens: float = 128.0


# A report's values that _apply_reports writes, in its order: their columns in ReplicaDigest.numbers()
_REPORTED_COLUMNS = [NUMBER_FIELDS.index(name) for name in (
    "num_running", "num_queued", "num_received", "max_running", "prefill_tokens_per_s", "decode_step_s",
    "mean_new_tokens", "num_allocatable_pages", "page_size", "prefill_samples", "decode_samples", "finished_samples")]
_NUMBERS = operator.methodcaller("numbers")

# How many of its own observations a replica's rate needs to weigh as much as the fleet's median (see above).
RATE_PRIOR_SAMPLES = 4.0

# Routers sharing a fleet (one per ingress replica) are counted from the last SHARE_WINDOW_S seconds of reports.
SHARE_WINDOW_S = 30.0
MAX_ROUTERS = 256.0


class LoadTable:
    """Per-slot load and speed. Slots come from folio.router.index.PrefixIndex; times are `clock()` seconds.

    The part of every slot's wait that does not drain with time (`settled`: slot waits and batch size) is kept as
    a vector, recomputed for all slots (vectorised) after reports changed the fleet, at most once per decision, and
    for one slot in Python scalars when this router routes a request there."""

    _FIELDS = ("known", "jobs", "routed_jobs", "routed_load", "received", "busy_until", "max_running",
               "prefill_rate", "decode_step", "new_tokens", "allocatable_pages", "page_size", "eff_prefill", "eff_step",
               "eff_new", "settled", "fit_tokens", "one_job_s", "prefill_samples", "decode_samples", "new_samples")

    def __init__(self, defaults: CostDefaults | None = None, *, clock: Callable[[], float],
                 capacity: int = 64) -> None:
        self.defaults = defaults or CostDefaults()
        self._clock = clock
        for name in self._FIELDS:
            setattr(self, name, np.zeros(capacity))
        self._stale = True  # reports changed something since `settled` and the effective rates were computed
        self._reported_backlog: dict[int, tuple[float, int]] = {}  # slot -> (report time, prefill tokens)
        # Reports not yet written into the arrays: a router receives every replica's report each period, and one
        # vectorised write of them all, at the next decision, costs less than numpy scalar writes per report.
        self._pending: dict[int, ReplicaDigest] = {}
        # Decaying sums over the fleet's reports: requests this router sent, and requests the replicas received.
        self._own_sent = self._all_received = 0.0
        self._sums_at = clock()
        self._num_routers = 1.0  # routers sharing the fleet, as estimated from those sums

    def ensure(self, slot: int) -> None:
        size = len(self.known)
        if slot < size:
            return
        new_size = max(slot + 1, 2 * size)
        for name in self._FIELDS:
            grown = np.zeros(new_size)
            grown[:size] = getattr(self, name)
            setattr(self, name, grown)
        self._stale = True

    def clear(self, slot: int) -> None:
        self.ensure(slot)
        for name in self._FIELDS:
            getattr(self, name)[slot] = 0.0
        self._reported_backlog.pop(slot, None)
        self._pending.pop(slot, None)
        self._stale = True

    @property
    def num_routers(self) -> float:
        """Routers sharing the fleet, as counted from the reports so far (see the module docstring)."""
        if self._pending:
            self._apply_reports()
        return self._num_routers

    def set_report(self, slot: int, digest: ReplicaDigest) -> None:
        """The replica's latest report; it takes effect at the next query (a later report of the same slot before
        then replaces it: counts are cumulative, and this router routes nothing in between without a query)."""
        self._pending[slot] = digest
        self._reported_backlog[slot] = (self._clock(), digest.num_prefill_tokens)
        self._stale = True

    def _apply_reports(self) -> None:
        pending, self._pending = self._pending, {}
        self.ensure(max(pending))
        slots = np.fromiter(pending, dtype=np.intp, count=len(pending))
        # (the reports' numbers packed already: converting a dozen Python numbers per report cost more than the rest)
        numbers = np.frombuffer(b"".join(map(_NUMBERS, pending.values())), dtype=np.float64)
        (running, queued, received, max_running, prefill_rate, decode_step, new_tokens, allocatable, page_size,
         prefill_samples, decode_samples, new_samples) = numbers.reshape(len(pending), -1)[:, _REPORTED_COLUMNS].T
        jobs = running + queued  # (exact: counts below 2**53)
        # what the replicas received since their last reports, against what this router sent them meanwhile
        # (a restarted replica's count starts again: its first report is not compared)
        compared = (self.known[slots] > 0) & (received >= self.received[slots])
        if compared.any():
            self._count_share(float(self.routed_jobs[slots][compared].sum()),
                              float((received - self.received[slots])[compared].sum()))
        self.known[slots] = 1.0
        self.jobs[slots] = jobs
        self.received[slots] = received
        self.routed_jobs[slots] = self.routed_load[slots] = 0.0
        self.max_running[slots] = max_running
        self.prefill_rate[slots] = prefill_rate
        self.decode_step[slots] = decode_step
        self.new_tokens[slots] = new_tokens
        self.allocatable_pages[slots] = allocatable
        self.page_size[slots] = page_size
        self.prefill_samples[slots] = prefill_samples
        self.decode_samples[slots] = decode_samples
        self.new_samples[slots] = new_samples

    def _count_share(self, own_sent: float, received: float) -> None:
        now = self._clock()
        decay = math.exp(-(now - self._sums_at) / SHARE_WINDOW_S)
        self._own_sent = self._own_sent * decay + own_sent
        self._all_received = self._all_received * decay + received
        self._sums_at = now
        if self._own_sent >= 1.0:
            self._num_routers = min(max(self._all_received / self._own_sent, 1.0), MAX_ROUTERS)

    def add_routed(self, slot: int, num_prefill_tokens: int) -> None:
        """This router sent the replica a request with about num_prefill_tokens to prefill. Until the next report
        it counts num_routers times: routers that share the fleet and see the same reports make the same choices
        in expectation, so while this one sends a request to the replica, the others send as many."""
        self.ensure(slot)
        self.refresh()
        # (Python floats through .item(): numpy scalar arithmetic costs several times more, once per request)
        routers = self._num_routers
        self.routed_jobs[slot] = self.routed_jobs.item(slot) + 1.0
        routed_load = self.routed_load[slot] = self.routed_load.item(slot) + routers
        self.busy_until[slot] = max(self.busy_until.item(slot), self._clock()) + routers * num_prefill_tokens / (
            self.eff_prefill.item(slot))
        self.settled[slot] = self._settled_one(slot, self.jobs.item(slot) + routed_load)

    def refresh(self) -> None:
        """Recompute the effective rates (the fleet's median where a replica measured none; the defaults where no
        replica did) and every slot's settled wait, if reports changed anything."""
        if not self._stale:
            return
        if self._pending:
            self._apply_reports()
        known = self.known > 0
        for values, samples, default, target in (
                (self.prefill_rate, self.prefill_samples, self.defaults.prefill_tokens_per_s, self.eff_prefill),
                (self.decode_step, self.decode_samples, self.defaults.decode_step_s, self.eff_step),
                (self.new_tokens, self.new_samples, self.defaults.mean_new_tokens, self.eff_new)):
            measured = values[known & (values > 0)]
            fleet = _median(measured) if len(measured) else default
            own_weight = samples / (samples + RATE_PRIOR_SAMPLES)
            target[:] = np.where(values > 0, own_weight * values + (1.0 - own_weight) * fleet, fleet)
        if self._reported_backlog:
            backlog = self._reported_backlog
            slots = np.fromiter(backlog, dtype=np.intp, count=len(backlog))
            reported_at, tokens = np.fromiter(chain.from_iterable(backlog.values()), dtype=np.float64,
                                              count=2 * len(backlog)).reshape(len(backlog), 2).T
            self.busy_until[slots] = reported_at + tokens / self.eff_prefill[slots]
            backlog.clear()
        self.settled[:] = self._settled(slice(None), self.jobs + self.routed_load)
        # A slot lacks the pages for u uncached tokens when ceil(u / page_size) + 1 > its allocatable pages, that is
        # when u > (allocatable - 1) x page_size (pages are whole); then it waits for one job to finish.
        self.fit_tokens[:] = np.where(self.known > 0, (self.allocatable_pages - 1.0) * np.maximum(self.page_size, 1.0),
                                      np.inf)
        self.one_job_s[:] = self.eff_new * self.eff_step
        self._stale = False

    def _settled_one(self, slot: int, jobs: float) -> float:
        """_settled for one slot, in Python floats (numpy scalar arithmetic costs several times more)."""
        max_running = max(self.max_running.item(slot), 1.0)
        step = self.eff_step.item(slot)
        slot_wait = max(jobs + 1.0 - max_running, 0.0) / max_running * self.eff_new.item(slot) * step
        return slot_wait + jobs / max_running * step

    def _settled(self, slots, jobs: np.ndarray) -> np.ndarray:
        max_running = np.maximum(self.max_running[slots], 1.0)
        step = self.eff_step[slots]
        slot_wait = np.maximum(jobs + 1.0 - max_running, 0.0) / max_running * self.eff_new[slots] * step
        return slot_wait + jobs / max_running * step

    def waits(self, rows: np.ndarray | slice, uncached_tokens: float) -> tuple[np.ndarray, np.ndarray]:
        """Per slot of `rows` (slot numbers, or a slice of them): the predicted seconds before a new request's own
        prefill could start, and that plus the wait for a job to finish and free pages where the slot lacks the
        pages for uncached_tokens (what a request sharing nothing would wait; see terms)."""
        self.refresh()
        wait = self.busy_until[rows] - self._clock()
        np.maximum(wait, 0.0, out=wait)
        wait += self.settled[rows]
        unshared = self.one_job_s[rows] * (uncached_tokens > self.fit_tokens[rows])
        unshared += wait
        return wait, unshared

    def least_waiting(self, rows: np.ndarray | slice, num_candidates: int, uncached_tokens: float, k: int,
                      native: bool = True) -> tuple[np.ndarray, list[int]]:
        """waits(rows, uncached_tokens)'s first vector (`wait`, one per candidate), and the positions of the k
        candidates whose unshared waits are least, in increasing order of (unshared wait, position). rows: the
        candidates' slots, or slice(0, num_candidates) where they are the first slots in order. native=False: the
        numpy path (the native one's oracle in the tests)."""
        scan = _native_scan() if native else None
        if scan is None:
            wait, unshared = self.waits(rows, uncached_tokens)
            return wait, np.argsort(unshared, kind="stable")[:k].tolist()
        self.refresh()
        if isinstance(rows, slice):
            assert rows.start in (0, None) and rows.stop == num_candidates and rows.step in (1, None), rows
        wait = np.empty(num_candidates)
        least = scan(self.busy_until, self.settled, self.one_job_s, self.fit_tokens,
                     None if isinstance(rows, slice) else rows, self._clock(), float(uncached_tokens), k, wait)
        return wait, least

    def wait_with_jobs(self, slot: int, jobs: float) -> float:
        """waits() of one slot with a current job count (e.g. Ray's queue-length cache) in place of the reports'
        plus what was routed since."""
        self.refresh()
        return max(self.busy_until.item(slot) - self._clock(), 0.0) + self._settled_one(slot, jobs)

    def terms(self, slot: int) -> tuple[float, float, float, float]:
        """The slot's (prefill tokens/s, seconds of prefill queued now, uncached tokens it has the pages for, one
        job's decode seconds): a request of u uncached tokens takes u / rate to prefill there, plus the decode
        seconds when u > the tokens it has pages for (it waits for a job to finish and free some)."""
        self.refresh()
        return (self.eff_prefill.item(slot), max(self.busy_until.item(slot) - self._clock(), 0.0),
                self.fit_tokens.item(slot), self.one_job_s.item(slot))


@functools.cache
def _native_scan() -> Callable | None:
    """folio._native_cpu.CandidateWaits.least, or None where the CPU module is not built (imported here, on first
    use: the router's modules import neither torch nor compiled code until they need it)."""
    from folio.ops import native_candidate_waits

    return native_candidate_waits()


def _median(values: np.ndarray) -> float:
    """float(np.median(values)) of a non-empty vector, the same value (the mean of the two middle ones for an even
    count) without np.median's fixed cost, which refresh pays three times after every period's reports."""
    low, high = (len(values) - 1) // 2, len(values) // 2
    part = np.partition(values, (low, high))
    return part.item(high) if low == high else (part.item(low) + part.item(high)) / 2
