"""The prefix-aware Ray Serve RequestRouter (work in progress: ranks by load until the policy is wired in)."""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


class PrefixAwareRequestRouter(RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        return [candidate_replicas]
