"""protobuf <-> folio.serve.schema, at the gRPC edge only (the ingress and the gRPC client)."""

from __future__ import annotations

import json

from folio import EosReason
from folio.proto.folio.v1 import generation_pb2 as pb
from folio.serve.adapters import AdapterInfo
from folio.serve.embedding_payloads import EmbeddingPayload
from folio.serve.errors import InvalidRequest
from folio.serve.schema import (
    DEFAULT_MAX_NEW_TOKENS,
    RESPONSE_FORMATS,
    SAMPLER_FIELDS,
    SAMPLER_LIST_FIELDS,
    Chunk,
    Completion,
    Finish,
    GenerationRequest,
    ModelInfo,
    ResponseFormat,
    Sampling,
    Timings,
    TopTokens,
    Usage,
)

FINISH_REASONS = {
    EosReason.STOP_TOKEN: pb.FINISH_REASON_STOP_TOKEN,
    EosReason.STOP_STRING: pb.FINISH_REASON_STOP_STRING,
    EosReason.MAX_NEW_TOKENS: pb.FINISH_REASON_MAX_NEW_TOKENS,
    EosReason.END_FILTER: pb.FINISH_REASON_END_FILTER,
}
EOS_REASONS = {value: key for key, value in FINISH_REASONS.items()}


# --- requests ---

def request_from_proto(message: pb.GenerateRequest) -> GenerationRequest:
    prompt = message.WhichOneof("prompt")
    if prompt is None:
        raise InvalidRequest("prompt", "give exactly one of text and token_ids")
    negative = message.WhichOneof("negative_prompt")
    return GenerationRequest(
        text=message.text if prompt == "text" else None,
        token_ids=list(message.token_ids.ids) if prompt == "token_ids" else None,
        max_new_tokens=message.max_new_tokens if message.HasField("max_new_tokens") else DEFAULT_MAX_NEW_TOKENS,
        min_new_tokens=message.min_new_tokens,
        sampling=sampling_from_proto(message.sampler),
        stop_strings=tuple(message.stop_strings),
        stop_token_ids=tuple(message.stop_token_ids),
        stop_on_eos=message.stop_on_eos if message.HasField("stop_on_eos") else True,
        seed=message.seed if message.HasField("seed") else None,
        add_bos=message.add_bos if message.HasField("add_bos") else None,
        encode_special_tokens=message.encode_special_tokens,
        decode_special_tokens=message.decode_special_tokens,
        return_probs=message.return_probs,
        return_top_tokens=message.return_top_tokens,
        response_format=response_format_from_proto(message.response_format)
        if message.HasField("response_format") else None,
        filter_prefer_eos=message.filter_prefer_eos,
        banned_strings=tuple(message.banned_strings),
        token_healing=message.token_healing,
        negative_text=message.negative_text if negative == "negative_text" else None,
        negative_token_ids=list(message.negative_token_ids.ids) if negative == "negative_token_ids" else None,
        lora=message.lora or None,
        embeddings=tuple(EmbeddingPayload(e.position, e.rows, e.dtype, e.data) for e in message.embeddings),
    )


def response_format_from_proto(message: pb.ResponseFormat) -> ResponseFormat:
    kind = message.WhichOneof("format")
    if kind is None:
        raise InvalidRequest("response_format", "give exactly one of " + ", ".join(RESPONSE_FORMATS))
    if kind == "choice":
        return ResponseFormat(choice=tuple(message.choice.options))
    return ResponseFormat(**{kind: getattr(message, kind)})


def sampling_from_proto(message: pb.SamplerSettings) -> Sampling:
    values: dict = {name: getattr(message, name) for name in SAMPLER_FIELDS if message.HasField(name)}
    for name in SAMPLER_LIST_FIELDS:
        if message.HasField(name):
            values[name] = tuple(getattr(message, name).values)
    return Sampling(**values, token_bias=dict(message.token_bias))


def request_to_proto(request: GenerationRequest) -> pb.GenerateRequest:
    message = pb.GenerateRequest(
        max_new_tokens=request.max_new_tokens, min_new_tokens=request.min_new_tokens,
        stop_strings=list(request.stop_strings), stop_token_ids=list(request.stop_token_ids),
        stop_on_eos=request.stop_on_eos, encode_special_tokens=request.encode_special_tokens,
        decode_special_tokens=request.decode_special_tokens, return_probs=request.return_probs,
        return_top_tokens=request.return_top_tokens, filter_prefer_eos=request.filter_prefer_eos,
        banned_strings=list(request.banned_strings), token_healing=request.token_healing, lora=request.lora or "")
    for payload in request.embeddings:
        message.embeddings.add(position=payload.position, rows=payload.rows, dtype=payload.dtype,
                               data=payload.data)
    if request.text is not None:
        message.text = request.text
    if request.token_ids is not None:
        message.token_ids.ids.extend(request.token_ids)
    if request.seed is not None:
        message.seed = request.seed
    if request.add_bos is not None:
        message.add_bos = request.add_bos
    s = request.sampling
    for name in SAMPLER_FIELDS:
        if getattr(s, name) is not None:
            setattr(message.sampler, name, getattr(s, name))
    for name in SAMPLER_LIST_FIELDS:
        if getattr(s, name) is not None:
            getattr(message.sampler, name).SetInParent()  # set, even when empty
            getattr(message.sampler, name).values.extend(getattr(s, name))
    for token_id, bias in dict(s.token_bias).items():
        message.sampler.token_bias[token_id] = bias
    if request.negative_text is not None:
        message.negative_text = request.negative_text
    if request.negative_token_ids is not None:
        message.negative_token_ids.ids.extend(request.negative_token_ids)
    fmt = request.response_format
    if fmt is not None:
        if len(fmt.which()) != 1:
            raise InvalidRequest("response_format", "give exactly one of " + ", ".join(RESPONSE_FORMATS))
        for kind in fmt.which():
            value = getattr(fmt, kind)
            if kind == "choice":
                message.response_format.choice.options.extend(value)
            elif kind == "json_schema" and not isinstance(value, str):
                message.response_format.json_schema = json.dumps(value)
            else:
                setattr(message.response_format, kind, value)
    return message


# --- results ---

def _finish_to_proto(finish: Finish, into: pb.Finish) -> None:
    into.reason = FINISH_REASONS.get(finish.reason, pb.FINISH_REASON_UNSPECIFIED)
    if finish.stop_token_id is not None:
        into.stop_token_id = finish.stop_token_id
    if finish.stop_string is not None:
        into.stop_string = finish.stop_string
    u, t = finish.usage, finish.timings
    into.usage.prompt_tokens, into.usage.cached_tokens = u.prompt_tokens, u.cached_tokens
    into.usage.completion_tokens = u.completion_tokens
    into.usage.accepted_draft_tokens = u.accepted_draft_tokens
    into.usage.rejected_draft_tokens = u.rejected_draft_tokens
    into.timings.queued_s, into.timings.prefill_s, into.timings.generate_s = t.queued_s, t.prefill_s, t.generate_s
    into.timings.time_to_first_token_s, into.timings.total_s = t.time_to_first_token_s, t.total_s


def _fill(message: pb.GenerateResponse | pb.GenerateUnaryResponse, text: str, token_ids: list[int],
          token_probs: list[float] | None, top_tokens: list[TopTokens] | None, finish: Finish | None,
          suppressed_text: str) -> None:
    message.text = text
    message.suppressed_text = suppressed_text
    message.token_ids.extend(token_ids)
    if token_probs:
        message.token_probs.extend(token_probs)
    for top in top_tokens or ():
        message.top_tokens.add(token_ids=top.token_ids, probs=top.probs)
    if finish is not None:
        _finish_to_proto(finish, message.finish)


def chunk_to_proto(chunk: Chunk) -> pb.GenerateResponse:
    message = pb.GenerateResponse()
    _fill(message, chunk.text, chunk.token_ids, chunk.token_probs, chunk.top_tokens, chunk.finish,
          chunk.suppressed_text)
    return message


def completion_to_proto(completion: Completion) -> pb.GenerateUnaryResponse:
    message = pb.GenerateUnaryResponse()
    _fill(message, completion.text, completion.token_ids, completion.token_probs, completion.top_tokens,
          completion.finish, completion.suppressed_text)
    return message


def finish_from_proto(message: pb.Finish) -> Finish:
    u, t = message.usage, message.timings
    return Finish(
        reason=EOS_REASONS.get(message.reason, EosReason.ERROR),
        stop_token_id=message.stop_token_id if message.HasField("stop_token_id") else None,
        stop_string=message.stop_string if message.HasField("stop_string") else None,
        usage=Usage(u.prompt_tokens, u.cached_tokens, u.completion_tokens, u.accepted_draft_tokens,
                    u.rejected_draft_tokens),
        timings=Timings(t.queued_s, t.prefill_s, t.generate_s, t.time_to_first_token_s, t.total_s))


def chunk_from_proto(message: pb.GenerateResponse | pb.GenerateUnaryResponse) -> Chunk:
    return Chunk(
        text=message.text, token_ids=list(message.token_ids),
        token_probs=list(message.token_probs) or None,
        top_tokens=[TopTokens(list(t.token_ids), list(t.probs)) for t in message.top_tokens] or None,
        finish=finish_from_proto(message.finish) if message.HasField("finish") else None,
        suppressed_text=message.suppressed_text)


def model_info_to_proto(info: ModelInfo) -> pb.ModelInfoResponse:
    message = pb.ModelInfoResponse(
        model_name=info.model_name, architecture=info.architecture, dtype=info.dtype, vocab_size=info.vocab_size,
        max_seq_len=info.max_request_tokens, page_size=info.page_size, num_pages=info.num_pages,
        max_batch_size=info.max_batch_size, num_replicas=info.num_replicas, eos_token_ids=list(info.eos_token_ids),
        add_bos_token=info.add_bos_token, supported_architectures=list(info.supported_architectures),
        adapters=[adapter_to_proto(a) for a in info.adapters], hidden_size=info.hidden_size,
        weight_format=info.weight_format, kv_format=info.kv_format, bytes_per_page=info.bytes_per_page,
        num_host_pages=info.num_host_pages, host_cache_bytes=info.host_cache_bytes,
        host_write_through=info.host_write_through, tensor_parallel_size=info.tensor_parallel_size)
    if info.bos_token_id is not None:
        message.bos_token_id = info.bos_token_id
    return message


def model_info_from_proto(m: pb.ModelInfoResponse) -> ModelInfo:
    """What a client reads (adapters as dicts: adapter_from_proto); max_seq_len is the server's request limit."""
    return ModelInfo(model_name=m.model_name, architecture=m.architecture, dtype=m.dtype,
                     vocab_size=m.vocab_size, max_seq_len=m.max_seq_len, page_size=m.page_size,
                     num_pages=m.num_pages, max_batch_size=m.max_batch_size, num_replicas=m.num_replicas,
                     eos_token_ids=tuple(m.eos_token_ids),
                     bos_token_id=m.bos_token_id if m.HasField("bos_token_id") else None,
                     add_bos_token=m.add_bos_token, supported_architectures=tuple(m.supported_architectures),
                     adapters=tuple(adapter_from_proto(a) for a in m.adapters), hidden_size=m.hidden_size,
                     weight_format=m.weight_format, kv_format=m.kv_format, bytes_per_page=m.bytes_per_page,
                     num_host_pages=m.num_host_pages, host_cache_bytes=m.host_cache_bytes,
                     host_write_through=m.host_write_through, tensor_parallel_size=m.tensor_parallel_size or 1)


# --- LoRA adapters ---

def adapter_to_proto(info: AdapterInfo) -> pb.LoraAdapter:
    return pb.LoraAdapter(name=info.name, path=info.path, rank=info.rank, scale=info.scale,
                          target_modules=list(info.target_modules))


def adapter_from_proto(message: pb.LoraAdapter) -> dict:
    """A LoraAdapter as a plain dict (what clients read; the adapter id stays on the server)."""
    return {"name": message.name, "path": message.path, "rank": message.rank, "scale": message.scale,
            "target_modules": tuple(message.target_modules)}
