"""Injected embeddings at the serving edge: a request's payloads (position, rows, dtype, raw bytes) checked and
placed in its prompt as folio.InjectedEmbeddings, on the ingress's validation thread.

The ingress places them (rather than the replica) so that the request reaching the router carries the prompt the
replica will run, placeholder ids included, and the digest that namespaces its pages: the router hashes the
prompt as the replica's page pool does, and requests with the same image go where its pages are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from folio.serve.errors import InvalidRequest, Unimplemented

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class EmbeddingPayload:
    """Rows that replace the embeddings of prompt tokens position .. position + rows - 1 (whose ids are
    ignored). data: rows x hidden_size values in `dtype`, row-major, little-endian."""

    position: int
    rows: int
    dtype: str
    data: bytes


@dataclass(frozen=True)
class PlacedEmbeddings:
    input_ids: tuple[int, ...]  # the prompt with each payload's placeholder ids in place
    payloads: tuple  # folio.InjectedEmbeddings, in request order
    digest: str  # hex: the namespace part that the replica's pages of this prompt are filed under


def placed_embeddings(request: Any, input_ids: Sequence[int], hidden_size: int, max_bytes: int,
                      cfg: bool) -> PlacedEmbeddings | None:
    """A GenerationRequest's embeddings placed in its prompt (None without any); InvalidRequest where the request
    cannot carry them: a text prompt, classifier-free guidance (cfg), a replica without embeddings (hidden_size 0:
    Unimplemented)."""
    payloads = request.embeddings
    if not payloads:
        return None
    if isinstance(payloads, (str, bytes)) or not isinstance(payloads, Sequence):
        raise InvalidRequest("embeddings", "must be a list of EmbeddingPayload")
    if request.token_ids is None:
        raise InvalidRequest("embeddings", "need a token_ids prompt (the placeholders' positions are token indices)")
    if cfg:
        raise InvalidRequest("embeddings", "cannot be combined with classifier-free guidance (the negative prompt "
                                           "would need payloads of its own)")
    if not hidden_size:
        raise Unimplemented("embeddings", "this server's replicas do not take injected embeddings")
    return place(payloads, input_ids, hidden_size, max_bytes, request.token_healing)


def place(payloads: Sequence[EmbeddingPayload], input_ids: Sequence[int], hidden_size: int, max_bytes: int,
          token_healing: bool = False) -> PlacedEmbeddings:
    """Check the payloads against the prompt and the model and put their placeholder ids in the prompt.
    InvalidRequest (field "embeddings[k]...") for anything that does not fit."""
    import torch

    from folio.embeddings import InjectedEmbeddings, for_prompt

    ids = list(input_ids)
    total = sum(len(p.data) if isinstance(p, EmbeddingPayload) else 0 for p in payloads)
    if total > max_bytes:
        raise InvalidRequest("embeddings", f"{total} bytes in all exceed the server's limit of {max_bytes} "
                                           "(max_embedding_bytes)")
    placed, covered = [], [False] * len(ids)
    for k, p in enumerate(payloads):
        field = f"embeddings[{k}]"
        if not isinstance(p, EmbeddingPayload):
            raise InvalidRequest(field, f"must be an EmbeddingPayload, got {type(p).__name__}")
        element = DTYPE_BYTES.get(p.dtype)
        if element is None:
            raise InvalidRequest(f"{field}.dtype", f"must be one of {', '.join(DTYPE_BYTES)}, got {p.dtype!r}")
        if not isinstance(p.rows, int) or p.rows < 1:
            raise InvalidRequest(f"{field}.rows", f"must be >= 1, got {p.rows!r}")
        if not isinstance(p.position, int) or p.position < 0 or p.position + p.rows > len(ids):
            raise InvalidRequest(f"{field}.position", f"rows {p.position}..{p.position + p.rows - 1} are not all "
                                                      f"in the prompt of {len(ids)} tokens")
        if len(p.data) != p.rows * hidden_size * element:
            raise InvalidRequest(f"{field}.data", f"{len(p.data)} bytes; {p.rows} rows of the model's hidden_size "
                                                  f"{hidden_size} in {p.dtype} take {p.rows * hidden_size * element}")
        if any(covered[p.position:p.position + p.rows]):
            raise InvalidRequest(f"{field}.position", "overlaps another payload's rows")
        covered[p.position:p.position + p.rows] = [True] * p.rows
        rows = torch.frombuffer(bytearray(p.data), dtype=getattr(torch, p.dtype)).view(p.rows, hidden_size)
        try:
            payload = InjectedEmbeddings(rows)
        except ValueError as error:  # NaN / infinite values
            raise InvalidRequest(field, str(error)) from None
        ids[p.position:p.position + p.rows] = payload.token_ids
        placed.append(payload)
    try:
        prompt = for_prompt(placed, ids, token_healing=token_healing, cfg=False)
    except ValueError as error:
        raise InvalidRequest("embeddings", str(error)) from None
    return PlacedEmbeddings(tuple(ids), tuple(placed), prompt.digest.hex() if prompt is not None else "")
