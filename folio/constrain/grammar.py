"""Grammar filters on llguidance: JSON schema, regex, Lark/GBNF grammar and fixed choices.

Engine choice (bench/grammar_libraries.py; see bench/RESULTS.md "Grammar engine choice"):

CPU: Intel(R) Xeon(R) Processor (cloud VM, model not exposed), 2 cores; vocabulary: tekken_240911 (131,072 ids);
batch: 64 matchers over 1,260 tokens of valid JSON for the 20 schemas of tests/json_schemas.py.

| library | vocab setup | compile+1st mask med/max | mask single mean/p99 | batch-64 mean/p99 | 20 schemas | features |
|---|---:|---:|---:|---:|---:|---:|
| **llguidance 1.9.1** | 681 ms | **1.0 / 6.1 ms** | **151 / 4,165 us** | **133 / 538 us** | 19/20* | 15/25 |
| xgrammar 0.2.8 | 148 ms | 1.9 / 314 ms | 401 / 16,600 us | 327 / 1,199 us | 18/20 | 17/25 |

Chosen: llguidance. 2.5-2.7x faster masks (mean and batched), 4x lower single-call p99, no 300 ms compiles; it
refuses the keywords it does not implement (uniqueItems, if/then/else, not, dependentRequired: "Unimplemented
keys") where xgrammar let through documents that violate the schema (a bad date/uuid/ipv4 format, allOf,
if/then/else: its "ok" on uniqueItems, not, dependentRequired may be a keyword ignored in walks that happened to
pass) and rejected valid JSON that llguidance produced (-0, a bounded number, a string with \"). xgrammar also
needs torch/triton/transformers as declared dependencies (it ran here with --no-deps plus apache-tvm-ffi).
Batch-64 is per token, 2 threads (LLExecutor / BatchGrammarMatcher). *The one schema short for both libraries
(additional_properties_typed) had walks that hit the cap unfinished, none invalid: a random-walk issue since fixed
in tests/json_schemas.random_walk (tests/test_filters.py: 200/200 valid); the bench was not rerun after the fix.

Each filter compiles to an llguidance grammar and drives one `LLMatcher`:
- The tokenizer's vocabulary goes to llguidance once per (Tokenizer object, vocab_size) (an `LLTokenizer`, kept in
  a weak-keyed cache so that it goes with the Tokenizer). Compiled grammars are cached per vocabulary by grammar
  text: the first `bind` builds a template matcher, later binds take a `deep_copy` of it (bounded LRU).
- `bind` raises FilterError with llguidance's message for a schema, regex or grammar that does not compile.
- `fill_bitmask(row)` writes llguidance's mask into the row (the GIL is released while it computes);
  `fill_bitmasks(filters, bitmask)` fills a batch: rows of one vocabulary by worker processes from procs.MIN_ROWS
  rows up, where the host has the CPUs (folio.constrain.procs); else the rows of one compiled grammar (copies of
  one template) in one call on one thread, the groups of different grammars on threads of their own. llguidance's
  threads in one process contend: more threads on one grammar's rows made a step slower, and threads with a
  tokenizer and grammar of their own each no faster (bench/grammar_threads.py; bench/RESULTS.md).
- EOS: while the grammar accepts (it could end here), the tokenizer's EOS ids are in the mask; feeding one
  finishes the filter. When the grammar can go no further (a closed JSON document, a regex with nothing left to
  match) the matcher stops by itself: `is_finished` is true without an EOS, and the mask then holds only EOS.
- `feed` of a token the grammar does not allow raises FilterError and leaves the state as it was.
- `rollback(n)` is llguidance's own rollback.
"""

from __future__ import annotations

import abc
import json
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import llguidance
import llguidance.numpy as llnp
import numpy as np

from folio.constrain import procs
from folio.constrain.base import Filter, FilterError, bitmask_words
from folio.tokenizer import Tokenizer

GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept per vocabulary

# llguidance's token-set "slices": where a lexer state allows every token of a slice, the mask takes the slice whole
# and walks only the tokens outside it. Its defaults slice JSON string text at 10 and 30 characters; a bounded string
# (maxLength) with fewer characters left than 10 took none and walked the whole vocabulary. Finer steps made
# bounded-string masks about a fifth cheaper (bench/grammar_slices.py), and leave the masks as they were.
_STRING_CHAR = r'[^"\\\x00-\x1F\x7F]'
STRING_SLICES = [r"[\x20\x0A\x0D\x09]+", *(f"{_STRING_CHAR}{{1,{n}}}" for n in (2, 4, 6, 8, 10, 16, 24, 30)),
                 f"{_STRING_CHAR}+"]

GROUP_THREADS = 4  # grammars filled at once by fill_bitmasks (each group's rows on one thread)

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_vocabularies: weakref.WeakKeyDictionary[Tokenizer, dict[int, _Vocabulary]] = weakref.WeakKeyDictionary()
_executors: list[llguidance.LLExecutor] = []  # GROUP_THREADS of one thread each: a group's rows on each
_group_pool: ThreadPoolExecutor | None = None  # runs the groups after the first


class _Vocabulary:
    """One tokenizer's vocabulary as llguidance sees it, and the grammars compiled against it."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        tokens: list[bytes] = []
        special: list[int] = []
        for token_id in range(tokenizer.vocab_size):
            raw = tokenizer.token_bytes(token_id)
            if token_id in tokenizer.special_ids or not raw:
                # llguidance keeps special tokens out of the text it matches; ids with no bytes (unused slots)
                # are marked special too so that no grammar can ever allow them.
                special.append(token_id)
                name = tokenizer.id_to_piece(token_id) if token_id in tokenizer.special_ids else ""
                raw = (name or f"<unused_{token_id}>").encode()
            tokens.append(raw)
        for token_id in range(tokenizer.vocab_size, vocab_size):  # the model's padding ids
            special.append(token_id)
            tokens.append(f"<pad_{token_id}>".encode())
        self.eos_ids = list(tokenizer.eos_token_ids)
        self.vocab_size = vocab_size
        self.wrapper = _TokenizerWrapper(tokenizer, tokens, special)
        self.lltok = llguidance.LLTokenizer(self.wrapper, n_vocab=vocab_size, eos_token=self.eos_ids or None,
                                            slices=STRING_SLICES)
        self.templates: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self.pool: procs.MaskProcesses | None = None  # (mask_processes)

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        with _lock:
            template = self.templates.get(grammar)
            if template is not None:
                self.templates.move_to_end(grammar)
        if template is None:
            template = llguidance.LLMatcher(self.lltok, grammar, log_level=0)  # compiles; drops the GIL
            if template.is_error():
                raise FilterError(template.get_error())
            with _lock:
                self.templates[grammar] = template
                while len(self.templates) > GRAMMAR_CACHE_SIZE:
                    self.templates.popitem(last=False)
        return template.deep_copy()

    def mask_processes(self) -> procs.MaskProcesses | None:
        """The worker processes making this vocabulary's masks, once they are ready (the first call starts them,
        on a background thread); None until then, where procs.PROCESSES is 0, or once they failed."""
        if procs.PROCESSES <= 0:
            return None
        if self.pool is None:
            with _lock:
                if self.pool is None:
                    self.pool = procs.start_pool(self.pool_init(), procs.PROCESSES)
            return None
        return self.pool if self.pool.ready.is_set() and self.pool.error is None else None

    def pool_init(self) -> dict[str, Any]:
        """What a mask worker process builds this vocabulary from (it encodes text as folio's tokenizer does)."""
        w = self.wrapper
        return {"tokens": w.tokens, "special": w.special_token_ids, "eos": self.eos_ids, "bos": w.bos_token_id,
                "vocab_size": self.vocab_size, "slices": STRING_SLICES, "tokenizer_json": w._tokenizer.to_json()}

    def family(self, grammar: str) -> tuple[int, str]:
        """What the copies of one template share (their lexer caches): the key fill_bitmasks groups rows by."""
        return id(self), grammar


class _TokenizerWrapper:
    """What llguidance.LLTokenizer reads from a Python tokenizer: token bytes, special ids, and encode (which it
    uses to tokenize text the grammar forces)."""

    is_tokenizer_wrapper = True

    def __init__(self, tokenizer: Tokenizer, tokens: list[bytes], special: list[int]):
        self.tokens = tokens
        self.special_token_ids = special
        self.eos_token_id = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
        self.bos_token_id = tokenizer.bos_token_id
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text)


def vocabulary(tokenizer: Tokenizer, vocab_size: int) -> _Vocabulary:
    """The llguidance vocabulary of `tokenizer` over vocab_size ids (built once, then cached)."""
    with _lock:
        per_size = _vocabularies.setdefault(tokenizer, {})
        vocab = per_size.get(vocab_size)
    if vocab is None:
        vocab = _Vocabulary(tokenizer, vocab_size)  # ~1 s for a 128k vocabulary; outside the lock
        with _lock:
            vocab = per_size.setdefault(vocab_size, vocab)
    return vocab


class GrammarFilterBase(Filter, abc.ABC):
    """A filter that follows one llguidance grammar; subclasses say how their input becomes that grammar."""

    def __init__(self) -> None:
        super().__init__()
        self._matcher: llguidance.LLMatcher | None = None
        self.family: tuple[int, str] | None = None  # (bind: rows of one family are filled on one thread)
        # what folio.constrain.procs keeps a worker's shadow of this filter by: its grammar text and vocabulary,
        # the shadow, a count bumped by bind and reset (the shadow starts again), and the fewest tokens fed since
        # the shadow's last sync (rollback: the shadow rolls back to there)
        self._grammar: str | None = None
        self._vocab: _Vocabulary | None = None
        self._shadow: list | None = None
        self._epoch = self._low = 0

    @abc.abstractmethod
    def llguidance_grammar(self) -> str:
        """The llguidance grammar (its JSON text) this filter follows."""

    def bind(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        super().bind(tokenizer, vocab_size)
        try:
            grammar = self.llguidance_grammar()
        except ValueError as e:  # llguidance's converters raise ValueError for text they cannot read
            raise FilterError(f"{type(self).__name__}: {e}") from e
        vocab = vocabulary(tokenizer, vocab_size)
        try:
            self._matcher = vocab.matcher(grammar)
        except FilterError as e:
            raise FilterError(f"{type(self).__name__}: {e}") from e
        self.family = vocab.family(grammar)
        self._fed = []
        self._grammar, self._vocab = grammar, vocab
        self._epoch += 1

    @property
    def matcher(self) -> llguidance.LLMatcher:
        if self._matcher is None:
            raise RuntimeError(f"{type(self).__name__} is not bound: call bind(tokenizer, vocab_size) first")
        return self._matcher

    def fill_bitmask(self, row: np.ndarray) -> None:
        if row.dtype != np.int32 or not row.flags["C_CONTIGUOUS"] or row.size != bitmask_words(self.vocab_size):
            raise ValueError(f"bitmask row must be {bitmask_words(self.vocab_size)} contiguous int32 words")
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def feed(self, token_id: int) -> None:
        matcher = self.matcher
        if matcher.try_consume_tokens([token_id]) != 1:
            error = matcher.get_error()
            raise FilterError(f"{type(self).__name__}: token {token_id} "
                              f"({self.tokenizer.id_to_piece(token_id)!r}) is not allowed here"
                              + (f": {error}" if error else ""))
        super().feed(token_id)

    def is_finished(self) -> bool:
        return self.matcher.is_stopped()

    def is_accepting(self) -> bool:
        """Whether the output so far is complete (EOS would be allowed now)."""
        return self.matcher.is_accepting()

    def reset(self) -> None:
        self.matcher.reset()
        self._fed = []
        self._epoch += 1

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= len(self._fed):
            raise ValueError(f"cannot roll back {num_tokens} of {len(self._fed)} tokens")
        if num_tokens and not self.matcher.rollback(num_tokens):
            raise FilterError(f"{type(self).__name__}: rollback failed: {self.matcher.get_error()}")
        del self._fed[len(self._fed) - num_tokens:]
        self._low = min(self._low, len(self._fed))


class JsonSchemaFilter(GrammarFilterBase):
    """Output is one JSON value valid under `schema` (a dict, its JSON text, or True/False).

    options: llguidance's JSON compile options applied over the schema's own "x-guidance" (e.g.
    {"lenient": True} to ignore unsupported keywords). By default the output's whitespace is fixed (one space after
    ":" and ","; {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}), so a model cannot
    spend its tokens on whitespace between values; pass {"whitespace_flexible": True} to allow any.
    """

    def __init__(self, schema: dict[str, Any] | str | bool, *, options: dict[str, Any] | None = None):
        super().__init__()
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise FilterError(f"JsonSchemaFilter: the schema is not JSON: {e}") from e
        if schema is False:
            raise FilterError("JsonSchemaFilter: the schema `false` admits no value")
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise FilterError(f"JsonSchemaFilter: a schema is an object or a boolean, got {type(schema).__name__}")
        self.schema = schema
        self.options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", **(options or {})}

    def llguidance_grammar(self) -> str:
        return llguidance.LLMatcher.grammar_from_json_schema(self.schema, overrides=self.options)


class RegexFilter(GrammarFilterBase):
    """Output matches `pattern` entirely (Rust regex syntax: no lookaround or backreferences; ^ and $ are not
    needed, the whole output is matched)."""

    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = pattern

    def llguidance_grammar(self) -> str:
        return llguidance.LLMatcher.grammar_from_regex(self.pattern)


class GrammarFilter(GrammarFilterBase):
    """Output is derived from the `start` rule of a context-free grammar.

    syntax "lark": llguidance's Lark dialect (rules, terminals, regexes /.../, %json embedding); "gbnf": llama.cpp's
    GBNF (root ::= ...), converted to Lark by llguidance; "auto": Lark if it reads as Lark, else GBNF.
    """

    def __init__(self, grammar: str, syntax: str = "auto"):
        super().__init__()
        if syntax not in ("auto", "lark", "gbnf"):
            raise ValueError(f"GrammarFilter: syntax must be 'auto', 'lark' or 'gbnf', got {syntax!r}")
        self.grammar = grammar
        self.syntax = syntax

    def llguidance_grammar(self) -> str:
        if self.syntax == "lark":
            return llguidance.LLMatcher.grammar_from_lark(self.grammar)
        return llguidance.grammar_from("gbnf", self.grammar)  # "gbnf" passes Lark through unchanged


class ChoiceFilter(GrammarFilterBase):
    """Output is exactly one of `options`."""

    def __init__(self, options: Sequence[str]):
        super().__init__()
        if not options or not all(isinstance(o, str) for o in options):
            raise FilterError("ChoiceFilter: options must be a non-empty list of strings")
        self.options = list(options)

    def llguidance_grammar(self) -> str:
        return llguidance.grammar_from("choice", self.options)  # type: ignore[arg-type]


def fill_bitmasks(filters: Sequence[Filter | None], bitmask: np.ndarray) -> None:
    """Fill row i of `bitmask` ([B, W] int32, C-contiguous) for filters[i] (None: every token allowed).

    Grammar filters are filled by llguidance with the GIL released: by worker processes where a vocabulary has
    procs.MIN_ROWS rows or more (folio.constrain.procs), else the rows of each compiled grammar together on one
    thread, different grammars on threads of their own (see the module docstring); other filters one by one.
    """
    global _group_pool
    if bitmask.dtype != np.int32 or bitmask.ndim != 2 or not bitmask.flags["C_CONTIGUOUS"]:
        raise ValueError("bitmask must be a C-contiguous [batch, words] int32 array")
    if len(filters) > bitmask.shape[0]:
        raise ValueError(f"{len(filters)} filters for a bitmask of {bitmask.shape[0]} rows")
    groups: dict[Any, list[tuple[llguidance.LLMatcher, int]]] = {}
    in_processes = _fill_in_processes(filters, bitmask) if len(filters) >= procs.MIN_ROWS else set()
    for i, f in enumerate(filters):
        if i in in_processes:
            continue
        if isinstance(f, GrammarFilterBase):
            if bitmask_words(f.vocab_size) != bitmask.shape[1]:
                raise ValueError(f"filter {i}'s vocabulary needs {bitmask_words(f.vocab_size)} words per row")
            groups.setdefault(f.family, []).append((f.matcher, i))
        elif f is None:
            bitmask[i] = -1
        else:
            bitmask[i] = 0
            f.fill_bitmask(bitmask[i])
    if not groups:
        return
    buckets = list(groups.values())
    if len(buckets) > GROUP_THREADS:  # more grammars than threads: some share a thread, one after another
        buckets = [[row for rows in buckets[k::GROUP_THREADS] for row in rows] for k in range(GROUP_THREADS)]
    if not _executors:
        with _lock:
            if not _executors:
                _group_pool = ThreadPoolExecutor(max_workers=GROUP_THREADS - 1, thread_name_prefix="folio-grammar")
                _executors.extend(llguidance.LLExecutor(num_threads=1) for _ in range(GROUP_THREADS))
    # Each bucket writes its own rows of the bitmask. (Concurrent callers share the executors: their calls then
    # take turns on each.)
    tasks = [_group_pool.submit(llnp.fill_next_token_bitmask_par, _executors[k], rows, bitmask)
             for k, rows in enumerate(buckets[1:], start=1)]
    llnp.fill_next_token_bitmask_par(_executors[0], buckets[0], bitmask)
    for task in tasks:
        task.result()


def _fill_in_processes(filters: Sequence[Filter | None], bitmask: np.ndarray) -> set[int]:
    """The rows of vocabularies with procs.MIN_ROWS grammar rows or more, filled by their worker processes where
    those are ready; the rows filled."""
    if procs.PROCESSES <= 0:
        return set()
    by_vocab: dict[_Vocabulary, list[tuple[GrammarFilterBase, int]]] = {}
    for i, f in enumerate(filters):
        if isinstance(f, GrammarFilterBase) and f._vocab is not None and \
                bitmask_words(f.vocab_size) == bitmask.shape[1]:
            by_vocab.setdefault(f._vocab, []).append((f, i))
    filled: set[int] = set()
    for vocab, items in by_vocab.items():
        if not procs.MIN_ROWS <= len(items) <= procs.MAX_ROWS:
            continue
        pool = vocab.mask_processes()
        if pool is None:
            continue
        try:
            left = pool.fill(items, bitmask)
        except procs.MaskProcessError as e:  # the pool is closed: these rows and later fills go in process
            logger.warning("grammar masks go back in process: %s", e)
            continue
        filled.update(i for _, i in items)
        filled.difference_update(left)
    return filled


# the engine's MaskWorker fills the masks of many grammar filters in one call through this
GrammarFilterBase.fill_many = staticmethod(fill_bitmasks)
