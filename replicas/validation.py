"""Request validation at the ingress: GenerationRequest -> EngineRequest, or InvalidRequest naming the field.

Field names are the API's (the gRPC message's and the Python client's), not the engine's. Everything that can be
checked without the model is checked here, so a bad request never reaches a replica.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from folio import SAMPLER_LIMITS, Tokenizer
from folio.serve.errors import InvalidRequest
from folio.serve.schema import EngineRequest, GenerationRequest, ModelInfo, Sampling

MAX_RETURN_TOP_TOKENS = 64
MAX_SEED = (1 << 64) - 1


def to_engine_request(request: GenerationRequest, tokenizer: Tokenizer, info: ModelInfo,
                      request_id: str = "") -> EngineRequest:
    input_ids = prompt_ids(request, tokenizer, info)
    _check_lengths(request, len(input_ids), info)
    sampler = sampler_kwargs(request.sampling, info.vocab_size)
    stop_token_ids = _token_ids("stop_token_ids", request.stop_token_ids, info.vocab_size)
    stop_strings = _stop_strings(request.stop_strings)
    _check_bool("stop_on_eos", request.stop_on_eos)
    stop_conditions: tuple[int | str, ...] | None
    if request.stop_on_eos and not stop_token_ids and not stop_strings:
        stop_conditions = None  # the engine's rule: the model's EOS tokens
    else:
        eos = tuple(info.eos_token_ids) if request.stop_on_eos else ()
        stop_conditions = (*dict.fromkeys(eos + tuple(stop_token_ids)), *stop_strings)
    if request.seed is not None and (not _is_int(request.seed) or not 0 <= request.seed <= MAX_SEED):
        raise InvalidRequest("seed", f"must be an integer in [0, 2**64), got {request.seed!r}")
    limit = min(MAX_RETURN_TOP_TOKENS, info.vocab_size)
    if not _is_int(request.return_top_tokens) or not 0 <= request.return_top_tokens <= limit:
        raise InvalidRequest("return_top_tokens", f"must be in [0, {limit}], got {request.return_top_tokens!r}")
    for name in ("decode_special_tokens", "return_probs"):
        _check_bool(name, getattr(request, name))
    return EngineRequest(
        input_ids=tuple(input_ids), max_new_tokens=request.max_new_tokens, min_new_tokens=request.min_new_tokens,
        sampler=sampler, stop_conditions=stop_conditions, seed=request.seed,
        decode_special_tokens=request.decode_special_tokens, return_probs=request.return_probs,
        return_top_tokens=request.return_top_tokens, request_id=request_id)


def prompt_ids(request: GenerationRequest, tokenizer: Tokenizer, info: ModelInfo) -> list[int]:
    has_text, has_ids = request.text is not None, request.token_ids is not None
    if has_text == has_ids:
        raise InvalidRequest("prompt", "give exactly one of text and token_ids"
                             + (", not both" if has_text else ""))
    if has_ids:
        if request.add_bos is not None or request.encode_special_tokens:
            raise InvalidRequest("add_bos" if request.add_bos is not None else "encode_special_tokens",
                                 "applies to text prompts only")
        ids = _token_ids("token_ids", request.token_ids, info.vocab_size)
        if not ids:
            raise InvalidRequest("token_ids", "the prompt is empty")
        return ids
    if not isinstance(request.text, str):
        raise InvalidRequest("text", f"must be a string, got {type(request.text).__name__}")
    if not request.text:
        raise InvalidRequest("text", "the prompt is empty")
    add_bos = tokenizer.add_bos_token if request.add_bos is None else request.add_bos
    _check_bool("add_bos", add_bos)
    if add_bos and tokenizer.bos_token_id is None:
        raise InvalidRequest("add_bos", "the model's tokenizer has no BOS token")
    _check_bool("encode_special_tokens", request.encode_special_tokens)
    return tokenizer.encode(request.text, add_bos=add_bos, encode_special_tokens=request.encode_special_tokens)


def _check_lengths(request: GenerationRequest, num_prompt_tokens: int, info: ModelInfo) -> None:
    max_new, min_new = request.max_new_tokens, request.min_new_tokens
    if not _is_int(max_new) or max_new < 1:
        raise InvalidRequest("max_new_tokens", f"must be an integer >= 1, got {max_new!r}")
    if not _is_int(min_new) or min_new < 0:
        raise InvalidRequest("min_new_tokens", f"must be an integer >= 0, got {min_new!r}")
    if min_new > max_new:
        raise InvalidRequest("min_new_tokens", f"{min_new} exceeds max_new_tokens ({max_new})")
    limit = info.max_request_tokens
    if num_prompt_tokens >= limit:
        raise InvalidRequest("prompt", f"{num_prompt_tokens} tokens leave no room in the model's context of "
                                       f"{limit} tokens")
    if num_prompt_tokens + max_new > limit:
        raise InvalidRequest("max_new_tokens", f"the prompt's {num_prompt_tokens} tokens + {max_new} new tokens "
                                               f"exceed the context of {limit} tokens; ask for at most "
                                               f"{limit - num_prompt_tokens}")


def sampler_kwargs(sampling: Sampling, vocab_size: int) -> dict[str, Any]:
    """folio.SamplerSettings keyword arguments, every range checked here under the API's field names."""
    if not isinstance(sampling, Sampling):
        raise InvalidRequest("sampler", f"must be a folio.serve.schema.Sampling, got {type(sampling).__name__}")
    s = sampling
    # the engine's bounds (folio.SAMPLER_LIMITS: what keeps fp32 logits finite and kernel integers in int32)
    limits, offset = SAMPLER_LIMITS, SAMPLER_LIMITS.max_logit_offset
    _real("temperature", s.temperature, low=0.0, high=limits.max_temperature)
    _integer("top_k", s.top_k, low=0, high=limits.max_int32)
    _real("top_p", s.top_p, low=0.0, high=1.0)
    _real("min_p", s.min_p, low=0.0, high=1.0)
    _real("repetition_penalty", s.repetition_penalty, low=limits.min_repetition_penalty,
          high=limits.max_repetition_penalty)
    _real("frequency_penalty", s.frequency_penalty, low=-offset, high=offset)
    _real("presence_penalty", s.presence_penalty, low=-offset, high=offset)
    _integer("repetition_range", s.repetition_range, low=-1, high=limits.max_int32)
    _integer("repetition_decay", s.repetition_decay, low=0, high=limits.max_int32)
    for token_id, bias in dict(s.token_bias).items():
        if not _is_int(token_id) or not 0 <= token_id < vocab_size:
            raise InvalidRequest("token_bias", f"token id {token_id!r} is outside the vocabulary [0, {vocab_size})")
        if not isinstance(bias, (int, float)) or isinstance(bias, bool) or math.isnan(bias) or (
                bias != -math.inf and abs(bias) > offset):
            raise InvalidRequest("token_bias", f"bias of token {token_id} must be a number in [-{offset:g}, "
                                               f"{offset:g}] or -inf, got {bias!r}")
    return s.engine_kwargs()


def _token_ids(name: str, ids: Sequence[int] | None, vocab_size: int) -> list[int]:
    if ids is None:
        return []
    if isinstance(ids, (str, bytes)):
        raise InvalidRequest(name, "must be a list of token ids")
    out = list(ids)
    for i, token_id in enumerate(out):
        if not _is_int(token_id) or not 0 <= token_id < vocab_size:
            raise InvalidRequest(name, f"[{i}] = {token_id!r} is outside the vocabulary [0, {vocab_size})")
    return out


def _stop_strings(strings: Sequence[str]) -> list[str]:
    if isinstance(strings, (str, bytes)):
        raise InvalidRequest("stop_strings", "must be a list of strings")
    out = list(strings)
    for i, s in enumerate(out):
        if not isinstance(s, str) or not s:
            raise InvalidRequest("stop_strings", f"[{i}] must be a non-empty string, got {s!r}")
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidRequest(name, f"must be true or false, got {value!r}")


def _real(name: str, value: Any, low: float | None = None, high: float | None = None) -> None:
    if value is None:
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise InvalidRequest(name, f"must be a finite number, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise InvalidRequest(name, f"must be {bounds}, got {value!r}")


def _integer(name: str, value: Any, low: int, high: int | None = None) -> None:
    if value is None:
        return
    if not _is_int(value) or value < low or (high is not None and value > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise InvalidRequest(name, f"must be an integer {bounds}, got {value!r}")
