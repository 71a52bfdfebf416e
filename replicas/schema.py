"""The serving layer's request and result types: plain dataclasses, pickled across Ray, free of protobuf.

    GenerationRequest  what a client asks for (the gRPC GenerateRequest, or folio.serve.client.Client's arguments)
    EngineRequest      what the ingress sends a generator replica: validated and tokenized (a router reads
                       `input_ids` to find the replica holding the prompt's pages)
    ResponseFormat     a request's constraint on its output (JSON Schema, regex, grammar, choice)
    Chunk              one streamed piece of a completion; the last one carries `finish`
    Completion         a whole completion
    ModelInfo          the served model and the limits requests must respect
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from folio import EosReason

DEFAULT_MAX_NEW_TOKENS = 128

# Sampling field -> folio.SamplerSettings keyword.
SAMPLER_FIELDS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "token_repetition_penalty",
    "frequency_penalty": "token_frequency_penalty",
    "presence_penalty": "token_presence_penalty",
    "repetition_range": "token_repetition_range",
    "repetition_decay": "token_repetition_decay",
    # the samplers below keep the engine's names
    "temperature_last": "temperature_last",
    "min_temp": "min_temp",
    "max_temp": "max_temp",
    "temp_exponent": "temp_exponent",
    "smoothing_factor": "smoothing_factor",
    "top_a": "top_a",
    "tfs": "tfs",
    "typical": "typical",
    "skew": "skew",
    "mirostat": "mirostat",
    "mirostat_tau": "mirostat_tau",
    "mirostat_eta": "mirostat_eta",
    "dry_multiplier": "dry_multiplier",
    "dry_base": "dry_base",
    "dry_allowed_length": "dry_allowed_length",
    "dry_range": "dry_range",
    "dry_max_ngram": "dry_max_ngram",
    "xtc_threshold": "xtc_threshold",
    "xtc_probability": "xtc_probability",
    "cfg_scale": "cfg_scale",
}
# Sampling fields that are not scalars (each converted on its own): field -> folio.SamplerSettings keyword.
SAMPLER_LIST_FIELDS = {"dry_sequence_breakers": "dry_sequence_breakers"}
# The ResponseFormat kinds, in the proto's oneof order, and the folio.constrain filter each builds.
RESPONSE_FORMATS = {"json_schema": "JsonSchemaFilter", "regex": "RegexFilter", "grammar": "GrammarFilter",
                    "choice": "ChoiceFilter"}


@dataclass(frozen=True)
class Sampling:
    """Sampler settings; None leaves the engine's default (folio.SamplerSettings)."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_range: int | None = None
    repetition_decay: int | None = None
    token_bias: Mapping[int, float] = field(default_factory=dict)
    temperature_last: bool | None = None
    min_temp: float | None = None
    max_temp: float | None = None
    temp_exponent: float | None = None
    smoothing_factor: float | None = None
    top_a: float | None = None
    tfs: float | None = None
    typical: float | None = None
    skew: float | None = None
    mirostat: int | None = None  # 0 off, 1 or 2
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_sequence_breakers: Sequence[str] | None = None  # None: the engine's defaults; () none at all
    dry_range: int | None = None
    dry_max_ngram: int | None = None
    xtc_threshold: float | None = None
    xtc_probability: float | None = None
    cfg_scale: float | None = None  # classifier-free guidance; needs GenerationRequest's negative prompt

    def engine_kwargs(self) -> dict[str, Any]:
        """folio.SamplerSettings keyword arguments for the fields that are set."""
        kwargs = {engine: getattr(self, name) for name, engine in SAMPLER_FIELDS.items()
                  if getattr(self, name) is not None}
        for name, engine in SAMPLER_LIST_FIELDS.items():
            if getattr(self, name) is not None:
                kwargs[engine] = tuple(getattr(self, name))
        if self.token_bias:
            kwargs["token_bias"] = dict(self.token_bias)
        return kwargs


@dataclass(frozen=True)
class ResponseFormat:
    """What the completion must be: exactly one of a JSON Schema (a dict, or its JSON text), a regular expression
    (the whole completion matches it), a Lark grammar, or a list of choices (the completion is one of them)."""

    json_schema: Mapping[str, Any] | str | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: Sequence[str] | None = None

    def which(self) -> list[str]:
        """The kinds that are set (exactly one in a valid request)."""
        return [name for name in RESPONSE_FORMATS if getattr(self, name) is not None]


@dataclass(frozen=True)
class GenerationRequest:
    """A completion request: exactly one of `text` and `token_ids`."""

    text: str | None = None
    token_ids: Sequence[int] | None = None
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: int = 0
    sampling: Sampling = field(default_factory=Sampling)
    stop_strings: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    stop_on_eos: bool = True
    seed: int | None = None
    add_bos: bool | None = None  # None: the tokenizer's convention
    encode_special_tokens: bool = False
    decode_special_tokens: bool = False
    return_probs: bool = False
    return_top_tokens: int = 0
    response_format: ResponseFormat | None = None
    filter_prefer_eos: bool = False  # with response_format: end as soon as it allows an EOS token
    banned_strings: Sequence[str] = ()
    token_healing: bool = False
    # classifier-free guidance (with sampling.cfg_scale): the negative prompt, in the prompt's form
    negative_text: str | None = None
    negative_token_ids: Sequence[int] | None = None
    lora: str | None = None  # a loaded LoRA adapter's name (ListLoras); None: the base model
    # injected embeddings (folio.serve.embedding_payloads.EmbeddingPayload), with a token_ids prompt only
    embeddings: Sequence[Any] = ()


@dataclass(frozen=True)
class EngineRequest:
    """A validated, tokenized request for one generator replica."""

    input_ids: tuple[int, ...]
    max_new_tokens: int
    min_new_tokens: int = 0
    sampler: Mapping[str, Any] = field(default_factory=dict)  # folio.SamplerSettings keyword arguments
    stop_conditions: tuple[int | str, ...] | None = None  # None: the model's EOS tokens (folio.DynamicJob's rule)
    seed: int | None = None
    decode_special_tokens: bool = False
    return_probs: bool = False
    return_top_tokens: int = 0
    request_id: str = ""
    # ("json_schema" | "regex" | "grammar" | "choice", the JSON text / pattern / grammar / tuple of options)
    response_format: tuple[str, Any] | None = None
    filter_prefer_eos: bool = False
    banned_strings: tuple[str, ...] = ()
    token_healing: bool = False
    negative_input_ids: tuple[int, ...] | None = None  # classifier-free guidance's negative prompt
    lora: str | None = None  # the adapter's name, and its id as the ingress saw it in the registry: the replica
    lora_adapter_id: str = ""  # runs the job only with that adapter, and the router hashes the prompt with it
    # folio.InjectedEmbeddings placed in input_ids by the ingress, and their digest (hex; the router's namespace)
    embeddings: tuple[Any, ...] = ()
    embeddings_digest: str = ""
    # The prompt as text, for routers that match text: Ray's PrefixCacheAffinityRouter reads `.prompt` of the first
    # argument. The ingress fills it only when the configured router needs it (ours hashes input_ids).
    prompt: str = ""
    # False: the replica sends the completion as one Chunk when it ends -- one message through Ray for a unary call
    # instead of one per engine step.
    stream: bool = True
    # A streamed request's chunks go to this ingress's token channel (folio.serve.token_channel, "host:port/secret")
    # instead of the call's Ray stream; "": the Ray stream.
    reply_to: str = ""


@dataclass
class TopTokens:
    token_ids: list[int]
    probs: list[float]


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    completion_tokens: int = 0  # tokens sampled, a final stop token included
    # Speculative decoding: drafted tokens the target accepted (counted in completion_tokens too) and rejected
    # (computed, then dropped); both 0 without a drafter.
    accepted_draft_tokens: int = 0
    rejected_draft_tokens: int = 0


@dataclass
class Timings:
    queued_s: float = 0.0  # in the engine's queue
    prefill_s: float = 0.0  # first prompt chunk to first token
    generate_s: float = 0.0  # first token to last token
    time_to_first_token_s: float = 0.0  # the request reached the server (ingress) to its first token
    total_s: float = 0.0  # the request reached the server to its end


@dataclass
class Finish:
    reason: EosReason
    stop_token_id: int | None = None
    stop_string: str | None = None
    usage: Usage = field(default_factory=Usage)
    timings: Timings = field(default_factory=Timings)
    replica_id: str = ""  # the generator replica that ran the request (diagnostics; not sent over gRPC)


@dataclass
class Chunk:
    """Text and tokens released by one engine step (several steps' worth when the consumer fell behind)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    token_probs: list[float] | None = None
    top_tokens: list[TopTokens] | None = None
    finish: Finish | None = None
    suppressed_text: str = ""  # banned strings: text taken back by this step (never part of `text`)

    def extend(self, other: Chunk) -> None:
        self.text += other.text
        self.suppressed_text += other.suppressed_text
        self.token_ids.extend(other.token_ids)
        if other.token_probs is not None:
            self.token_probs = (self.token_probs or []) + other.token_probs
        if other.top_tokens is not None:
            self.top_tokens = (self.top_tokens or []) + other.top_tokens
        if other.finish is not None:
            self.finish = other.finish


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish: Finish
    token_probs: list[float] | None = None
    top_tokens: list[TopTokens] | None = None
    suppressed_text: str = ""  # banned strings: all the text taken back

    @classmethod
    def from_chunks(cls, chunks: Iterable[Chunk]) -> Completion:
        whole = Chunk()
        for chunk in chunks:
            whole.extend(chunk)
        if whole.finish is None:
            raise RuntimeError("the stream ended without its final chunk")
        return cls(text=whole.text, token_ids=whole.token_ids, finish=whole.finish,
                   token_probs=whole.token_probs, top_tokens=whole.top_tokens, suppressed_text=whole.suppressed_text)


@dataclass(frozen=True)
class ModelInfo:
    model_name: str
    architecture: str
    dtype: str
    vocab_size: int  # token ids a request may use: the tokenizer's and the model's, whichever is smaller
    max_seq_len: int  # prompt + max_new_tokens of one request, at most
    page_size: int
    num_pages: int  # per replica
    max_batch_size: int
    num_replicas: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    add_bos_token: bool
    supported_architectures: tuple[str, ...] = ()  # what this server's folio can load
    hidden_size: int = 0  # values per row of injected embeddings
    adapters: tuple[Any, ...] = ()  # folio.serve.adapters.AdapterInfo: filled by the ingress, per call
    # The replica's memory formats ("" where not reported): weight_format "fp8" / "dense"; kv_format the cache's
    # (folio.kv_formats: "bf16", "q8", ...); bytes_per_page of the KV cache (K and V, every layer, scales included)
    weight_format: str = ""
    kv_format: str = ""
    bytes_per_page: int = 0
    num_host_pages: int = 0  # the host tier's page slots per replica (0: none)
    host_cache_bytes: int = 0  # the host memory they take
    host_write_through: bool = False  # whether the host tier copies pages once computed (else as evicted)
    tensor_parallel_size: int = 1  # GPUs (processes) each replica's model is split over

    @property
    def max_request_tokens(self) -> int:
        """prompt + max_new_tokens must not exceed this: the context, and what one replica's cache holds."""
        return min(self.max_seq_len, self.num_pages * self.page_size)


def make_request(prompt: str | Sequence[int], **options: Any) -> GenerationRequest:
    """A GenerationRequest from a prompt (text, or token ids) and options: GenerationRequest's fields, Sampling's
    fields as keywords (temperature=0.7, top_p=0.9, ...), or sampling=Sampling(...)."""
    request_fields = {f.name for f in dataclasses.fields(GenerationRequest)} - {"text", "token_ids", "sampling"}
    sampling_fields = {f.name for f in dataclasses.fields(Sampling)}
    unknown = set(options) - request_fields - sampling_fields - {"sampling"}
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(sorted(unknown))}")
    sampling = options.pop("sampling", None)
    flat = {k: options.pop(k) for k in list(options) if k in sampling_fields}
    if sampling is not None and flat:
        raise TypeError("give sampler settings either as sampling=Sampling(...) or as keywords, not both")
    sampling = sampling if sampling is not None else Sampling(**flat)
    if isinstance(prompt, str):
        return GenerationRequest(text=prompt, sampling=sampling, **options)
    return GenerationRequest(token_ids=list(prompt), sampling=sampling, **options)
