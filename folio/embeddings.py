"""Embeddings injected at token positions: how a multimodal front end (an image or audio encoder) hands its output
rows to the language model.

Placeholder scheme. `InjectedEmbeddings(tensor)` of n rows owns n placeholder token ids, `token_ids`: consecutive
ids from `first_token_id`, in a block of MAX_ROWS ids at or above PLACEHOLDER_BASE (2**40, far beyond any
vocabulary) chosen by the digest of the payload's content (its dtype, shape and bytes). The prompt carries these
ids, whole and in order, where the rows go: `DynamicJob(input_ids=text_ids + image.token_ids + more_ids,
embeddings=[image])`. The forward pass feeds the payload's row k where its k-th placeholder id sits, in place of a
token embedding (folio.model.injection): the rows enter the residual stream as given, as transformers'
`inputs_embeds` do (a family that scales its token embeddings, Gemma, does not scale them).

Why content-derived ids: equal content gives equal ids, so equal prompts give equal page hashes; and the job's
hash namespace (folio.hashing.sequence_namespace) takes the digest of its payloads in prompt order, so two jobs
with the same token ids but other payloads never share pages (a chance collision of the id blocks, odds 2**-42 per
pair, is covered by the namespace's full digest) while two with the same payloads do. Because ids name content,
a payload's run may appear more than once in a prompt (the same image twice) and the same content passed twice
in `embeddings` counts once. There is no text alias: build the ids with the tokenizer's output and `token_ids`.

The payload is copied when made (later changes to the caller's tensor must not change what its digest names) and
converted to the model's dtype and device when the job is enqueued. The router hashes token ids without this
namespace, so it finds no cached prefix for such a job and routes it by load.

Checks (ValueError naming the argument): a 2-D floating, finite tensor of 1..MAX_ROWS rows; at enqueue, rows of the
model's hidden_size; each payload's run present in input_ids (whole, in order), no placeholder id without a
payload. Refused combinations: classifier-free guidance (the negative prompt would need its own), token healing
whose healed token is a placeholder, and a generator with a draft model (it would need the payload in its own
embedding space). N-gram drafts stop before a placeholder id (never a real token, so never accepted). Elsewhere the
placeholders in a sequence's history are harmless: the penalties and DRY ignore ids outside the vocabulary (they
still take their positions in a penalty window), stop tokens and filters see sampled tokens only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from folio.model.injection import InjectedSpan

if TYPE_CHECKING:
    from folio.job import DynamicJob

PLACEHOLDER_BASE = 1 << 40
"""The smallest placeholder id."""
MAX_ROWS = 1 << 20
"""Most rows of one payload: the size of its id block."""
_NUM_BLOCKS = (1 << 62) // MAX_ROWS  # the largest id stays below 2**40 + 2**62 < 2**63 (int64)
DIGEST_SIZE = 16


def is_placeholder(token_id: int) -> bool:
    return token_id >= PLACEHOLDER_BASE


class InjectedEmbeddings:
    """Rows [n, hidden_size] that replace the token embeddings of n placeholder tokens (see the module doc)."""

    def __init__(self, embeddings: torch.Tensor):
        if not isinstance(embeddings, torch.Tensor):
            raise TypeError(f"embeddings must be a torch.Tensor [num_tokens, hidden_size], got "
                            f"{type(embeddings).__name__}")
        if embeddings.ndim != 2 or not 1 <= embeddings.shape[0] <= MAX_ROWS or embeddings.shape[1] < 1:
            raise ValueError(f"embeddings must have shape [num_tokens, hidden_size] with 1 <= num_tokens <= "
                             f"{MAX_ROWS}, got {tuple(embeddings.shape)}")
        if not embeddings.is_floating_point():
            raise ValueError(f"embeddings must be a floating-point tensor (converted to the model's dtype), got "
                             f"{embeddings.dtype}")
        # a copy on the host: what the digest names must not change, and hashing reads host bytes
        self.embeddings = embeddings.detach().to("cpu", copy=True).contiguous()
        if not bool(torch.isfinite(self.embeddings).all()):
            raise ValueError("embeddings holds NaN or infinite values")
        self.digest = _content_digest(self.embeddings)
        block = int.from_bytes(self.digest[:8], "little") % _NUM_BLOCKS
        self.first_token_id = PLACEHOLDER_BASE + block * MAX_ROWS

    @property
    def num_tokens(self) -> int:
        return self.embeddings.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.embeddings.shape[1]

    @property
    def token_ids(self) -> list[int]:
        """The placeholder ids to put in the prompt, in this order, where the rows go."""
        return list(range(self.first_token_id, self.first_token_id + self.num_tokens))

    def __repr__(self) -> str:
        return (f"InjectedEmbeddings(num_tokens={self.num_tokens}, hidden_size={self.hidden_size}, "
                f"dtype={self.embeddings.dtype}, first_token_id={self.first_token_id})")


def _content_digest(host_rows: torch.Tensor) -> bytes:
    hasher = hashlib.blake2b(digest_size=DIGEST_SIZE)
    hasher.update(f"{host_rows.dtype}:{tuple(host_rows.shape)}".encode())
    hasher.update(memoryview(host_rows.view(torch.uint8).numpy()))
    return hasher.digest()


class PromptEmbeddings:
    """A job's payloads, placed: where each run of placeholders sits in the prompt (checked when the job is made),
    and the payloads in the model's dtype on its device (from `bind`, at enqueue)."""

    def __init__(self, payloads: Sequence[InjectedEmbeddings], runs: Sequence[tuple[int, InjectedEmbeddings]]):
        self.payloads = tuple(payloads)
        self.runs = tuple(runs)  # (prompt position of the run's first id, payload), by position
        hasher = hashlib.blake2b(digest_size=DIGEST_SIZE)
        for position, payload in self.runs:
            hasher.update(position.to_bytes(8, "little") + payload.digest)
        self.digest = hasher.digest()
        self._values: dict[int, torch.Tensor] = {}  # first_token_id -> rows on the model's device

    def check_width(self, hidden_size: int) -> None:
        for payload in self.payloads:
            if payload.hidden_size != hidden_size:
                raise ValueError(f"embeddings: a payload has rows of {payload.hidden_size} values, but the model's "
                                 f"hidden_size is {hidden_size}")

    def bind(self, device: torch.device, dtype: torch.dtype) -> None:
        """Convert the rows for the model that runs the job."""
        self._values = {p.first_token_id: p.embeddings.to(device=device, dtype=dtype) for p in self.payloads}

    def spans(self, start: int, end: int) -> list[InjectedSpan]:
        """The injected rows among sequence positions start .. end - 1 (a chunk fed to the model), as spans
        counted from `start`. A payload may straddle the chunk's bounds: its rows inside them are taken."""
        spans = []
        for position, payload in self.runs:
            lo, hi = max(start, position), min(end, position + payload.num_tokens)
            if lo < hi:
                values = self._values.get(payload.first_token_id)
                if values is None:
                    raise RuntimeError("the job's embeddings were not bound to the model (the job was not enqueued)")
                spans.append(InjectedSpan(lo - start, values[lo - position:hi - position]))
        return spans


def check_engine(job: DynamicJob, *, hidden_size: int, draft_model: bool) -> None:
    """Enqueue-time checks of the job's embeddings against the engine (ValueError, naming the argument)."""
    if job.embeddings is None:
        return
    if draft_model:
        raise ValueError("embeddings: this generator drafts with a draft model, which would need the payloads in "
                         "its own embedding space; run jobs with injected embeddings on a generator without one "
                         "(n-gram drafting works)")
    job.embeddings.check_width(hidden_size)


def bind(job: DynamicJob, device: torch.device, dtype: torch.dtype) -> None:
    """At enqueue: the job's payloads in the model's dtype, on its device."""
    if job.embeddings is not None:
        job.embeddings.bind(device, dtype)


def digest(job: DynamicJob) -> bytes | None:
    """The part of the job's page-hash namespace that names its injected content (None without embeddings)."""
    return None if job.embeddings is None else job.embeddings.digest


def chunk_spans(job: DynamicJob, start: int, end: int) -> list[InjectedSpan] | tuple[()]:
    """The injected rows of `job`'s positions start .. end - 1; () for a job without embeddings."""
    return () if job.embeddings is None else job.embeddings.spans(start, end)


def for_prompt(embeddings: Iterable[InjectedEmbeddings] | None, input_ids: list[int], *, token_healing: bool,
               cfg: bool) -> PromptEmbeddings | None:
    """DynamicJob's `embeddings` checked against its prompt (ids before token healing takes the last one off);
    None without embeddings. ValueError, naming the argument, for anything that does not fit."""
    if embeddings is None:
        payloads: list[InjectedEmbeddings] = []
    else:
        if isinstance(embeddings, InjectedEmbeddings) or not isinstance(embeddings, Iterable):
            raise TypeError("embeddings must be a list of folio.InjectedEmbeddings")
        payloads = list(embeddings)
        for k, p in enumerate(payloads):
            if not isinstance(p, InjectedEmbeddings):
                raise TypeError(f"embeddings[{k}] must be a folio.InjectedEmbeddings, got {type(p).__name__}")
    if not payloads:
        bad = next((i for i, t in enumerate(input_ids) if is_placeholder(t)), None)
        if bad is not None:
            raise ValueError(f"input_ids[{bad}] = {input_ids[bad]} is a placeholder id of injected embeddings, but "
                             f"the job has no embeddings=[...]")
        return None
    if cfg:
        raise ValueError("embeddings with classifier-free guidance are not supported (the negative prompt would need "
                         "payloads of its own)")
    if token_healing and is_placeholder(input_ids[-1]):
        raise ValueError("token_healing: the prompt's last token is a placeholder of injected embeddings, which "
                         "cannot be healed (end the prompt with text, or turn token_healing off)")
    by_block = _unique_payloads(payloads)
    runs = _find_runs(input_ids, by_block)
    for k, p in enumerate(payloads):
        if not any(run_payload.digest == p.digest for _, run_payload in runs):
            raise ValueError(f"embeddings[{k}] ({p.num_tokens} rows) has no placeholder run in input_ids: put its "
                             f"token_ids (ids {p.first_token_id}..{p.first_token_id + p.num_tokens - 1}) in the "
                             f"prompt where its rows go")
    return PromptEmbeddings(list(by_block.values()), runs)


def _unique_payloads(payloads: list[InjectedEmbeddings]) -> dict[int, InjectedEmbeddings]:
    """Payloads by first_token_id, equal content once."""
    by_block: dict[int, tuple[int, InjectedEmbeddings]] = {}
    for k, p in enumerate(payloads):
        seen = by_block.get(p.first_token_id)
        if seen is None:
            by_block[p.first_token_id] = (k, p)
        elif seen[1].digest != p.digest:
            raise ValueError(f"embeddings[{seen[0]}] and embeddings[{k}] differ but drew the same placeholder ids "
                             f"(a chance collision of their digests): change one payload slightly")
    return {first: p for first, (_, p) in by_block.items()}


def _find_runs(input_ids: list[int], by_block: dict[int, InjectedEmbeddings],
               ) -> list[tuple[int, InjectedEmbeddings]]:
    runs = []
    i, n = 0, len(input_ids)
    while i < n:
        token_id = input_ids[i]
        if not is_placeholder(token_id):
            i += 1
            continue
        first = PLACEHOLDER_BASE + (token_id - PLACEHOLDER_BASE) // MAX_ROWS * MAX_ROWS
        payload = by_block.get(first)
        if payload is None:
            raise ValueError(f"input_ids[{i}] = {token_id} is a placeholder id that no payload in embeddings owns")
        if token_id != first:
            raise ValueError(f"input_ids[{i}]: a placeholder run must hold its payload's token_ids whole and in "
                             f"order, but this one starts at row {token_id - first} of {payload.num_tokens}")
        expected = payload.token_ids
        got = input_ids[i:i + len(expected)]
        if got != expected:
            row = next((r for r, (a, b) in enumerate(zip(got, expected)) if a != b), len(got))
            raise ValueError(f"input_ids[{i}..]: the placeholder run of a payload of {payload.num_tokens} rows breaks "
                             f"off after {row} of them (its token_ids must appear whole and in order)")
        runs.append((i, payload))
        i += len(expected)
    return runs
