"""ModelRunner: the device side of a step. It owns the model, the KV tensors, the captured decode graphs, the
penalty histories kept on the device and the pinned readback of sampled tokens; it executes a planned step (slot
copies, prompt chunks, decode rows and verify rows), samples, and makes the step's one intended host sync
(`SampledStep.read`)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from folio.constrain.masks import MaskWorker
from folio.embeddings import chunk_spans
from folio.host_pages import HostPages
from folio.kv_cache import Cache
from folio.lora import LoraAdapter, LoraRegistry
from folio.lora.slots import LoraSlots
from folio.model.batch import ForwardBatch, SeqChunk
from folio.model.decode_graphs import DecodeGraphs
from folio.model.model import Model
from folio.sampled import SampledStep, VerifiedStep
from folio.sampling import RowParams, sample
from folio.sampling.device_history import DeviceHistories
from folio.sampling.distribution import probabilities
from folio.sampling.dry import breakers_for
from folio.sampling.host import to_device
from folio.sampling.penalties import window_size
from folio.sampling.plain import PlainRows, plain_rows, sample_plain
from folio.sampling.rng import uniforms
from folio.sampling.sampler import _plain_greedy_width
from folio.scheduler import Chunk, StepPlan
from folio.sequence import Sequence
from folio.speculative.acceptance import greedy_verdicts, verdicts
from folio.speculative.streams import accept_counter, residual_counter

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: Model, cache: Cache, max_batch_size: int, max_seq_len: int, vocab_size: int,
                 max_q_size: int = 8, cuda_graphs: bool | None = None, max_graph_rows: int | None = None):
        """max_q_size: the most tokens of one sequence in a decode forward (a verify row's length).
        cuda_graphs: capture decode steps (rows of one or several tokens, up to max_graph_rows token rows in all,
        default max_batch_size) in CUDA graphs; None: whenever the model is on a CUDA device."""
        self.model = model
        self.cache = cache
        self.page_size = cache.page_size
        self.vocab_size = vocab_size  # real vocabulary entries: logits beyond are masked
        self.max_q_size = max_q_size
        self.graphs = self._capture_graphs(cuda_graphs, max_graph_rows or max_batch_size, max_seq_len)
        self._histories = DeviceHistories(model.device)  # prompt + sampled ids of sequences with penalties
        # called with (plan, num_fed) before each forward: a draft model follows the target's cache with it
        self.on_forward: Callable[[StepPlan, int], None] | None = None
        # the token bitmasks of filtered jobs (set by the generator), and the errors their filters raised
        self.masks: MaskWorker | None = None
        self.mask_errors: dict[Sequence, BaseException] = {}
        self.loras: LoraRegistry | None = None  # the LoRA adapters jobs may use (attach_loras)
        self.host_pages: HostPages | None = None  # the host tier's buffers (set by the generator when it is on)

    def attach_loras(self, registry: LoraRegistry) -> LoraRegistry:
        """Apply the adapters of `registry` to the rows of jobs that name one; the decode graphs take the LoRA update
        in once its slots exist (at the first load). Returns the registry."""
        self.loras = registry
        registry.on_slots = self._lora_graphs
        if registry.slots is not None:
            self._lora_graphs(registry.slots)
        return registry

    def _lora_graphs(self, slots: LoraSlots) -> None:
        if self.graphs is None:
            return
        try:
            self.graphs.enable_lora(slots)
        except Exception:  # noqa: BLE001 - the adapter still applies, in eager steps
            logger.exception("capturing the decode graphs with the LoRA update failed: steps run eagerly")
            self.graphs = None

    def _capture_graphs(self, cuda_graphs: bool | None, max_rows: int, max_seq_len: int) -> DecodeGraphs | None:
        on_cuda = self.model.device.type == "cuda"
        if cuda_graphs and not on_cuda:
            raise ValueError("cuda_graphs=True needs a model on a CUDA device")
        if cuda_graphs is False or not on_cuda:
            return None
        return DecodeGraphs(self.model, self.cache, max_rows, max_seq_len)

    # --- sequences ---

    def add_sequence(self, seq: Sequence) -> None:
        job = seq.job
        if self.masks is not None:
            self.masks.add(seq)
        if job.gen_settings.penalty_window != 0:
            self._histories.add(seq, job.input_ids, job.prompt_tokens + job.max_sampled_tokens)

    def remove_sequence(self, seq: Sequence) -> None:
        self._histories.remove(seq)
        self.mask_errors.pop(seq, None)
        if self.masks is not None:
            self.masks.forget(seq)

    # --- the forward ---

    def forward(self, plan: StepPlan, fed_ids: torch.Tensor | None = None) -> tuple[torch.Tensor | None, bool]:
        """Run the plan's slot copies and chunks. fed_ids: on the device, the input ids of the plan's first
        len(fed_ids) chunks, decode rows planned ahead whose tokens are not in their sequences yet. Returns the
        logits (rows in chunk order, `Chunk.num_logits` each; None without chunks) and whether a captured graph
        ran."""
        num_fed = 0 if fed_ids is None else fed_ids.shape[0]
        if self.on_forward is not None:
            self.on_forward(plan, num_fed)
        if self.host_pages is not None:  # (in folio.cache.host_tier's order; the previous plan's fetches first)
            self.host_pages.wait_fetched()
            self.host_pages.write_back(plan.transfers)
        for copy in plan.copies:
            self.cache.copy_page_slots(copy.src_page, copy.dst_page, copy.num_slots)
        if self.host_pages is not None:
            self.host_pages.fetch_ahead(plan.transfers)
        if not plan.chunks:
            return None, False
        rows = plan.chunks
        adapters = self._row_adapters(rows)
        if num_fed == len(rows) and self.graphs is not None and self._graph_takes(adapters, num_fed):
            # Every row a decode row planned ahead (one token fed from the device, its logits wanted, no verify
            # rows, no injected embeddings: those are prompt rows): the usual step, without the checks below.
            return self._replay(rows, fed_ids, num_fed, adapters), True
        for c in rows:
            if c.verify and c.num_tokens > self.max_q_size:
                raise ValueError(f"a verify row of {c.num_tokens} tokens exceeds max_q_size={self.max_q_size}")
        # a fed row's token is not in its sequence yet, so its chunk cannot tell that it wants logits
        modes = ["last" if k < num_fed else ("all" if c.verify else ("last" if c.wants_logits else "none"))
                 for k, c in enumerate(rows)]
        # embedding rows injected at placeholder tokens (folio.embeddings): the captured graphs feed token ids only
        injected = [chunk_spans(c.seq.job, c.start, c.end) for c in rows]
        if self.graphs is not None and not any(injected) and all(
                m == "all" or (m == "last" and c.num_tokens == 1) for m, c in zip(modes, rows)):
            if self._graph_takes(adapters, sum(c.num_tokens for c in rows)):
                return self._replay(rows, fed_ids, num_fed, adapters), True
        chunks = [SeqChunk(token_ids=(0,) if k < num_fed else c.token_ids, start_pos=c.start,
                           block_table=c.seq.block_table, logits=mode, injected=spans)
                  for k, (c, mode, spans) in enumerate(zip(rows, modes, injected))]
        batch = ForwardBatch.build(chunks, self.page_size, self.model.device)
        if num_fed:
            fed = fed_ids.to(batch.input_ids.dtype)
            input_ids = fed if num_fed == len(chunks) else torch.cat([fed, batch.input_ids[num_fed:]])
            batch = dataclasses.replace(batch, input_ids=input_ids)
        if adapters is not None:
            num_rows = [1 if k < num_fed else c.num_tokens for k, c in enumerate(rows)]
            batch = dataclasses.replace(batch, lora=self.loras.batch(list(zip(adapters, num_rows)),
                                                                    self.model.device))
        return self.model.forward(batch, self.cache), False

    def _graph_takes(self, adapters: list[LoraAdapter | None] | None, num_rows: int) -> bool:
        """Whether a captured graph runs these one-token rows: a bucket holds them, and rows with LoRA adapters
        replay only once the graphs read the adapters' slots (folio.lora.slots)."""
        return ((adapters is None or self.graphs.lora_slots is self.loras.slots)
                and self.graphs.bucket_for(num_rows) is not None)

    def _row_adapters(self, rows: list[Chunk]) -> list[LoraAdapter | None] | None:
        """Each chunk's LoRA adapter (None: no row uses one)."""
        if self.loras is None or not self.loras.loaded:
            return None
        adapters = [c.seq.job.lora_adapter for c in rows]
        return adapters if any(a is not None for a in adapters) else None

    def _replay(self, rows: list[Chunk], fed_ids: torch.Tensor | None, num_fed: int,
                adapters: list[LoraAdapter | None] | None) -> torch.Tensor:
        """Decode and verify rows through a captured graph: a verify row of n tokens runs as n one-token rows over
        the same pages, row j attending to positions <= start + j (its K/V and those before are all written by
        the same forward before attention reads them)."""
        known = [t for c in rows[num_fed:] for t in c.token_ids]
        if any(c.verify for c in rows):
            positions = [p for c in rows for p in range(c.start, c.stop)]
            tables = [c.seq.block_table for c in rows for _ in range(c.num_tokens)]
        else:  # one token a row, the usual step (per row: kept to the plainest loops)
            positions, tables = [c.start for c in rows], [c.seq.block_table for c in rows]
        row_slots = None if adapters is None else [self.loras.slot_of(a) for a, c in zip(adapters, rows)
                                                   for _ in range(c.num_tokens)]
        if num_fed == 0:
            ids = known
        elif known:
            ids = torch.cat([fed_ids, to_device(known, fed_ids.dtype, fed_ids.device)])
        else:
            ids = fed_ids
        return self.graphs.run(ids, positions, tables, row_slots)

    # --- sampling ---

    def sample(self, chunks: Seq[Chunk], logits: torch.Tensor, masks_later: bool = False) -> SampledStep:
        """One token for each chunk (each wants the logits of its last token, one row of `logits` each). The
        sampled ids are appended to the penalty histories on the device. masks_later (see masks_can_come_later):
        the device waits for the masks' worker thread; the caller calls `release_masks` before the next step."""
        seqs = [c.seq for c in chunks]
        plain = self._plain_rows(seqs, logits, masks_later)
        if plain is not None:
            output = sample_plain(logits, plain, self._histories, self.vocab_size, self.model.ops)
            self._record_sampled(seqs, output.token_ids, plain.history_rows)
            return SampledStep(output, plain.return_probs, False, [])
        jobs = [s.job for s in seqs]
        draws = uniforms([j.seed for j in jobs], [s.num_sampled for s in seqs])
        rows = [self._row_params(s, u, s.num_sampled) for s, u in zip(seqs, draws)]
        try:
            allowed = (self.masks.collect_later(seqs, logits.device) if masks_later
                       else self._allowed(seqs, logits.device))
            # in place: these logits (a forward's output, or the decode graph's buffer, which the next replay
            # overwrites only after this step's sampler in stream order) are read by nothing else
            output = sample(logits, rows, self._penalty_windows(seqs, logits.shape[1]), in_place=True,
                            ops=self.model.ops, allowed=allowed)
            self._record_sampled(seqs, output.token_ids)
            # mirostat's state advances with the sampled token's probability, at staging
            return SampledStep(output, any(j.return_probs or j.gen_settings.mirostat for j in jobs),
                               any(j.return_top_tokens for j in jobs),
                               [i for i, j in enumerate(jobs) if j.return_logits])
        except BaseException:
            self.release_masks()  # (the device must not wait for ever; the caller samples row by row)
            raise

    def _plain_rows(self, seqs: list[Sequence], logits: torch.Tensor, masks_later: bool) -> PlainRows | None:
        """The rows on the sampler's plain path (folio.sampling.plain), or None: where the general path would take
        the native kernels too (CUDA and the kernels there) and no row's filter has masks being made."""
        if (masks_later or logits.device.type != "cuda" or self.model.ops.native("sample_rows", "cuda") is None
                or self.model.ops.native("apply_penalties", "cuda") is None):
            return None
        return plain_rows(seqs, self._histories)

    def masks_can_come_later(self, seqs: list[Sequence]) -> bool:
        """Whether the step may queue its sampler before its masks are made (folio.constrain.gate): a gate on this
        device, masks still being made, and rows that take the native sampler (the torch path's extended samplers
        and top tokens collect their masks first, as without a gate)."""
        return (self.masks is not None and self.masks.gate is not None and self.masks.pending(seqs)
                and self.model.ops.native("sample_rows", "cuda") is not None
                and not any(s.job.return_top_tokens or s.job.return_logits
                            or s.job.gen_settings.uses_extended_samplers for s in seqs))

    def release_masks(self) -> None:
        """Wait until the masks' worker has handed the device what `sample(masks_later=True)` promised."""
        self.mask_errors.update(self.masks.release() if self.masks is not None else {})

    def _allowed(self, seqs: list[Sequence], device: torch.device) -> torch.Tensor | None:
        """The rows' filter bitmasks (None: no row is filtered); a filter that raised leaves its row nothing to
        pick, and its error for the emitter."""
        if self.masks is None:
            return None
        allowed, errors = self.masks.collect(seqs, device)
        for seq, error in zip(seqs, errors):
            if error is not None:
                self.mask_errors[seq] = error
        return allowed

    def _row_params(self, seq: Sequence, u: float, token_idx: int) -> RowParams:
        """The sampler row of seq's token_idx-th generated token."""
        job = seq.job
        return RowParams.unchecked(
            settings=job.gen_settings, u=u,
            # the penalties read the device histories (see _penalty_windows); DRY reads the host's
            history_ids=seq.token_ids if job.gen_settings.dry_active else (),
            blocked_ids=job.blocked_ids_at(token_idx),
            vocab_size=self.vocab_size, return_top_tokens=job.return_top_tokens, return_logits=job.return_logits,
            state=seq.sampler_state, dry_breakers=breakers_for(job))

    def _penalty_windows(self, seqs: list[Sequence], num_columns: int,
                         lengths: list[int] | None = None) -> torch.Tensor | None:
        """The rows' penalty ids gathered on the device (row i reads the first lengths[i] ids of its history,
        default all that were sampled), or None when no row has penalties."""
        history = self._histories
        keys = [s if s in history else None for s in seqs]
        if lengths is None:
            lengths = [s.prompt_len + s.num_sampled for s in seqs]
        sizes = [0 if k is None else window_size(s.job.gen_settings, n) for k, s, n in zip(keys, seqs, lengths)]
        if not any(sizes):
            return None
        return history.windows(keys, lengths, sizes, num_columns)

    def _record_sampled(self, seqs: list[Sequence], token_ids: torch.Tensor, rows: list[int] | None = None) -> None:
        """Append each sampled id to its sequence's device history, on the device (a sequence that turns out to
        have ended leaves a harmless extra id past its end). rows: those of seqs that keep one (None: found here)."""
        if rows is None:
            rows = [i for i, s in enumerate(seqs) if s in self._histories]
        if not rows:
            return
        if len(rows) < len(seqs):
            token_ids = token_ids[to_device(rows, torch.int64, token_ids.device)]
        self._histories.append([seqs[i] for i in rows], [seqs[i].prompt_len + seqs[i].num_sampled for i in rows],
                               token_ids)

    # --- verification (speculative decoding) ---

    def verify(self, chunks: Seq[Chunk], logits: torch.Tensor) -> VerifiedStep:
        """Rejection-sample the drafts of verify rows `chunks` (logits: every position of each, concatenated)
        against each chunk's draft_probs (the drafter's distributions at its drafted positions, [k, V]; None for
        point masses). The drafts are appended to the penalty histories (tokens after an accepted prefix are overwritten
        when the sequence gets there)."""
        seqs = [c.seq for c in chunks]
        rows, draft_ids, u_accept, u_residual, keys, lengths = [], [], [], [], [], []
        for chunk, seq in zip(chunks, seqs):
            length = len(seq.token_ids)
            for j in range(len(chunk.drafts) + 1):
                token_idx = seq.num_sampled + j
                rows.append(self._row_params(seq, 0.0, token_idx))
                draft_ids.append(chunk.drafts[j] if j < len(chunk.drafts) else -1)
                u_accept.append(accept_counter(token_idx))
                u_residual.append(residual_counter(token_idx))
                keys.append(seq)
                lengths.append(length + j)
            if seq in self._histories and chunk.drafts:
                self._histories.append([seq] * len(chunk.drafts), range(length, length + len(chunk.drafts)),
                                       to_device(list(chunk.drafts), torch.int64, logits.device))
        device = logits.device
        drafted = to_device(draft_ids, torch.int64, device)
        draft_probs = [c.draft_probs for c in chunks]
        if _plain_greedy_width(rows, logits.shape[1]) is not None and all(p is None for p in draft_probs):
            return VerifiedStep(chunks, greedy_verdicts(logits, drafted, self.vocab_size))
        seeds = [k.job.seed for k in keys]
        draws = to_device(uniforms(seeds, u_accept) + uniforms(seeds, u_residual), torch.float64, device)
        probs = probabilities(logits.float(), rows, self._penalty_windows(keys, logits.shape[1], lengths))
        q = self._draft_distributions(chunks, draft_probs, drafted, probs.shape[1])
        return VerifiedStep(chunks, verdicts(probs, drafted, q, draws[:len(rows)], draws[len(rows):]))

    @staticmethod
    def _draft_distributions(chunks: Seq[Chunk], draft_probs: Seq[torch.Tensor | None], drafted: torch.Tensor,
                             num_columns: int) -> torch.Tensor | None:
        """[P, V] drafter distributions: point masses where none was given, zeros past each row's drafts."""
        if all(p is None for p in draft_probs):
            return None
        parts = []
        for chunk, given in zip(chunks, draft_probs):
            k = len(chunk.drafts)
            block = torch.zeros(k + 1, num_columns, dtype=torch.float32, device=drafted.device)
            if given is not None:
                block[:k, : given.shape[1]] = given[:k]
            parts.append(block)
        q = torch.cat(parts)
        point = to_device([int(p is None) for c, p in zip(chunks, draft_probs) for _ in range(len(c.drafts) + 1)],
                          torch.int64, drafted.device).bool()
        point &= drafted >= 0
        one_hot = torch.zeros_like(q).scatter_(1, drafted.clamp(min=0)[:, None], 1.0)
        return torch.where(point[:, None], one_hot, q)

    def record_tokens(self, seq: Sequence, position: int, token_ids: Seq[int]) -> None:
        """Write ids the host chose at position.. of seq's penalty history (after a verify step)."""
        if seq in self._histories and token_ids:
            device = self.model.device
            self._histories.append([seq] * len(token_ids), range(position, position + len(token_ids)),
                                   to_device(list(token_ids), torch.int64, device))
