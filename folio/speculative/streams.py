"""Counter streams of a job's uniform draws (folio.sampling.rng) used by speculative decoding.

Plain sampling takes draw n for the job's n-th token. Speculation needs more draws per token (the drafter's own draw,
the acceptance test's, the residual's), each independent of the others: they come from the same seed at counters
offset by a stream number in the high bits. Draw n of every stream is used for at most one decision about token n
(a step that rejects at token n ends there; the next step starts at token n + 1), which is what exactness needs.
"""

_STREAM_SHIFT = 40  # 2**40 tokens per job is more than any context


def _counter(stream: int, token_idx: int) -> int:
    return (stream << _STREAM_SHIFT) + token_idx


def draft_counter(token_idx: int) -> int:
    return _counter(1, token_idx)


def accept_counter(token_idx: int) -> int:
    return _counter(2, token_idx)


def residual_counter(token_idx: int) -> int:
    return _counter(3, token_idx)
