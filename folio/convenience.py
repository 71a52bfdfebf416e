"""The blocking conveniences of DynamicGenerator, built on its public enqueue / step API: `generate()` and
`warmup()`."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

from folio.job import DynamicJob
from folio.results import Result
from folio.sampling import SamplerSettings

if TYPE_CHECKING:
    from folio.generator import DynamicGenerator


def generate(generator: DynamicGenerator, prompt: str | Seq[str], max_new_tokens: int, min_new_tokens: int = 0,
             seed: int | None = None, gen_settings: SamplerSettings | Seq[SamplerSettings] | None = None,
             encode_special_tokens: bool = False, decode_special_tokens: bool = False,
             stop_conditions: Seq[int | str] | None = None, add_bos: bool = False, abort_event: Any = None,
             completion_only: bool = False, return_last_results: bool = False,
             defer: Callable[[Result], None] | None = None, filters: Seq[Any] | None = None,
             filter_prefer_eos: bool = False, banned_strings: Seq[str] | None = None,
             token_healing: bool = False) -> Any:
    """Generate completions for one prompt (returns str) or a list (returns list[str]), running alongside any
    other jobs of this generator (their results are held for the next iterate()). Prompt i gets seed + i. With
    `abort_event` (a threading.Event) set, this call's jobs are cancelled and None is returned. Completions include
    text held when a stop token ended the job. `defer` takes the other jobs' results (dropped if None).
    filters: for one prompt a list of folio.constrain.Filter, for a list of prompts one such list per prompt (a
    filter keeps one job's state). banned_strings, token_healing, filter_prefer_eos: as DynamicJob's, for every
    prompt."""
    single = isinstance(prompt, str)
    prompts = [prompt] if single else list(prompt)
    per_prompt_filters = _filters_per_prompt(filters, single, len(prompts))
    if isinstance(gen_settings, SamplerSettings) or gen_settings is None:
        settings = [gen_settings] * len(prompts)
    else:
        settings = list(gen_settings)
        if len(settings) != len(prompts):
            raise ValueError(f"gen_settings has {len(settings)} entries for {len(prompts)} prompts")
    tokenizer = generator.tokenizer
    jobs = [DynamicJob(
        input_ids=tokenizer.encode(p, add_bos=add_bos, encode_special_tokens=encode_special_tokens),
        max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, stop_conditions=stop_conditions,
        gen_settings=s, seed=None if seed is None else seed + i, decode_special_tokens=decode_special_tokens,
        identifier=i, filters=per_prompt_filters[i], filter_prefer_eos=filter_prefer_eos,
        banned_strings=banned_strings, token_healing=token_healing) for i, (p, s) in enumerate(zip(prompts, settings))]
    for job in jobs:
        generator.validate_job(job)
    last: dict[int, Result] = {}
    waiting = list(jobs)
    mine = set(jobs)
    while len(last) < len(jobs):
        while waiting and _has_room(generator):
            generator.enqueue(waiting.pop(0))
        if abort_event is not None and abort_event.is_set():
            for job in jobs:
                generator.cancel(job)
            return None
        for result in generator.step().results:
            if result.job not in mine:
                if defer is not None:
                    defer(result)
            elif result.eos:
                if result.error is not None:
                    for job in jobs:
                        generator.cancel(job)
                    raise result.error
                last[result.job.identifier] = result
    completions = [last[i].full_completion if completion_only else prompts[i] + last[i].full_completion
                   for i in range(len(jobs))]
    out: Any = completions[0] if single else completions
    if return_last_results:
        return out, ([last[0]] if single else [last[i] for i in range(len(jobs))])
    return out


def _filters_per_prompt(filters: Seq[Any] | None, single: bool, num_prompts: int) -> list[list[Any]]:
    if not filters:
        return [[] for _ in range(num_prompts)]
    if single:
        return [list(filters)]
    per_prompt = [list(f) if isinstance(f, (list, tuple)) else None for f in filters]
    if len(per_prompt) != num_prompts or any(f is None for f in per_prompt):
        raise ValueError(f"filters: with {num_prompts} prompts, give one list of filters per prompt (a filter keeps "
                         "one job's state)")
    return per_prompt


def warmup(generator: DynamicGenerator) -> None:
    """Run a few short jobs so that the kernels a serving step uses are loaded and allocators initialised,
    leaving no cached pages behind (the queue must be empty).

    CUDA loads a kernel's code at its first launch, and that load waits for the work already queued on the
    device: a kernel first used under load stops the host from running ahead (on an H100, the first 16k-token
    prompt step's GEMM held the host for the whole 330 ms of the step before it). So besides a greedy job, the
    warm-up prefills one full chunk of prompt tokens (long prompt steps use other GEMM kernels than short ones),
    samples with the default settings (penalties, top-k, top-p) and runs a step that mixes one job's decode row
    with another job's prompt."""
    generate(generator, "Once upon a time,", max_new_tokens=8, gen_settings=SamplerSettings.greedy())
    _prefill_one_full_chunk(generator)
    ids = generator.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    ids = (list(ids) * 2)[:max(2, len(ids))]  # at least two tokens: a prompt chunk, not a decode row
    generator.enqueue(DynamicJob(ids, max_new_tokens=6, gen_settings=SamplerSettings(), seed=0))
    generator.step()  # its prompt; the next steps decode it while the second job's prompt joins them
    generator.enqueue(DynamicJob(ids[::-1], max_new_tokens=2, gen_settings=SamplerSettings(), seed=1))
    while generator.num_remaining_jobs():
        generator.step()
    generator.reset_page_table()


def _prefill_one_full_chunk(generator: DynamicGenerator) -> None:
    """Prompts that fill one step's max_chunk_size (as far as max_seq_len, the batch and the pool allow), one
    greedy token each."""
    length = min(generator.max_seq_len - 1, generator.max_chunk_size)
    pages_each = -(-(length + 1) // generator.page_size)
    count = min(generator.max_chunk_size // max(length, 1), generator.max_batch_size,
                generator.cache_manager.num_pages // pages_each)
    if length < 2 or count < 1:
        return
    vocab = generator.vocab_size
    # distinct first tokens: no prompt shares a page with another
    waiting = [DynamicJob([(k + 7 * i) % vocab for i in range(length)], max_new_tokens=1,
                          gen_settings=SamplerSettings.greedy()) for k in range(count)]
    while waiting or generator.num_remaining_jobs():
        while waiting and _has_room(generator):
            generator.enqueue(waiting.pop())
        generator.step()


def _has_room(generator: DynamicGenerator) -> bool:
    bound = generator.max_queued_jobs
    return bound is None or generator.num_pending_jobs() < bound
