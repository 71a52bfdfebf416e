"""OpenAI response bodies from folio's Chunks: whole completions, streamed chunks, usage and log-probabilities.

`Shaper` knows the endpoint (text_completion or chat.completion), the response's id, creation time and model
name, and the tokenizer (a token's text and bytes for log-probabilities). The engine reports probabilities; the
API wants their logarithms, and JSON has no -inf: a probability of 0 reads as LOGPROB_FLOOR.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from folio import EosReason, Tokenizer
from folio.serve.schema import Chunk, Finish, TopTokens

LOGPROB_FLOOR = -9999.0

# EosReason -> OpenAI's finish_reason: "length" when max_tokens cut it, "stop" for every natural end
FINISH_REASONS = {EosReason.STOP_TOKEN: "stop", EosReason.STOP_STRING: "stop", EosReason.END_FILTER: "stop",
                  EosReason.MAX_NEW_TOKENS: "length", EosReason.ERROR: "stop"}


def logprob(prob: float | None) -> float:
    if prob is None or prob <= 0.0 or math.isnan(prob):
        return LOGPROB_FLOOR
    return max(math.log(prob), LOGPROB_FLOOR)


def finish_reason(finish: Finish | None) -> str | None:
    return None if finish is None else FINISH_REASONS.get(finish.reason, "stop")


def usage(finishes: Sequence[Finish], n: int) -> dict[str, Any]:
    """Usage of a response's choices, choice p * n + i being prompt p's sample i: each prompt counts once (with
    its first sample's cache hits), every sample's tokens count."""
    firsts = finishes[::n]
    prompt_tokens = sum(f.usage.prompt_tokens for f in firsts)
    completion_tokens = sum(f.usage.completion_tokens for f in finishes)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(f.usage.cached_tokens for f in firsts)}}


@dataclass
class Shaper:
    chat: bool
    id: str
    created: int
    model: str
    tokenizer: Tokenizer

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    # --- whole responses ---

    def response(self, completions: Sequence[Chunk], n: int) -> dict[str, Any]:
        """The body of a non-streamed response; `completions` holds each choice's chunks merged."""
        choices = []
        for index, whole in enumerate(completions):
            choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason(whole.finish),
                                      "logprobs": self.logprobs(whole, 0)}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": whole.text}
            else:
                choice["text"] = whole.text
            choices.append(choice)
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage([c.finish for c in completions], n)}

    # --- streamed responses ---

    def chunk(self, index: int, chunk: Chunk, first: bool, text_offset: int, with_usage: bool) -> dict[str, Any]:
        """One server-sent event's body for choice `index`; `first`: its first event (chat: the role)."""
        choice: dict[str, Any] = {"index": index, "logprobs": self.logprobs(chunk, text_offset),
                                  "finish_reason": finish_reason(chunk.finish)}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if chunk.text or first:
                delta["content"] = chunk.text
            choice["delta"] = delta
        else:
            choice["text"] = chunk.text
        body = {"id": self.id, "object": self.object + ("" if not self.chat else ".chunk"), "created": self.created,
                "model": self.model, "choices": [choice]}
        if with_usage:
            body["usage"] = None  # stream_options.include_usage: null on every chunk but the last
        return body

    def usage_chunk(self, finishes: Sequence[Finish], n: int) -> dict[str, Any]:
        return {"id": self.id, "object": self.object + ("" if not self.chat else ".chunk"), "created": self.created,
                "model": self.model, "choices": [], "usage": usage(finishes, n)}

    # --- log-probabilities ---

    def logprobs(self, chunk: Chunk, text_offset: int) -> dict[str, Any] | None:
        if chunk.token_probs is None:
            return None
        tops: list[TopTokens | None] = list(chunk.top_tokens) if chunk.top_tokens is not None else []
        tops += [None] * (len(chunk.token_ids) - len(tops))
        if self.chat:
            return {"content": [self._chat_entry(t, p, top) for t, p, top in zip(chunk.token_ids, chunk.token_probs,
                                                                                   tops)], "refusal": None}
        tokens = [self.tokenizer.id_to_piece(t) for t in chunk.token_ids]
        offsets = []
        for token in tokens:
            offsets.append(text_offset)
            text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": [logprob(p) for p in chunk.token_probs],
                "top_logprobs": [None if top is None else {self.tokenizer.id_to_piece(t): logprob(p)
                                                           for t, p in zip(top.token_ids, top.probs)} for top in tops],
                "text_offset": offsets}

    def _chat_entry(self, token_id: int, prob: float | None, top: TopTokens | None) -> dict[str, Any]:
        entry = self._token(token_id, prob)
        entry["top_logprobs"] = [] if top is None else [self._token(t, p) for t, p in zip(top.token_ids, top.probs)]
        return entry

    def _token(self, token_id: int, prob: float | None) -> dict[str, Any]:
        piece = self.tokenizer.id_to_piece(token_id)
        raw = self.tokenizer.token_bytes(token_id) or piece.encode("utf-8")  # special tokens: their text
        return {"token": piece, "logprob": logprob(prob), "bytes": list(raw)}
