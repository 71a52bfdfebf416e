"""Speculative decoding: tokens drafted cheaply (a draft model, or n-grams of the job's own text) and verified by
the target in one forward, kept by exact rejection sampling. See docs/architecture.md."""
