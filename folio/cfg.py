"""Classifier-free guidance: a job of two prompts, sampled from a mix of their distributions.

`DynamicJob(input_ids=[positive_ids, negative_ids], gen_settings=SamplerSettings(cfg_scale=s))` runs two sequences:
the positive (the job's own, `job.sequence`) and the negative (`seq.cfg_partner`, `cfg_negative=True`). Where the
two prompts agree on whole pages the prefix cache shares those pages, as it does between any two sequences (the
negative, admitted just after the positive, waits a step for the pages the positive is computing, then takes them).
Each is prefilled (chunked like any prompt) and both decode in the same steps. Before sampling, their logit rows
become one:

    mixed = s * log_softmax(positive) + (1 - s) * log_softmax(negative)

over the real vocabulary (s > 1 pushes away from the negative prompt, s < 0 towards it; s = 1 is the positive
alone), computed as positive + (1 - s) * (log_softmax(negative) - log_softmax(positive)), the same distribution, so
that s = 1 is exactly the positive's logits. The ordinary sampler runs on the mixed row with the positive's settings
and penalty history. The sampled token is appended to both sequences; only the positive emits results.

Who does what:
- Scheduler: the pair is one unit for admission (both fit, two batch rows), preemption (both go), removal (both
  leave, pages released) and sampling (a step where only one of the two would want logits feeds the other's last
  token later: `sync_pair_chunks`); no step is planned ahead while a CFG job is queued or running.
- generator: `mix` before the sampler (plain steps and the plain rows of verify steps).
- Emitter: `follow` appends a staged token to the negative; retiring either sequence retires the job.
- Speculator: CFG jobs never draft.

Torch-free at import (the scheduler imports it); `mix` loads torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from folio.sequence import SeqStatus, Sequence

if TYPE_CHECKING:
    import torch

    from folio.job import DynamicJob
    from folio.scheduler import Chunk


# --- the job ---

def split_prompts(input_ids: Any, as_token_list: Callable[[Any], list[int]]) -> tuple[list[int], list[int] | None]:
    """input_ids as given to DynamicJob: one prompt (ids, or a (n,) / (1, n) tensor), or a list of two prompts
    (positive, negative) for classifier-free guidance. Returns (positive ids, negative ids or None)."""
    if getattr(input_ids, "ndim", 1) == 2 and input_ids.shape[0] == 2:  # a (2, n) tensor: two prompts of n
        input_ids = list(input_ids)
    if isinstance(input_ids, (list, tuple)) and input_ids and all(_is_prompt(p) for p in input_ids):
        if len(input_ids) == 1:
            return as_token_list(input_ids[0]), None
        if len(input_ids) != 2:
            raise ValueError(f"input_ids: one prompt, or two (positive, negative) for classifier-free guidance; "
                             f"got {len(input_ids)} prompts")
        return as_token_list(input_ids[0]), as_token_list(input_ids[1])
    return as_token_list(input_ids), None


def _is_prompt(value: Any) -> bool:
    """A prompt in a list of prompts (a list or tensor of ids), as opposed to a token id."""
    return not isinstance(value, (int, str, bytes)) and (hasattr(value, "tolist") or isinstance(value, Iterable))


def check_job(negative_ids: list[int] | None, cfg_scale: float | None) -> None:
    """Two prompts need a guidance scale, and a guidance scale needs two prompts."""
    if negative_ids is not None and cfg_scale is None:
        raise ValueError("input_ids holds two prompts (positive, negative) but gen_settings.cfg_scale is None: "
                         "set cfg_scale for classifier-free guidance, or pass one prompt")
    if negative_ids is None and cfg_scale is not None:
        raise ValueError(f"gen_settings.cfg_scale={cfg_scale} needs two prompts: "
                         f"input_ids=[positive_ids, negative_ids]")


def validate(job: DynamicJob, *, vocab_size: int, max_seq_len: int, num_pages: int, page_size: int,
             max_batch_size: int) -> None:
    """Enqueue-time checks of a CFG job's negative prompt and of the pair's room (ValueError, naming the field);
    nothing for other jobs. Both sequences' pages must fit the cache together (shared pages counted twice, so
    that the pair runs alone in an empty cache whatever it shares)."""
    negative = job.cfg_negative_ids
    if negative is None:
        return
    if max_batch_size < 2:
        raise ValueError(f"input_ids: a classifier-free guidance job runs two sequences, but max_batch_size is "
                         f"{max_batch_size} (paged=False runs one)")
    bad = next((t for t in negative if t >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"input_ids[1] (the negative prompt) holds token id {bad}, outside the model's vocabulary "
                         f"of {vocab_size}")
    total = len(negative) + job.max_new_tokens
    if total > max_seq_len:
        raise ValueError(f"negative prompt ({len(negative)} tokens) + max_new_tokens ({job.max_new_tokens}) = "
                         f"{total} exceeds max_seq_len {max_seq_len}")
    pages = -(-(job.prompt_tokens + job.max_new_tokens) // page_size) + -(-total // page_size)
    if pages > num_pages:
        raise ValueError(f"the positive and negative prompts + max_new_tokens ({job.max_new_tokens}) need {pages} "
                         f"pages of {page_size} tokens together, but the whole cache has {num_pages}")


def sequences(job: DynamicJob) -> Sequence:
    """The job's runtime record: its sequence, linked to the negative prompt's for a CFG job."""
    seq = Sequence(job=job, token_ids=list(job.input_ids))
    if job.cfg_negative_ids is not None:
        negative = Sequence(job=job, token_ids=list(job.cfg_negative_ids), cfg_negative=True)
        seq.cfg_partner, negative.cfg_partner = negative, seq
    return seq


# --- the pair ---

def group(seq: Sequence) -> tuple[Sequence, ...]:
    """The sequences that run together: (positive, negative) of a CFG job, else (seq,)."""
    partner = seq.cfg_partner
    if partner is None:
        return (seq,)
    return (partner, seq) if seq.cfg_negative else (seq, partner)


def positive(seq: Sequence) -> Sequence:
    """The sequence that samples and emits for seq's job."""
    return seq.cfg_partner if seq.cfg_negative else seq


def follow(seq: Sequence, token_id: int) -> None:
    """A token was staged into positive `seq`: the negative takes it too (fed by the next step)."""
    negative = seq.cfg_partner
    if negative is not None and negative.is_live:
        negative.token_ids.append(token_id)
        negative.num_sampled = seq.num_sampled


def sync_pair_chunks(chunks: list[Chunk]) -> list[Chunk]:
    """A CFG pair samples only when both of its sequences have logits in the same step. Where one chunk of a
    pair would end its sequence (want logits) and the other would not (still prefilling, or not planned), the
    first stops one token short (its last token is fed in a later step, with the other's) or, being that one
    token, is left out. Its pages, already allocated, stay with it."""
    from folio.scheduler import Chunk

    by_seq = {c.seq: c for c in chunks if c.seq.cfg_partner is not None}
    if not by_seq:
        return chunks
    out = []
    for chunk in chunks:
        seq = chunk.seq
        if seq not in by_seq or not chunk.wants_logits:
            out.append(chunk)
            continue
        other = by_seq.get(seq.cfg_partner)
        if other is not None and other.wants_logits:
            out.append(chunk)
        elif chunk.num_tokens > 1:
            out.append(Chunk(seq, chunk.start, chunk.end - 1))
    return out


# --- sampling ---

def mix(chunks: list[Chunk], logits: torch.Tensor, vocab_size: int) -> tuple[list[Chunk], torch.Tensor]:
    """The sampled rows of a step (one logits row per chunk) with each CFG pair's two rows made one: the mixed row
    takes the positive's place, the negative's is dropped. Rows past `vocab_size` columns are -inf in mixed rows.
    A row whose partner has no row here belongs to a job that ended during the step: it is dropped."""
    if not any(c.seq.cfg_partner is not None for c in chunks):
        return chunks, logits
    import torch

    from folio.sampling.host import to_device

    row_of = {c.seq: i for i, c in enumerate(chunks)}
    kept, pos_rows, neg_rows, scales, mixed_at = [], [], [], [], []
    for i, chunk in enumerate(chunks):
        seq = chunk.seq
        if seq.cfg_partner is None:
            kept.append(i)
            continue
        if seq.cfg_negative:
            continue
        j = row_of.get(seq.cfg_partner)
        if j is None:
            if seq.status is SeqStatus.RUNNING:
                raise AssertionError(f"{seq!r} wants logits without its negative sequence")
            continue
        mixed_at.append(len(kept))
        kept.append(i)
        pos_rows.append(i)
        neg_rows.append(j)
        scales.append(float(seq.job.gen_settings.cfg_scale))
    device = logits.device
    out = logits[to_device(kept, torch.int64, device)]
    if pos_rows:
        index = to_device(pos_rows + neg_rows, torch.int64, device)
        width = min(vocab_size, logits.shape[1])
        lp = torch.log_softmax(logits[index, :width].float(), dim=1)
        n = len(pos_rows)
        s = to_device(scales, torch.float32, device)[:, None]
        # s * lp_pos + (1 - s) * lp_neg, shifted by the positive's log-sum-exp (a constant per row: the same
        # distribution) to positive + (1 - s) * (lp_neg - lp_pos). At s = 1 the row is the positive's own logits,
        # bit for bit, and the penalties after it act on logits of the positive's scale at every s.
        mixed = logits[index[:n], :width].float() + (1.0 - s) * (lp[n:] - lp[:n])
        at = to_device(mixed_at, torch.int64, device)
        out[at, :width] = mixed.to(out.dtype)
        if width < out.shape[1]:
            out[at, width:] = -math.inf
    return [chunks[i] for i in kept], out
