"""The prefix-aware router: send each request to the replica where its first token would come soonest, which is
mostly the one already holding its prompt's pages.

Replica side (run by the generator replicas, engine-free):
    keys.py       routing keys: page-hash keys every 64 tokens of a sequence's first 256, then every 256 tokens
    events.py     the pool's stored / evicted pages as numbered batches of routing keys, with snapshots
    rates.py      measured prefill speed, decode step time, tokens per job
    digest.py     the report (record_routing_stats): load, rates, recent batches; and its decoding
Router side (one per process holding a handle to the generator deployment):
    index.py      which replica holds which keys: exact from the batches, plus what this router routed recently
    held_keys.py  the key -> replicas store behind it (folio._native_cpu.KeyIndex when built, else Python)
    cost.py       predicted time to first token per replica, in seconds (each decision's pass over every
                  candidate: folio._native_cpu.CandidateWaits.least when built, else numpy)
    policy.py     the decision: prompt keys, matches, shortlist, ranking
    ray_router.py Ray Serve's RequestRouter around the policy

Imports folio.hashing and, for the native key index and candidate pass, folio.ops (the one module that loads
compiled code); no Ray except ray_router.py.
"""
