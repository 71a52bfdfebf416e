"""TEMPORARY: replaced by the job-validation branch."""
from __future__ import annotations


def validate_job(job, *, vocab_size, max_seq_len, num_pages, page_size):
    from folio.job import JobState
    if job.state != JobState.NEW:
        raise ValueError(f"job was already enqueued (state {job.state})")
    total = job.prompt_tokens + job.max_new_tokens
    if total > max_seq_len:
        raise ValueError(f"prompt ({job.prompt_tokens} tokens) + max_new_tokens ({job.max_new_tokens}) = "
                         f"{total} exceeds max_seq_len {max_seq_len}")
    pages = -(-total // page_size)
    if pages > num_pages:
        raise ValueError(f"the job needs {pages} pages but the whole cache has {num_pages}")
    bad = next((t for t in job.input_ids if t >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"input_ids holds token id {bad}, outside the model's vocabulary of {vocab_size}")
