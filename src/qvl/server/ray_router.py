"""Ray Serve's request-routing hook for qvl replicas: a request goes to the replica that owns
its content key (rendezvous hashing over the replicas' ids), unless that replica has no free
row, then to the least-loaded replica. Imported by Ray in the process that holds the handle
(the cluster front), so it must stay importable without torch."""

from __future__ import annotations

import hashlib

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


def owner(key: str, replica_ids: list[str]) -> str:
    """Rendezvous (highest-random-weight) hashing: every router picks the same replica for a
    key, and a replica joining or leaving moves only the keys it wins or held."""
    return max(replica_ids, key=lambda rid: hashlib.blake2b(f"{key}|{rid}".encode(), digest_size=8).digest())


class ContentRouter(RequestRouter):
    """The key is the request's session id, which the front sets to affinity.routing_key.
    A replica is saturated when its ongoing requests reach `rows` (the engine's --max-batch):
    a newcomer there would wait for a free row while another replica could start at once."""

    def initialize_state(self, rows: int = 8, **kwargs) -> None:
        self.rows = rows

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # all full: back off, then try again
        key = pending_request.metadata.session_id if pending_request is not None else ""
        ranks = []
        if key:
            by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
            first = by_id[owner(key, sorted(by_id))]
            load = self.replica_queue_len_cache.get(first.replica_id)
            if load is None or load < self.rows:
                ranks.append([first])
        ranks.append(candidate_replicas)  # Serve takes the shortest queue of a rank among those that accept
        return ranks
