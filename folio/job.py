"""DynamicJob: one request — its settings, and what happens to each token it samples.

A job never touches pages or tensors beyond the rows handed to it: its runtime state lives in its
`folio.sequence.Sequence`, text handling in `folio.text`. This module turns sampled tokens into typed results.
"""

from __future__ import annotations

import enum
import random
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from folio import cfg
from folio import embeddings as injected
from folio.banned import BannedStrings, BannedTextStream, validate_banned_strings
from folio.constrain.base import Filter
from folio.constrain.healing import HealingFilter
from folio.job_inputs import as_filters, as_token_list, check_counts, split_stop_conditions
from folio.results import EosReason, PrefillResult, StartedResult, StreamingResult, merge_into
from folio.sampling import SamplerSettings
from folio.text import TextStream

if TYPE_CHECKING:
    import torch

    from folio.embeddings import InjectedEmbeddings
    from folio.sequence import Sequence
    from folio.tokenizer import Tokenizer


class JobState(str, enum.Enum):
    """What a job's user sees of it (the engine's own record is folio.sequence.SeqStatus)."""

    NEW = "new"
    PENDING = "pending"
    ACTIVE = "active"
    FINISHED = "finished"
    CANCELLED = "cancelled"


@dataclass(slots=True)  # (one per sampled token)
class TokenExtras:
    """What a sampled token carries besides its id, held until the text pipeline releases the token."""

    prob: float | None
    top_k_tokens: list[int] | None
    top_k_probs: list[float] | None
    logits: torch.Tensor | None


NO_EXTRAS = TokenExtras(None, None, None, None)  # (shared: nothing changes a token's extras once made)


class DynamicJob:
    """One generation request.

    `stop_conditions`: token ids (int) and stop strings (str). `None` stops on the tokenizer's EOS tokens; pass an
    empty list to disable stopping on EOS. Stop tokens are blocked while fewer than `min_new_tokens` tokens have been
    sampled; stop strings always apply.
    `max_skips`: how many times later jobs may be admitted ahead of this one while it waits for room (None: no limit).
    `filters`: folio.constrain.Filter objects (each belongs to this job) that constrain every sampled token; the
    job ends with EOS reason "end_filter" when one's output is complete. `filter_prefer_eos`: when a filter
    allows an EOS token, pick it (end as early as the filter allows).
    `banned_strings`: strings the output never contains, matched case-insensitively (folio.banned): text that could
    start one is held back; when one matches, the job rolls back to the token where it began and picks another
    token there (each result reports what was dropped in `suppressed_text` / `suppressed_tokens`). Such a job does
    not draft, and a step in which it samples is not launched ahead nor emitted a step late. When every token at a
    position leads into a banned string, the job fails.
    `token_healing`: the last prompt token is taken off `input_ids` (kept as `healing_token_id`) and generated
    again as a token whose bytes start with its bytes (folio.constrain.healing); only the bytes it adds are output
    as text. The healed token is not counted in max_new_tokens, min_new_tokens nor the final `new_tokens`; the
    job's filters start at the token after it. A prompt of one token cannot heal: ValueError.
    `embeddings`: folio.InjectedEmbeddings whose rows replace their placeholder ids in input_ids (multimodal front
    ends; folio.embeddings says how, and which combinations are refused).
    `lora`: the name of a LoRA adapter loaded into the generator (`load_lora`) that this job runs with (None: the
    base model). Unknown names are refused at enqueue; the job keeps the adapter until it ends (folio.lora).
    """

    def __init__(
        self,
        input_ids: Any,
        max_new_tokens: int,
        min_new_tokens: int = 0,
        stop_conditions: Sequence[int | str] | None = None,
        gen_settings: SamplerSettings | None = None,
        seed: int | None = None,
        identifier: Any = None,
        decode_special_tokens: bool = False,
        return_probs: bool = False,
        return_top_tokens: int = 0,
        return_logits: bool = False,
        max_skips: int | None = 4,
        filters: Sequence[Filter] = (),
        filter_prefer_eos: bool = False,
        banned_strings: Sequence[str] | None = None,
        token_healing: bool = False,
        embeddings: Sequence[InjectedEmbeddings] | None = None,
        lora: str | None = None,
    ):
        # two prompts (positive, negative): classifier-free guidance (folio.cfg)
        self.input_ids, self.cfg_negative_ids = cfg.split_prompts(input_ids, as_token_list)
        self.embeddings = injected.for_prompt(embeddings, self.input_ids, token_healing=token_healing,
                                              cfg=self.cfg_negative_ids is not None)
        if lora is not None and not isinstance(lora, str):
            raise ValueError(f"lora must be an adapter name (str) or None, got {type(lora).__name__}")
        self.lora = lora
        self.lora_adapter = None  # the folio.lora.LoraAdapter named by `lora`, resolved at enqueue
        self.healing_token_id: int | None = None
        if token_healing:
            if len(self.input_ids) < 2:
                raise ValueError("token_healing needs a prompt of at least 2 tokens (the last one is generated "
                                 "again, and something must come before it)")
            self.healing_token_id = self.input_ids.pop()
        check_counts(max_new_tokens, min_new_tokens, return_top_tokens, max_skips, gen_settings)
        self.max_new_tokens = max_new_tokens
        self.min_new_tokens = min_new_tokens
        self.gen_settings = gen_settings if gen_settings is not None else SamplerSettings()
        cfg.check_job(self.cfg_negative_ids, self.gen_settings.cfg_scale)
        if token_healing and self.cfg_negative_ids is not None:
            raise ValueError("token_healing with classifier-free guidance: the healed token would be appended to "
                             "the negative prompt too, which was not cut; use one or the other")
        self.seed = seed if seed is not None else random.getrandbits(63)
        self.identifier = identifier
        self.decode_special_tokens = decode_special_tokens
        self.return_probs = return_probs
        self.return_top_tokens = return_top_tokens
        self.return_logits = return_logits
        self.max_skips = max_skips
        self.filters = as_filters(filters)
        self.filter_prefer_eos = bool(filter_prefer_eos)
        self.banned_strings = validate_banned_strings(banned_strings)
        self._banned = BannedStrings(self.banned_strings) if self.banned_strings else None
        self._healing = HealingFilter(self.healing_token_id) if self.healing_token_id is not None else None
        self.heals = self._healing is not None  # (read per token, as the next lines)
        self.may_constrain = bool(self.filters) or self.heals  # some token of it may take a filter's mask
        self.max_sampled_tokens = max_new_tokens + self.heals  # what the engine samples at most: the healed token too
        self.stop_tokens, self.stop_strings = split_stop_conditions(stop_conditions)
        self._stop_on_eos = stop_conditions is None

        # Set when the job is enqueued.
        self.serial: int | None = None
        self.state = JobState.NEW
        self.new_tokens = 0
        self.generated_ids: list[int] = []
        self._completion: list[str] = []  # released text, piece by piece (full_completion joins it)
        self._tokenizer: Tokenizer | None = None
        self._text: TextStream | None = None
        self._held: deque[TokenExtras] = deque()  # extras of tokens held back, for a job that reports or bans
        self._keeps_extras = bool(return_probs or return_top_tokens or return_logits or self._banned)
        self.time_enqueue: float | None = None
        self.time_first_prefill: float | None = None
        self.time_first_token: float | None = None
        self.time_last_token: float | None = None
        self.sequence: Sequence | None = None  # the engine's runtime record of this job, set at enqueue
        # speculative decoding: drafted tokens the target accepted, and those it rejected
        self.accepted_draft_tokens = 0
        self.rejected_draft_tokens = 0

    # --- constraints ---

    def active_filters(self) -> tuple[Filter, ...]:
        """The filters that constrain this job's next token (their bitmasks are intersected): with token healing,
        the healing filter alone for the first sampled token, then the job's own."""
        if self.sequence is not None and self._heals_at(self.sequence.num_sampled):
            return (self._healing,)
        return self.filters

    def _heals_at(self, token_idx: int) -> bool:  # (the healed token: the healing filter alone constrains it)
        return self.heals and token_idx == 0

    def _stops_blocked_at(self, token_idx: int) -> bool:  # (min_new_tokens does not count the healed token)
        return token_idx - self.heals < self.min_new_tokens

    def constrained_at(self, token_idx: int) -> bool:
        """The job's token_idx-th sampled token has a mask beyond its filters and banned strings: the healing
        filter's (active_filters), or blocked stop tokens (blocked_ids_at)."""
        return self._heals_at(token_idx) or (bool(self.stop_tokens) and self._stops_blocked_at(token_idx))

    @property
    def full_completion(self) -> str:
        """The text released so far (kept in pieces: appended to one string, it cost a copy of itself per token)."""
        self._completion[:] = ["".join(self._completion)]
        return self._completion[0]

    @property
    def rolls_back(self) -> bool:
        """Emitting a token may undo tokens already sampled (banned strings): the engine hands this job's tokens
        over as soon as they are sampled and plans its next step after that."""
        return self._banned is not None

    @property
    def takes_drafts(self) -> bool:
        """Speculative decoding may draft for this job: not when it reports per-token probabilities, top tokens
        or logits (those are reported for the sampled token of a one-token row), nor when filters constrain it
        (a mask is computed per sampled position, from the filter's state after the previous token), nor when it
        bans strings (a rollback must come before anything is computed past the tokens it undoes), nor when its
        sampling keeps state from token to token (mirostat, DRY, skew: verify rows do not apply them)."""
        return not (self.return_probs or self.return_top_tokens or self.return_logits or self.filters
                    or self.rolls_back or not self.gen_settings.speculation_safe)

    def blocked_ids_at(self, token_idx: int) -> tuple[int, ...]:
        """Tokens the sampler must not pick as this job's token_idx-th sampled token (the healed one counts):
        stop tokens below min_new_tokens, and tokens that began a banned string there."""
        stops = self._stops_blocked_at(token_idx)
        explored = self._banned.blocked_at(token_idx) if self._banned is not None else ()
        if not explored:
            return tuple(self.stop_tokens) if stops else ()
        return tuple(sorted(set(explored) | self.stop_tokens)) if stops else tuple(sorted(explored))

    def rejected_at(self, token_idx: int) -> frozenset[int]:
        """Tokens that began a banned string as the token_idx-th sampled token (blocked there)."""
        return frozenset(self._banned.blocked_at(token_idx)) if self._banned is not None else frozenset()

    def rollback_filters(self, num_sampled: int, num_tokens: int) -> None:
        """The engine undid the last num_tokens of the num_sampled tokens it had sampled: undo them in the
        filters (which were not fed the healed token)."""
        first_filtered = int(self.heals)
        num_fed = max(0, num_sampled - max(num_sampled - num_tokens, first_filtered))
        if num_fed:
            for f in self.filters:
                f.rollback(num_fed)

    def feed_filters(self, token_id: int) -> bool:
        """The engine sampled token_id for this job: advance its filters. True when a filter's output is complete
        (the job ends with EOS reason "end_filter"). A token a filter rejects raises FilterError."""
        finished = False
        for f in self.active_filters():
            f.feed(token_id)
            finished |= f.is_finished()
        return finished

    # --- lifecycle, driven by the generator ---

    def bind(self, serial: int, tokenizer: Tokenizer, vocab_size: int | None = None) -> None:
        self.serial = serial
        self._tokenizer = tokenizer
        if self._stop_on_eos:
            self.stop_tokens = frozenset(tokenizer.eos_token_ids)
        if self._banned is not None:
            self._text = BannedTextStream(tokenizer, self._banned, self.stop_strings, self.decode_special_tokens)
        else:
            self._text = TextStream(tokenizer, self.stop_strings, self.decode_special_tokens)
        if self._healing is not None:
            self._healing.bind(tokenizer, vocab_size if vocab_size is not None else tokenizer.vocab_size)
        self.state = JobState.PENDING
        self.time_enqueue = time.monotonic()

    @property
    def prompt_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose K/V came from the prefix cache at admission."""
        return self.sequence.num_prefix_hit_tokens if self.sequence is not None else 0

    @property
    def cached_pages(self) -> int:
        return self.sequence.num_prefix_hit_pages if self.sequence is not None else 0

    def started_result(self) -> StartedResult:
        return StartedResult(job=self, serial=self.serial, identifier=self.identifier)

    def _note_first_prefill(self, now: float) -> None:
        """The job's wait in the queue ended when its first chunk was planned (its sequence knows when), not when
        that chunk's forward ended: prefill time counts from there."""
        if self.time_first_prefill is None:
            planned = self.sequence.time_first_chunk if self.sequence is not None else None
            self.time_first_prefill = planned if planned is not None else now

    def prefill_result(self, curr_progress: int, max_progress: int) -> PrefillResult:
        self._note_first_prefill(time.monotonic())
        return PrefillResult(job=self, serial=self.serial, identifier=self.identifier,
                             curr_progress=curr_progress, max_progress=max_progress)

    def receive_token(self, token_id: int, extras: TokenExtras, filter_ended: bool = False) -> StreamingResult:
        """Run one sampled token through stop checks and the text pipeline; return its result (eos set when the
        job ends). Stop tokens are not part of the text; text held before them is released. filter_ended: the
        job's filter completed with this token (EOS reason "end_filter"; a stop token that completes it is not part
        of the text either)."""
        now = time.monotonic()
        if self.time_first_token is None:
            self.time_first_token = now
            self._note_first_prefill(now)
        self.time_last_token = now
        self.new_tokens += 1
        self.generated_ids.append(token_id)

        # The sampler blocks stop tokens below min_new_tokens, so one arriving here ends the job.
        if token_id in self.stop_tokens:
            event = self._text.flush()
            result = self._released(event.text, event.token_ids)
            reason = EosReason.END_FILTER if filter_ended else EosReason.STOP_TOKEN
            return self._finish(result, reason, token_id=token_id)

        if self._keeps_extras:  # (until the text releases the token)
            self._held.append(extras)
        healed = self.heals and self.new_tokens == 1
        text = None if healed else self._text.push_text(token_id)
        if text is not None:  # (the usual token: all of its text released, no stop or banned string possible)
            result = self._released(text, [token_id])
            if self.new_tokens >= self.max_sampled_tokens or filter_ended:
                return self._ended(result, filter_ended)
            return result
        event = self._text.push(token_id, self._healing.num_skipped_bytes() if healed else 0)
        if event.suppressed_token_ids:
            return self._banned_rollback(event)
        result = self._released(event.text, event.token_ids)
        if self._banned is not None:
            self._banned.forget_before(self.new_tokens - len(self._held))
        if event.stop_string is not None:
            result.held_text = event.held_text
            return self._finish(result, EosReason.STOP_STRING, string=event.stop_string)
        if filter_ended or self.new_tokens >= self.max_sampled_tokens:
            return self._ended(result, filter_ended)
        return result

    def _ended(self, result: StreamingResult, filter_ended: bool) -> StreamingResult:
        """The job ends with this token (its filter completed, or max_new_tokens): the held text goes too."""
        tail = self._text.flush()
        merge_into(result, self._released(tail.text, tail.token_ids))
        return self._finish(result, EosReason.END_FILTER if filter_ended else EosReason.MAX_NEW_TOKENS)

    def error_result(self, error: BaseException) -> StreamingResult:
        result = StreamingResult(job=self, serial=self.serial, identifier=self.identifier)
        result.error = error
        return self._finish(result, EosReason.ERROR)

    # --- helpers ---

    def _banned_rollback(self, event) -> StreamingResult:
        """A banned string matched: the text stream has undone the tokens from the one where it began; undo them
        here (the engine undoes them in the sequence when it sees suppressed_tokens) and reject that token there."""
        num_tokens = len(event.suppressed_token_ids)
        for _ in range(num_tokens):
            self._held.pop()
        del self.generated_ids[len(self.generated_ids) - num_tokens:]
        self.new_tokens -= num_tokens
        self._banned.reject(self.new_tokens, event.suppressed_token_ids[0])
        result = StreamingResult(job=self, serial=self.serial, identifier=self.identifier)
        result.suppressed_text = event.suppressed_text
        result.suppressed_tokens = list(event.suppressed_token_ids)
        if self.return_probs:
            result.token_probs = []
        if self.return_top_tokens:
            result.top_k_tokens, result.top_k_probs = [], []
        return result

    def _released(self, text: str, token_ids: list[int]) -> StreamingResult:
        self._completion.append(text)
        result = StreamingResult.released(self, self.serial, self.identifier, text, list(token_ids))
        if not self._keeps_extras:
            return result
        extras = [self._held.popleft() for _ in token_ids]
        if self.return_probs:
            result.token_probs = [e.prob for e in extras]
        if self.return_top_tokens:
            result.top_k_tokens = [e.top_k_tokens for e in extras]
            result.top_k_probs = [e.top_k_probs for e in extras]
        if self.return_logits:
            import torch

            rows = [e.logits for e in extras]
            result.logits = torch.stack(rows) if rows else None
        return result

    def _finish(self, result: StreamingResult, reason: EosReason, token_id: int | None = None,
                string: str | None = None) -> StreamingResult:
        self.state = JobState.FINISHED
        self._held.clear()
        result.eos = True
        result.eos_reason = reason
        if token_id is not None:
            result.eos_triggering_token_id = token_id
            result.eos_triggering_token_str = self._tokenizer.id_to_piece(token_id)
        result.eos_triggering_string = string
        result.full_completion = self.full_completion
        result.new_tokens = self.new_tokens - (self.heals and self.new_tokens > 0)
        result.prompt_tokens = self.prompt_tokens
        result.cached_tokens = self.cached_tokens
        result.cached_pages = self.cached_pages
        result.accepted_draft_tokens = self.accepted_draft_tokens
        result.rejected_draft_tokens = self.rejected_draft_tokens
        now = time.monotonic()
        first_prefill = self.time_first_prefill or now
        first_token = self.time_first_token or now
        result.time_enqueued = first_prefill - (self.time_enqueue or first_prefill)
        result.time_prefill = first_token - first_prefill
        result.time_generate = (self.time_last_token or first_token) - first_token
        return result

    def __repr__(self) -> str:
        return (f"DynamicJob(serial={self.serial}, state={self.state}, prompt_tokens={self.prompt_tokens}, "
                f"new_tokens={self.new_tokens}/{self.max_new_tokens})")
