"""What the producing processes show on their Prometheus endpoint (``streams.metrics``): the arena, the local policy
server and the vLLM manager. Each counts for itself (``ArenaStats``, ``EmitterStats``, the server's counters);
these functions only name the figures. vLLM serves its own ``vllm:*`` metrics on its API port (``/metrics``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from streams.metrics import Endpoint, OFFSETS, Sample, port_for, stats_reader


def endpoint(process: str, explicit_port: int | None, *readers: tuple[str, Any]) -> Endpoint:
    """Start ``process``'s endpoint (its port from ``--metrics-port`` or ROLLOUT_METRICS_PORT + its offset) with
    ``(service label, samples function)`` readers."""
    ep = Endpoint(process, port_for(OFFSETS[process], explicit_port))
    for service, read in readers:
        stats_reader(ep.registry, service, read)
    return ep.start()


def arena_samples(arena: Any, emitter: Any) -> Iterator[Sample]:
    s, e, pacer = arena.stats, emitter.stats, arena.pacer
    yield "rollout_arena_groups", "counter", "groups admitted and finished", {}, s.groups
    yield ("rollout_arena_rollouts", "counter", "training rollouts finished, by status (rollout_records_out_total: "
           "what is committed)", {"status": "all"}, s.rollouts)
    yield "rollout_arena_rollouts", "counter", "", {"status": "failed"}, s.failed
    yield "rollout_arena_rollouts", "counter", "", {"status": "truncated"}, s.truncated
    yield "rollout_arena_evaluations", "counter", "held-out evaluation rollouts written", {}, s.evaluations
    yield "rollout_arena_steps", "counter", "model calls (Steps) written", {}, s.steps
    yield "rollout_tokens", "counter", "completion tokens, by stage", {"stage": "generated"}, s.completion_tokens
    yield "rollout_arena_in_flight", "gauge", "rollouts being generated now", {}, s.in_flight
    yield ("rollout_arena_inflight_cap", "gauge", "the cap on training episodes in flight now (sized by memory, the "
           "engine's KV cache and throughput)", {}, s.inflight_cap or 0)
    yield ("rollout_arena_episode_bytes", "gauge", "memory one episode in flight holds, learned (0: not yet known)", {},
           s.episode_bytes or 0)
    yield "rollout_arena_revision", "gauge", "the learner revision the arena serves", {}, arena.current_policy.revision
    yield "rollout_arena_weight_reloads", "counter", "revisions loaded into the server", {}, len(arena.reload_s)
    yield "rollout_arena_weight_reload_seconds", "counter", "time spent loading revisions", {}, sum(arena.reload_s)
    for server in arena.pool.servers:  # the learner's pool: how its calls spread, which servers are in
        labels = {"server": server.url}
        yield "rollout_learner_requests", "counter", "learner calls answered, by server", labels, server.served
        yield "rollout_learner_errors", "counter", "learner attempts failed (transport, 429, 5xx), by server", labels, \
            server.errors
        yield "rollout_learner_outstanding", "gauge", "learner calls waiting for an answer, by server", labels, \
            server.outstanding
        yield "rollout_learner_up", "gauge", "1 while the server is in the learner's pool", labels, server.up
    yield ("rollout_admission_pauses", "counter", "times admission waited for the trainer (off-policy bound)", {},
           pacer.pauses)
    yield "rollout_admission_paused_seconds", "counter", "time admission waited for the trainer", {}, pacer.paused_s
    yield ("rollout_admission_claims_lost", "counter", "admitted groups not emitted: their claim was released while "
           "this arena was frozen past its lease", {}, pacer.lost)
    yield "rollout_transactions", "counter", "committed transactions", {}, e.transactions
    yield "rollout_aborts", "counter", "transactions aborted", {}, e.aborted
    for topic, n in list(e.by_topic.items()):
        yield "rollout_records_out", "counter", "records written by committed transactions", {"topic": topic}, n


def policy_server_samples(server: Any) -> Iterator[Sample]:
    yield "rollout_policy_requests", "counter", "chat completions served", {}, server.requests_served
    yield "rollout_policy_batches", "counter", "generation batches run", {}, server.batches_run
    yield "rollout_policy_revision", "gauge", "the revision the server holds", {}, server.policy.revision


def vllm_samples(server: Any) -> Iterator[Sample]:
    proc = getattr(server, "proc", None)
    up = proc is not None and proc.returncode is None
    yield "rollout_vllm_up", "gauge", "1 while the vLLM server process runs (its own metrics: its /metrics)", {}, up
