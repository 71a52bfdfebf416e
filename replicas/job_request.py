"""An EngineRequest as folio.DynamicJob's keyword arguments (its sampler settings and response-format filter), and
what the engine raises for a job as the request's error.

A feature the request uses but this replica's folio lacks (an ingress newer than its replicas, during an upgrade)
raises Unimplemented naming the field: a request's setting is never accepted and dropped.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import re
from typing import Any

from folio import DynamicJob, DynamicJobAsync, GeneratorClosed, QueueFull, SamplerSettings
from folio.constrain.base import FilterError
from folio.serve.errors import (
    InternalError,
    InvalidRequest,
    Overloaded,
    ReplicaUnavailable,
    RequestError,
    Unimplemented,
)
from folio.serve.schema import RESPONSE_FORMATS, SAMPLER_FIELDS, SAMPLER_LIST_FIELDS, EngineRequest

logger = logging.getLogger(__name__)


def job_kwargs_of(request: EngineRequest) -> dict[str, Any]:
    """folio.DynamicJob's keyword arguments for a validated request (checked against the API by the ingress).
    Features are passed only when the request uses them, and one this engine lacks raises Unimplemented naming the
    field: a request's setting is never accepted and dropped."""
    kwargs: dict[str, Any] = dict(
        input_ids=list(request.input_ids), max_new_tokens=request.max_new_tokens,
        min_new_tokens=request.min_new_tokens, gen_settings=sampler_settings(request.sampler),
        stop_conditions=None if request.stop_conditions is None else list(request.stop_conditions),
        seed=request.seed, decode_special_tokens=request.decode_special_tokens, return_probs=request.return_probs,
        return_top_tokens=request.return_top_tokens, identifier=request.request_id)
    if request.response_format is not None:
        _require_job_option("filters", "response_format")
        kwargs["filters"] = [build_filter(*request.response_format)]
        if request.filter_prefer_eos:
            _require_job_option("filter_prefer_eos", "filter_prefer_eos")
            kwargs["filter_prefer_eos"] = True
    if request.banned_strings:
        _require_job_option("banned_strings", "banned_strings")
        kwargs["banned_strings"] = list(request.banned_strings)
    if request.token_healing:
        _require_job_option("token_healing", "token_healing")
        kwargs["token_healing"] = True
    if request.embeddings:
        _require_job_option("embeddings", "embeddings")
        kwargs["embeddings"] = list(request.embeddings)
    if request.lora is not None:
        _require_job_option("lora", "lora")
        kwargs["lora"] = request.lora
    if request.negative_input_ids is not None:
        # classifier-free guidance: the positive and the negative prompt, one batch row each
        kwargs["input_ids"] = [list(request.input_ids), list(request.negative_input_ids)]
    return kwargs


_ENGINE_TO_API = {**{engine: name for name, engine in SAMPLER_FIELDS.items()},
                  **{engine: name for name, engine in SAMPLER_LIST_FIELDS.items()}, "token_bias": "token_bias"}


def sampler_settings(kwargs: dict[str, Any]) -> SamplerSettings:
    known = {f.name for f in dataclasses.fields(SamplerSettings)}
    for engine_name in kwargs:
        if engine_name not in known:
            raise Unimplemented(_ENGINE_TO_API.get(engine_name, engine_name),
                                "this server's engine does not support this sampler setting")
    try:
        return SamplerSettings(**kwargs)
    except (TypeError, ValueError) as e:
        raise InvalidRequest("sampler", str(e)) from None


def build_filter(kind: str, value: Any) -> Any:
    """The folio.constrain filter of a response_format (not compiled yet: the engine binds it at enqueue)."""
    import folio.constrain as constrain

    name = RESPONSE_FORMATS[kind]
    cls = getattr(constrain, name, None)
    if cls is None:
        raise Unimplemented(f"response_format.{kind}", f"this server's engine has no folio.constrain.{name}")
    try:
        return cls(list(value) if kind == "choice" else value)
    except FilterError as e:  # a constructor that checks (or compiles) eagerly
        raise InvalidRequest(f"response_format.{kind}", str(e)) from None


def _require_job_option(option: str, field: str) -> None:
    if option not in inspect.signature(DynamicJob).parameters:
        raise Unimplemented(field, f"this server's engine does not support it (folio.DynamicJob has no {option})")


def constraint_field(request: EngineRequest) -> str | None:
    if request.response_format is not None:
        return f"response_format.{request.response_format[0]}"
    if request.banned_strings:
        return "banned_strings"
    if request.token_healing:
        return "token_healing"
    return None


# the engine's name for a job field, as its enqueue-time checks (folio.validation, DynamicJob) start their messages
# -> the API's
_JOB_FIELDS = {"gen_settings.token_bias": "token_bias", "stop_conditions": "stop_token_ids", "input_ids": "prompt",
               "prompt": "prompt", "max_new_tokens": "max_new_tokens", "min_new_tokens": "min_new_tokens",
               "return_top_tokens": "return_top_tokens", "token_healing": "token_healing"}


def refused_job(error: Exception) -> InvalidRequest:
    """The engine refused the job at enqueue (ValueError / TypeError, naming its field): INVALID_ARGUMENT under
    the API's field name ("request" where the message names none of them)."""
    message = str(error)
    head = re.split(r"[ :=\[(]", message, maxsplit=1)[0]
    return InvalidRequest(_JOB_FIELDS.get(head, "request"), message)


def request_error(error: BaseException, job: DynamicJobAsync) -> RequestError:
    if isinstance(error, RequestError):
        return error
    constraint = getattr(job, "constraint_field", None)
    if constraint is not None and isinstance(error, FilterError):
        # the request's filter did not compile (raised by bind, at enqueue), or allows no token (the engine's
        # error for a filtered job with nothing left to pick): the request's constraints, not the server, failed it
        generated = job.job.new_tokens
        if generated == 0 and isinstance(error, FilterError):
            return InvalidRequest(constraint, str(error))
        return InvalidRequest(constraint, f"no token satisfies the constraint after {generated} generated tokens "
                                          f"({error})")
    if isinstance(error, GeneratorClosed):
        return ReplicaUnavailable("the replica shut down before the request finished; retry")
    if isinstance(error, QueueFull):
        return Overloaded(str(error))
    logger.error("request %r failed in the engine", job.job.identifier, exc_info=error)
    return InternalError(f"the engine failed this request ({type(error).__name__}); "
                         f"request id {job.job.identifier!r}")
