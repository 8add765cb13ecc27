"""Ray Serve's request-routing hook for qvl replicas: a request goes to the replica that owns
its content key (rendezvous hashing over the replicas' ids), unless that replica has no free
row, then to the least-loaded replica. Imported by Ray in the process that holds the handle
(the cluster front), so it must stay importable without torch."""

from __future__ import annotations

import hashlib
import math

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


def owner(key: str, replica_ids: list[str]) -> str:
    """Rendezvous (highest-random-weight) hashing: every router picks the same replica for a
    key, and a replica joining or leaving moves only the keys it wins or held."""
    return max(replica_ids, key=lambda rid: hashlib.blake2b(f"{key}|{rid}".encode(), digest_size=8).digest())


BALANCE = 1.25  # bounded loads: an owner may hold at most this times its fair share (+1)


def within_bound(load: int, loads: list[int]) -> bool:
    """Consistent hashing with bounded loads (Mirrokni et al., 2016): one more request on a
    replica holding `load` keeps it within BALANCE x the mean load after the request."""
    return load + 1 <= math.ceil(BALANCE * (sum(loads) + 1) / len(loads))


class ContentRouter(RequestRouter):
    """The key is the request's session id, which the front sets to affinity.routing_key.
    The owner is skipped for the least-loaded replica when it is saturated (as many requests
    as `rows`, the engine's --max-batch: a newcomer would wait for a free row while another
    replica could start at once). A conversation key ("lead:") is also moved when its owner
    holds more than its bounded share: a text request's cached prefix is cheap to recompute,
    and keys that happen to hash together must not leave a replica idle beside a busy one.
    An image's key ("media:") stays: its cached features cost a vision encoding.
    An owner whose load is not known (its queue-length probe timed out: a replica busy with
    a step answers late) is asked again, `patience` times with backoff, before the request
    goes elsewhere: a miss costs the whole vision encoding and prefill."""

    def initialize_state(self, rows: int = 8, patience: int = 3, **kwargs) -> None:
        self.rows, self.patience = rows, patience
        self.tries: dict[str, int] = {}  # by internal request id, while it is being routed

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is None or not pending_request.metadata.session_id:
            return [candidate_replicas]  # Serve takes the shortest queue of a rank among those that accept
        pending_request.routing_context.should_backoff = True  # all full: back off, then try again
        key = pending_request.metadata.session_id
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        first = by_id[owner(key, sorted(by_id))]
        load = self.replica_queue_len_cache.get(first.replica_id)
        loads = [self.replica_queue_len_cache.get(r.replica_id) or 0 for r in candidate_replicas]
        balanced = key.startswith("media:") or within_bound(load or 0, loads)
        if load is not None and (load >= self.rows or not balanced):
            return [candidate_replicas]
        request_id = pending_request.metadata.internal_request_id
        if len(self.tries) > 4096:  # requests cancelled while being routed never report back
            self.tries.clear()
        self.tries[request_id] = tries = self.tries.get(request_id, 0) + 1
        if load is None and tries <= self.patience:
            return [[first]]
        return [[first], candidate_replicas]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        self.tries.pop(pending_request.metadata.internal_request_id, None)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        self.tries.pop(internal_request_id, None)  # also when it was cancelled while being routed
