"""The prefix-aware router: send each request to the replica most likely to hold its prompt's pages.

    digest.py   what a replica reports about its cache and load (record_routing_stats), bounded in size
    index.py    per-replica page index: reported digests reconciled with what this router routed recently
    policy.py   the cost of a request on each replica, and the ranking a RequestRouter returns

Pure Python: imports folio.hashing (the engine's page hashes) and nothing else of the engine, no torch, no Ray.
"""
