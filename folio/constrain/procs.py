"""MaskProcesses: grammar masks of large batches made by worker processes.

llguidance does not scale over threads of one process: at 64 rows of bench/constrained.py's schema over a
131,072-token vocabulary, threads that share nothing llguidance knows of (a tokenizer and a compiled grammar of
their own each) took as long as one thread, while worker processes did scale (bench/grammar_threads.py, an H200's
16 host CPUs: 5.7 ms a step on one thread, 3.0 ms over 8 processes, 2.4 over 12). In bench/constrained.py (batch
64, 8B shape, same host) the masks took 2.8 ms a step over 8 processes and 2.9-3.0 over 12, against 5.5-5.9 in
process; the ratio to plain decoding went from 0.72-0.79 to 0.91-0.95 (bench/RESULTS.md, constrained decoding).

Each worker process (`serve` in a fresh interpreter; no torch) builds the vocabulary's LLTokenizer once and keeps a
shadow matcher for each row it was given. The filters' own matchers stay authoritative (feed, rollback, is_finished
work on them as before); a fill sends each worker, per row, how many tokens to roll back and the tokens fed since
the last fill (all of them again after a bind or reset: `GrammarFilterBase._epoch`), the worker brings its shadows
there and writes their masks into shared memory, and the masks are copied into the caller's bitmask. A shadow that
refuses a token (it should not: the filter took the same tokens) is dropped and its row left for the caller to fill
in process.

A worker that exits or does not answer (STEP_TIMEOUT_S) raises MaskProcessError: the pool is then closed for good
and `grammar.fill_bitmasks` goes back to making every mask in process. The pool starts on a background thread the
first time a fill has MIN_ROWS grammar rows of one vocabulary; fills go in process until its workers are ready.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import mmap
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import OrderedDict
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from folio.constrain.base import bitmask_words

# Worker processes a vocabulary's pool starts: none where this process may run on fewer than 8 CPUs (the step's own
# threads need them; the CPUs it may run on, not the host's: a replica pinned to a share of a large host counts its
# share).
_CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
PROCESSES = min(8, _CPUS - 4) if _CPUS >= 8 else 0
MIN_ROWS = 16  # grammar rows of one vocabulary in one fill before the processes are used (fewer: in process)
MAX_ROWS = 512  # rows of the shared bitmask (a fill with more goes in process)
START_TIMEOUT_S = 300.0
STEP_TIMEOUT_S = 60.0
WORKER_GRAMMARS = 64  # compiled grammars a worker keeps

logger = logging.getLogger(__name__)


# (the parent's import path follows its two descriptors on the command line: the worker imports folio as it does)
_WORKER = ("import sys; sys.path[:0] = sys.argv[3:]; from folio.constrain.procs import serve; "
           "serve(int(sys.argv[1]), int(sys.argv[2]))")


class MaskProcessError(RuntimeError):
    """A mask worker process exited, did not answer, or could not start."""


class MaskProcesses:
    """Worker processes making the masks of one vocabulary's grammar filters (see the module docstring)."""

    def __init__(self, init: dict[str, Any], num_workers: int, max_rows: int = MAX_ROWS):
        self.num_workers = num_workers
        self.max_rows = max_rows
        self.words = bitmask_words(init["vocab_size"])
        self._file = tempfile.TemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        self._file.truncate(max_rows * self.words * 4)
        self._map = mmap.mmap(self._file.fileno(), max_rows * self.words * 4)
        self.shared = np.ndarray((max_rows, self.words), dtype=np.int32, buffer=self._map)
        self._init = init
        self._conns: list[Connection] = []
        self.procs: list[subprocess.Popen] = []
        self._load = [0] * num_workers
        self._slots = itertools.count()
        self._dropped: list[list[int]] = [[] for _ in range(num_workers)]
        self._lock = threading.Lock()  # one fill at a time
        self._drop_lock = threading.RLock()  # (a finalizer may run inside a fill, on its thread)
        self.ready = threading.Event()
        self.error: str | None = None

    def start(self) -> None:
        """Start the workers and wait until each has built its tokenizer (raises MaskProcessError)."""
        try:
            for _ in range(self.num_workers):
                ours, theirs = socket.socketpair()
                fds = (theirs.fileno(), self._file.fileno())
                path = [p for p in sys.path if p]
                self.procs.append(subprocess.Popen([sys.executable, "-c", _WORKER, *map(str, fds), *path],
                                                   pass_fds=fds, stdin=subprocess.DEVNULL))
                theirs.close()
                self._conns.append(Connection(ours.detach()))
            for w in range(self.num_workers):
                self._send(w, {**self._init, "max_rows": self.max_rows})
            deadline = time.monotonic() + START_TIMEOUT_S
            for w in range(self.num_workers):
                if self._recv(w, deadline) != "ready":
                    raise MaskProcessError(f"grammar mask worker {w} did not start")
            self.ready.set()
        except BaseException as e:
            self._fail(f"grammar mask workers did not start: {e}")
            raise

    def fill(self, items: list[tuple[Any, int]], bitmask: np.ndarray) -> list[int]:
        """Fill bitmask[row] for each (grammar filter, row) of items (at most max_rows); the rows left unfilled
        (their shadow refused a token: fill them in process)."""
        if len(items) > self.max_rows:
            raise ValueError(f"{len(items)} rows for a pool of {self.max_rows}")
        with self._lock:
            if self.error is not None:
                raise MaskProcessError(self.error)
            ops: list[list[tuple]] = [[] for _ in range(self.num_workers)]
            slot_of: dict[int, Any] = {}
            for j, (f, _row) in enumerate(items):
                shadow = f._shadow
                if shadow is None or shadow[0] is not self:
                    w = min(range(self.num_workers), key=self._load.__getitem__)
                    slot = next(self._slots)
                    self._load[w] += 1
                    weakref.finalize(f, self._drop, w, slot)
                    shadow = f._shadow = [self, w, slot, None, 0]
                _, w, slot, epoch, sent = shadow
                fed = f._fed
                if epoch != f._epoch:  # new, bound again or reset: built again from the start
                    ops[w].append((slot, j, f._grammar, 0, fed[:]))
                else:  # rolled back to the fewest tokens since the last sync, then fed
                    kept = min(sent, f._low)
                    ops[w].append((slot, j, None, sent - kept, fed[kept:]))
                shadow[3], shadow[4] = f._epoch, len(fed)
                f._low = len(fed)
                slot_of[slot] = f
            failed: list[int] = []
            try:
                busy = [w for w in range(self.num_workers) if ops[w] or self._dropped[w]]
                for w in busy:
                    with self._drop_lock:
                        dropped, self._dropped[w] = self._dropped[w], []
                    self._send(w, (ops[w], dropped))
                deadline = time.monotonic() + STEP_TIMEOUT_S
                for w in busy:
                    for slot, j in self._recv(w, deadline):
                        slot_of[slot]._shadow = None
                        failed.append(j)
            except (OSError, ValueError, MaskProcessError) as e:
                self._fail(str(e) if isinstance(e, MaskProcessError) else f"grammar mask workers: {e}")
                raise MaskProcessError(self.error) from e
            refused = set(failed)
            done = [j for j in range(len(items)) if j not in refused]
            bitmask[[items[j][1] for j in done]] = self.shared[done]
            return [items[j][1] for j in failed]

    def _drop(self, w: int, slot: int) -> None:
        """(a filter was collected) Its shadow goes with the worker's next message."""
        with self._drop_lock:
            self._dropped[w].append(slot)
            self._load[w] -= 1

    def _send(self, w: int, message: Any) -> None:
        try:
            self._conns[w].send(message)
        except OSError as e:
            proc = self.procs[w]
            code = _exit_code(proc)
            raise MaskProcessError(f"grammar mask worker {w} (pid {proc.pid}) exited"
                                   + (f" with code {code}" if code is not None else f": {e}")) from e

    def _recv(self, w: int, deadline: float) -> Any:
        conn, proc = self._conns[w], self.procs[w]
        while not conn.poll(0.2):
            if proc.poll() is not None:
                raise MaskProcessError(f"grammar mask worker {w} (pid {proc.pid}) exited with code {proc.returncode}")
            if time.monotonic() > deadline:
                raise MaskProcessError(f"grammar mask worker {w} (pid {proc.pid}) gave no answer in time")
        try:
            return conn.recv()
        except (EOFError, OSError) as e:
            code = _exit_code(proc)
            raise MaskProcessError(f"grammar mask worker {w} (pid {proc.pid}) exited"
                                   + (f" with code {code}" if code is not None else f": {e!r}")) from e

    def _fail(self, message: str) -> None:
        self.error = message
        self.close()

    def close(self) -> None:
        """Stop the workers (those that do not stop within a second are killed)."""
        for conn in self._conns:
            with contextlib.suppress(OSError):  # a worker already gone: the wait below reaps it
                conn.send(None)
        for proc in self.procs:
            try:
                proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self._conns:
            conn.close()
        self._conns = []
        self.procs = []
        if self.error is None:
            self.error = "closed"


_pools: list[MaskProcesses] = []


def start_pool(init: dict[str, Any], num_workers: int) -> MaskProcesses:
    """A pool for one vocabulary, started on a background thread (`ready` is set once it can fill)."""
    pool = MaskProcesses(init, num_workers)
    _pools.append(pool)
    threading.Thread(target=_start_quietly, args=(pool,), name="folio-mask-procs", daemon=True).start()
    return pool


def _start_quietly(pool: MaskProcesses) -> None:
    try:
        pool.start()
    except BaseException:  # noqa: BLE001 - fills stay in process
        logger.warning("grammar masks stay in process: %s", pool.error)


@atexit.register
def _close_all() -> None:
    for pool in _pools:
        pool.close()


# ------------------------------------------------------------------------------------------------ worker side


class _Tokens:
    """What llguidance.LLTokenizer reads in a worker (folio.constrain.grammar._TokenizerWrapper's data)."""

    is_tokenizer_wrapper = True

    def __init__(self, init: dict[str, Any]):
        self.tokens = init["tokens"]
        self.special_token_ids = init["special"]
        self.eos_token_id = init["eos"][0] if init["eos"] else None
        self.bos_token_id = init["bos"]
        self._json = init["tokenizer_json"]
        self._hf: Any = None

    def __call__(self, text: str) -> list[int]:
        if self._hf is None:
            from tokenizers import Tokenizer as HFTokenizer

            self._hf = HFTokenizer.from_str(self._json)
            self._hf.encode_special_tokens = True  # (special-token text reads as plain text: folio's encode)
        return self._hf.encode(text, add_special_tokens=False).ids


def serve(conn_fd: int, shm_fd: int) -> None:
    """A worker process's loop: its end of the socket, the shared bitmask's file."""
    import llguidance
    import llguidance.numpy as llnp

    conn = Connection(conn_fd)
    init = conn.recv()
    lltok = llguidance.LLTokenizer(_Tokens(init), n_vocab=init["vocab_size"], eos_token=init["eos"] or None,
                                   slices=init["slices"])
    rows, words = init["max_rows"], bitmask_words(init["vocab_size"])
    shared = np.ndarray((rows, words), dtype=np.int32, buffer=mmap.mmap(shm_fd, rows * words * 4))
    executor = llguidance.LLExecutor(num_threads=1)
    templates: OrderedDict[str, Any] = OrderedDict()
    matchers: dict[int, Any] = {}
    conn.send("ready")
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        ops, dropped = message
        for slot in dropped:
            matchers.pop(slot, None)
        pairs, failed = [], []
        for slot, row, grammar, back, tokens in ops:
            try:
                if grammar is not None:
                    template = templates.get(grammar)
                    if template is None:
                        template = templates[grammar] = llguidance.LLMatcher(lltok, grammar, log_level=0)
                        while len(templates) > WORKER_GRAMMARS:
                            templates.popitem(last=False)
                    templates.move_to_end(grammar)
                    matchers[slot] = template.deep_copy()
                matcher = matchers[slot]
                if back and not matcher.rollback(back):
                    raise ValueError(matcher.get_error())
                if tokens and matcher.try_consume_tokens(tokens) != len(tokens):
                    raise ValueError(matcher.get_error())
                pairs.append((matcher, row))
            except Exception:  # noqa: BLE001 - the caller makes this row in process
                matchers.pop(slot, None)
                failed.append((slot, row))
        if pairs:
            llnp.fill_next_token_bitmask_par(executor, pairs, shared)
        try:
            conn.send(failed)
        except OSError:  # the pool's process went
            return


def _exit_code(proc: subprocess.Popen) -> int | None:
    """The exit code of a worker whose end of the pipe closed; None if it is still running a second later. (Its pipe
    closes as it exits, a moment before the exit status can be read: poll() alone may still say it runs.)"""
    try:
        return proc.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        return None
