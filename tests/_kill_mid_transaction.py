"""Subprocess for test_producers_kafka: runs the arena against an echo endpoint with a KafkaEmitter whose
transaction pauses after every message was sent (and acknowledged) but before the commit; prints
``SENT <rollout ids>`` and waits to be SIGKILLed.

    python tests/_kill_mid_transaction.py BOOTSTRAP TRANSACTIONAL_ID STEPS_TOPIC ROLLOUTS_TOPIC
"""

import asyncio
import sys

from producers.arena.config import ArenaConfig
from producers.arena.arena import Arena
from producers.environments.dataset import Example
from producers.inference.echo_server import EchoServer
from producers.arena.emitter import KafkaEmitter
from producers.environments.types import Environment
from producers.environments.episodes import MultiTurnEpisode, user
from schemas.plan_compiler import compile_plan
from schemas.scoring import ScoringSpec


class TwoTurns(MultiTurnEpisode):
    async def env_response(self, messages, state):
        return [user("again")]


async def main(bootstrap: str, txn_id: str, steps_topic: str, rollouts_topic: str) -> None:
    async def hang(results):
        ids = " ".join(r.rollout.rollout_id for res in results for r in res.walk())
        print(f"SENT {ids}", flush=True)
        await asyncio.Event().wait()

    env = Environment(name="killme", version="1", dataset=[Example(id="x", prompt="partial")],
                      episode=TwoTurns(max_turns=2), scoring=ScoringSpec(kind="exact_match", answer="x"))
    plan = compile_plan("examples/plans/arithmetic.toml").model_copy(update={"group_size": 1})
    emitter = KafkaEmitter({"bootstrap_servers": bootstrap}, txn_id, steps_topic=steps_topic,
                           rollouts_topic=rollouts_topic, before_commit=hang)
    async with EchoServer() as echo:
        async with Arena(plan, {"k": env}, emitter=emitter, config=ArenaConfig(policy_base_url=echo.base_url)) as arena:
            await arena.run(num_groups=1)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
