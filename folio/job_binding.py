"""What enqueue does with a job before the scheduler sees it: every check against this engine, then binding it to
the engine (its sequences, its injected rows on the model's device, its LoRA adapter, and the namespace its page
hashes are computed under)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from folio import cfg
from folio import embeddings as injected
from folio.hashing import sequence_namespace
from folio.validation import validate_job

if TYPE_CHECKING:
    from folio.generator import DynamicGenerator
    from folio.job import DynamicJob


def check(generator: DynamicGenerator, job: DynamicJob) -> None:
    """Raise ValueError, naming the field, if `job` can never run on `generator`."""
    g = generator
    validate_job(job, vocab_size=g.vocab_size, max_seq_len=g.max_seq_len, num_pages=g.cache.num_pages,
                 page_size=g.page_size)
    cfg.validate(job, vocab_size=g.vocab_size, max_seq_len=g.max_seq_len, num_pages=g.cache.num_pages,
                 page_size=g.page_size, max_batch_size=g.max_batch_size)
    injected.check_engine(job, hidden_size=g.model.config.hidden_size, draft_model=g.draft_model is not None)
    g.loras.resolve(job.lora)


def bind(generator: DynamicGenerator, job: DynamicJob, serial: int) -> None:
    """Bind a checked job to `generator` as its job number `serial`: its sequence(s) exist afterwards."""
    g = generator
    injected.bind(job, g.model.device, g.model.dtype)
    job.lora_adapter = g.loras.resolve(job.lora)
    job.bind(serial, g.tokenizer, g.vocab_size)
    job.sequence = cfg.sequences(job)  # (with a CFG job's negative sequence as its cfg_partner)
    # part of every page hash: what besides the token ids changes the job's K/V (LoRA adapter, embeddings)
    namespace = sequence_namespace(adapter_id=job.lora_adapter and job.lora_adapter.adapter_id,
                                   embeddings_digest=injected.digest(job))
    for seq in cfg.group(job.sequence):
        seq.namespace = namespace
