"""Request validation at the ingress: GenerationRequest -> EngineRequest, or InvalidRequest naming the field.

Field names are the API's (the gRPC message's and the Python client's), not the engine's. Everything that can be
checked without the model is checked here, so a bad request never reaches a replica.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from folio import SAMPLER_LIMITS, SamplerSettings, Tokenizer
from folio.serve.embedding_payloads import placed_embeddings
from folio.serve.errors import InvalidRequest
from folio.serve.schema import (
    RESPONSE_FORMATS,
    SAMPLER_FIELDS,
    EngineRequest,
    GenerationRequest,
    ModelInfo,
    ResponseFormat,
    Sampling,
)

MAX_RETURN_TOP_TOKENS = 64
MAX_SEED = (1 << 64) - 1
# Default of ServeConfig.max_constraint_chars: the largest response_format (its JSON Schema, pattern or grammar, or
# its choices together) and the most characters of banned_strings together a request may carry.
DEFAULT_MAX_CONSTRAINT_CHARS = 65536
MAX_CFG_SCALE = 100.0
# A character outside every token's text is still at most 4 UTF-8 bytes per token (unknown / byte-fallback tokens).
MIN_BYTES_PER_TOKEN_BOUND = 4


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on a request's size (ServeConfig's max_* options): each costs a replica time per token, or the
    ingress time before the request can be refused."""

    max_prompt_bytes: int = 1 << 24
    max_stop_strings: int = 32
    max_stop_string_chars: int = 256
    max_list_items: int = 1024
    max_constraint_chars: int = DEFAULT_MAX_CONSTRAINT_CHARS
    max_embedding_bytes: int = 64 << 20


def request_limits(config: Any, tokenizer: Tokenizer, info: ModelInfo) -> RequestLimits:
    """A ServeConfig's limits; without max_prompt_bytes, the longest text that could still fit the context (its
    tokens x the bytes of the longest token): anything longer is refused before tokenizing."""
    max_bytes = config.max_prompt_bytes
    if max_bytes is None:
        max_bytes = info.max_request_tokens * max(MIN_BYTES_PER_TOKEN_BOUND, tokenizer.longest_token_bytes())
    return RequestLimits(max_prompt_bytes=max_bytes, max_stop_strings=config.max_stop_strings,
                         max_stop_string_chars=config.max_stop_string_chars, max_list_items=config.max_list_items,
                         max_constraint_chars=config.max_constraint_chars,
                         max_embedding_bytes=config.max_embedding_bytes)


def check_prompt_bytes(request: GenerationRequest, limits: RequestLimits) -> None:
    """Text prompts within max_prompt_bytes; cheap enough for the event loop (no tokenizing)."""
    for field in ("text", "negative_text"):
        check_text_bytes(field, getattr(request, field), limits)


def check_text_bytes(field: str, text: Any, limits: RequestLimits) -> None:
    if isinstance(text, str) and len(text) * 4 > limits.max_prompt_bytes:  # skip encoding short texts
        num_bytes = len(text.encode("utf-8", errors="surrogatepass"))
        if num_bytes > limits.max_prompt_bytes:
            raise InvalidRequest(field, f"{num_bytes} bytes exceed the server's limit of "
                                        f"{limits.max_prompt_bytes} (longer than the model's context)")


def to_engine_request(request: GenerationRequest, tokenizer: Tokenizer, info: ModelInfo,
                      request_id: str = "", max_constraint_chars: int | None = None,
                      limits: RequestLimits | None = None) -> EngineRequest:
    """`limits` bound the request's size (max_constraint_chars overrides its field of the same name)."""
    limits = limits or RequestLimits()
    if max_constraint_chars is not None:
        limits = dataclasses.replace(limits, max_constraint_chars=max_constraint_chars)
    max_constraint_chars = limits.max_constraint_chars
    check_prompt_bytes(request, limits)
    _check_list_sizes(request, limits)
    input_ids = prompt_ids(request, tokenizer, info)
    _check_lengths(request, len(input_ids), info)
    sampler = sampler_kwargs(request.sampling, info.vocab_size)
    negative_ids = negative_prompt_ids(request, tokenizer, info)
    if (request.sampling.cfg_scale is None) != (negative_ids is None):
        if negative_ids is None:
            raise InvalidRequest("cfg_scale", "classifier-free guidance needs a negative prompt (negative_text or "
                                              "negative_token_ids)")
        raise InvalidRequest("negative_text" if request.negative_text is not None else "negative_token_ids",
                             "a negative prompt needs sampler.cfg_scale")
    if negative_ids is not None:
        _check_lengths(request, len(negative_ids), info, prompt_field="negative prompt")
    response_format = response_format_spec(request.response_format, max_constraint_chars)
    _check_bool("filter_prefer_eos", request.filter_prefer_eos)
    if request.filter_prefer_eos and response_format is None:
        raise InvalidRequest("filter_prefer_eos", "applies only with a response_format")
    banned = _strings("banned_strings", request.banned_strings)
    if sum(map(len, banned)) > max_constraint_chars:
        raise InvalidRequest("banned_strings", f"{sum(map(len, banned))} characters in all exceed the server's "
                                               f"limit of {max_constraint_chars}")
    _check_bool("token_healing", request.token_healing)
    stop_token_ids = _token_ids("stop_token_ids", request.stop_token_ids, info.vocab_size)
    stop_strings = _strings("stop_strings", request.stop_strings)
    _check_bool("stop_on_eos", request.stop_on_eos)
    stop_conditions: tuple[int | str, ...] | None
    if request.stop_on_eos and not stop_token_ids and not stop_strings:
        stop_conditions = None  # the engine's rule: the model's EOS tokens
    else:
        eos = tuple(info.eos_token_ids) if request.stop_on_eos else ()
        stop_conditions = (*dict.fromkeys(eos + tuple(stop_token_ids)), *stop_strings)
    _check_something_to_sample(sampler, request.min_new_tokens, stop_token_ids, info, request.stop_on_eos)
    if request.seed is not None and (not _is_int(request.seed) or not 0 <= request.seed <= MAX_SEED):
        raise InvalidRequest("seed", f"must be an integer in [0, 2**64), got {request.seed!r}")
    limit = min(MAX_RETURN_TOP_TOKENS, info.vocab_size)
    if not _is_int(request.return_top_tokens) or not 0 <= request.return_top_tokens <= limit:
        raise InvalidRequest("return_top_tokens", f"must be in [0, {limit}], got {request.return_top_tokens!r}")
    for name in ("decode_special_tokens", "return_probs"):
        _check_bool(name, getattr(request, name))
    placed = placed_embeddings(request, input_ids, info.hidden_size, limits.max_embedding_bytes,
                               cfg=negative_ids is not None)
    if placed is not None:
        input_ids = list(placed.input_ids)
    return EngineRequest(
        input_ids=tuple(input_ids), max_new_tokens=request.max_new_tokens, min_new_tokens=request.min_new_tokens,
        sampler=sampler, stop_conditions=stop_conditions, seed=request.seed,
        decode_special_tokens=request.decode_special_tokens, return_probs=request.return_probs,
        return_top_tokens=request.return_top_tokens, request_id=request_id, response_format=response_format,
        filter_prefer_eos=request.filter_prefer_eos, banned_strings=tuple(banned),
        token_healing=request.token_healing,
        negative_input_ids=None if negative_ids is None else tuple(negative_ids),
        embeddings=() if placed is None else placed.payloads,
        embeddings_digest="" if placed is None else placed.digest)


def _check_list_sizes(request: GenerationRequest, limits: RequestLimits) -> None:
    """Counts and lengths before any per-item work (a list of a million items is refused in microseconds)."""
    stops = request.stop_strings
    if isinstance(stops, Sequence) and not isinstance(stops, (str, bytes)):
        if len(stops) > limits.max_stop_strings:
            raise InvalidRequest("stop_strings", f"{len(stops)} stop strings exceed the server's limit of "
                                                 f"{limits.max_stop_strings}")
        for i, stop in enumerate(stops):
            if isinstance(stop, str) and len(stop) > limits.max_stop_string_chars:
                raise InvalidRequest("stop_strings", f"[{i}] has {len(stop)} characters; the server's limit is "
                                                     f"{limits.max_stop_string_chars}")
    fmt = request.response_format
    lists = {"stop_token_ids": request.stop_token_ids, "banned_strings": request.banned_strings,
             "token_bias": getattr(request.sampling, "token_bias", None),
             "dry_sequence_breakers": getattr(request.sampling, "dry_sequence_breakers", None),
             "response_format.choice": getattr(fmt, "choice", None) if fmt is not None else None}
    for name, items in lists.items():
        if isinstance(items, (Sequence, Mapping)) and not isinstance(items, (str, bytes)):
            if len(items) > limits.max_list_items:
                raise InvalidRequest(name, f"{len(items)} entries exceed the server's limit of "
                                           f"{limits.max_list_items}")


def prompt_ids(request: GenerationRequest, tokenizer: Tokenizer, info: ModelInfo) -> list[int]:
    has_text, has_ids = request.text is not None, request.token_ids is not None
    if has_text == has_ids:
        raise InvalidRequest("prompt", "give exactly one of text and token_ids"
                             + (", not both" if has_text else ""))
    if has_ids:
        if request.add_bos is not None or request.encode_special_tokens:
            raise InvalidRequest("add_bos" if request.add_bos is not None else "encode_special_tokens",
                                 "applies to text prompts only")
        return _nonempty_ids("token_ids", request.token_ids, "the prompt", info)
    add_bos = tokenizer.add_bos_token if request.add_bos is None else request.add_bos
    _check_bool("add_bos", add_bos)
    if add_bos and tokenizer.bos_token_id is None:
        raise InvalidRequest("add_bos", "the model's tokenizer has no BOS token")
    _check_bool("encode_special_tokens", request.encode_special_tokens)
    return _encoded("text", request.text, "the prompt", request, tokenizer)


def _nonempty_ids(field: str, ids: Sequence[int] | None, what: str, info: ModelInfo) -> list[int]:
    checked = _token_ids(field, ids, info.vocab_size)
    if not checked:
        raise InvalidRequest(field, f"{what} is empty")
    return checked


def _encoded(field: str, text: Any, what: str, request: GenerationRequest, tokenizer: Tokenizer) -> list[int]:
    """A text prompt's ids, encoded as the request says (add_bos, encode_special_tokens, checked by the caller)."""
    if not isinstance(text, str):
        raise InvalidRequest(field, f"must be a string, got {type(text).__name__}")
    if not text:
        raise InvalidRequest(field, f"{what} is empty")
    add_bos = tokenizer.add_bos_token if request.add_bos is None else request.add_bos
    return tokenizer.encode(text, add_bos=add_bos, encode_special_tokens=request.encode_special_tokens)


def negative_prompt_ids(request: GenerationRequest, tokenizer: Tokenizer, info: ModelInfo) -> list[int] | None:
    """Classifier-free guidance's negative prompt as token ids (None without one). It takes the prompt's form, and
    a text one is encoded like the prompt (add_bos, encode_special_tokens)."""
    has_text, has_ids = request.negative_text is not None, request.negative_token_ids is not None
    if not has_text and not has_ids:
        return None
    if has_text and has_ids:
        raise InvalidRequest("negative_prompt", "give at most one of negative_text and negative_token_ids, not both")
    prompt_is_text = request.text is not None
    if has_text != prompt_is_text:
        raise InvalidRequest("negative_text" if has_text else "negative_token_ids",
                             "the negative prompt takes the prompt's form: negative_text with a text prompt, "
                             "negative_token_ids with token_ids")
    if has_ids:
        return _nonempty_ids("negative_token_ids", request.negative_token_ids, "the negative prompt", info)
    return _encoded("negative_text", request.negative_text, "the negative prompt", request, tokenizer)


def response_format_spec(fmt: ResponseFormat | None, max_chars: int) -> tuple[str, Any] | None:
    """(kind, value) for the replica to build its filter from: the JSON Schema as JSON text (checked to be a JSON
    object), the pattern, the grammar, or the choices as a tuple. Compiling is the engine's, on the replica (a
    schema, pattern or grammar the engine's compiler rejects fails there, with INVALID_ARGUMENT and its message);
    this checks what needs no compiler, and the size limit."""
    if fmt is None:
        return None
    if not isinstance(fmt, ResponseFormat):
        raise InvalidRequest("response_format", f"must be a folio.serve.schema.ResponseFormat, got "
                                                f"{type(fmt).__name__}")
    kinds = fmt.which()
    if len(kinds) != 1:
        raise InvalidRequest("response_format", "give exactly one of " + ", ".join(RESPONSE_FORMATS)
                             + (f" (got {', '.join(kinds)})" if kinds else ""))
    kind = kinds[0]
    name = f"response_format.{kind}"
    value = getattr(fmt, kind)
    if kind == "json_schema":
        if isinstance(value, Mapping):
            try:
                value = json.dumps(value)
            except (TypeError, ValueError) as e:
                raise InvalidRequest(name, f"is not serializable as JSON: {e}") from None
        if not isinstance(value, str):
            raise InvalidRequest(name, f"must be a JSON object (or its text), got {type(value).__name__}")
        try:
            parsed = json.loads(value)
        except ValueError as e:
            raise InvalidRequest(name, f"is not valid JSON: {e}") from None
        if not isinstance(parsed, (dict, bool)):
            raise InvalidRequest(name, f"a JSON Schema is an object (or true / false), got {type(parsed).__name__}")
    elif kind == "choice":
        value = tuple(_strings(name, value))
        if not value:
            raise InvalidRequest(name, "needs at least one option")
        if len(set(value)) != len(value):
            raise InvalidRequest(name, "options must be distinct")
    else:
        if not isinstance(value, str) or not value:
            raise InvalidRequest(name, f"must be a non-empty string, got {value!r}")
    size = len(value) if isinstance(value, str) else sum(map(len, value))
    if size > max_chars:
        raise InvalidRequest(name, f"{size} characters exceed the server's limit of {max_chars}")
    return kind, value


def _check_lengths(request: GenerationRequest, num_prompt_tokens: int, info: ModelInfo,
                   prompt_field: str = "prompt") -> None:
    max_new, min_new = request.max_new_tokens, request.min_new_tokens
    if not _is_int(max_new) or max_new < 1:
        raise InvalidRequest("max_new_tokens", f"must be an integer >= 1, got {max_new!r}")
    if not _is_int(min_new) or min_new < 0:
        raise InvalidRequest("min_new_tokens", f"must be an integer >= 0, got {min_new!r}")
    if min_new > max_new:
        raise InvalidRequest("min_new_tokens", f"{min_new} exceeds max_new_tokens ({max_new})")
    limit = info.max_request_tokens
    if num_prompt_tokens >= limit:
        raise InvalidRequest(prompt_field, f"{num_prompt_tokens} tokens leave no room in the model's context of "
                                       f"{limit} tokens")
    if num_prompt_tokens + max_new > limit:
        raise InvalidRequest("max_new_tokens", f"the {prompt_field}'s {num_prompt_tokens} tokens + {max_new} new "
                                               f"tokens exceed the context of {limit} tokens; ask for at most "
                                               f"{limit - num_prompt_tokens}")


# engine field name -> the API's (they differ only for the older penalty fields)
ENGINE_TO_API = {engine: name for name, engine in SAMPLER_FIELDS.items()}


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
    _optional_bool("temperature_last", s.temperature_last)
    if s.dry_sequence_breakers is not None:
        _strings("dry_sequence_breakers", s.dry_sequence_breakers)
    kwargs = s.engine_kwargs()
    # The samplers' own ranges (and how fields relate, e.g. max_temp >= min_temp) are the engine's: build its
    # settings here, so a request the engine would refuse is refused now, naming the field.
    try:
        SamplerSettings(**kwargs)
    except (TypeError, ValueError) as error:
        message = str(error)
        engine_name = message.split(" ", 1)[0].removeprefix("SamplerSettings.").split("[", 1)[0].rstrip(":")
        raise InvalidRequest(ENGINE_TO_API.get(engine_name, engine_name), message) from None
    return s.engine_kwargs()


def _check_something_to_sample(sampler: dict[str, Any], min_new_tokens: int, stop_token_ids: Sequence[int],
                               info: ModelInfo, stop_on_eos: bool) -> None:
    """A token_bias of -inf on every token (with the stop tokens, while they are blocked below min_new_tokens)
    leaves the sampler nothing to pick: the engine refuses such a job at enqueue (folio.validation); refused here
    first, under the API's field. (A finite bias, however negative, on every token shifts them all alike.)"""
    banned = {t for t, bias in sampler.get("token_bias", {}).items() if bias == -math.inf}
    if len(banned) >= info.vocab_size:
        raise InvalidRequest("token_bias", f"bans every token of the vocabulary of {info.vocab_size} (-inf bias): "
                                           "nothing is left to sample")
    stops = set(stop_token_ids) | (set(info.eos_token_ids) if stop_on_eos else set())
    if min_new_tokens > 0 and len(banned | stops) >= info.vocab_size:
        raise InvalidRequest("token_bias", f"the tokens it bans and the stop tokens (blocked until min_new_tokens="
                                           f"{min_new_tokens}) cover the whole vocabulary of {info.vocab_size}: "
                                           "nothing is left to sample")


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


def _strings(name: str, strings: Sequence[str]) -> list[str]:
    if isinstance(strings, (str, bytes)) or not isinstance(strings, Sequence):
        raise InvalidRequest(name, "must be a list of strings")
    out = list(strings)
    for i, s in enumerate(out):
        if not isinstance(s, str) or not s:
            raise InvalidRequest(name, f"[{i}] must be a non-empty string, got {s!r}")
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidRequest(name, f"must be true or false, got {value!r}")


def _optional_bool(name: str, value: Any) -> None:
    if value is not None:
        _check_bool(name, value)


def _real(name: str, value: Any, low: float | None = None, high: float | None = None, open_low: bool = False) -> None:
    if value is None:
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise InvalidRequest(name, f"must be a finite number, got {value!r}")
    below = low is not None and (value <= low if open_low else value < low)
    if below or (high is not None and value > high):
        bounds = f"in {'(' if open_low else '['}{low}, {high}]" if high is not None else f">= {low}"
        raise InvalidRequest(name, f"must be {bounds}, got {value!r}")


def _integer(name: str, value: Any, low: int, high: int | None = None) -> None:
    if value is None:
        return
    if not _is_int(value) or value < low or (high is not None and value > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise InvalidRequest(name, f"must be an integer {bounds}, got {value!r}")
