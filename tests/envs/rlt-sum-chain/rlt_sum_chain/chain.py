"""rlt-sum-chain: keep a running total across turns, as verifiers' alphabet-sort keeps a sorted list.

Each task is a multi-turn episode driven by a scripted user (the env's `run()` replays the
task's pre-generated `user_turns` through an interaction, as alphabet-sort's does): the first
turn gives a start number and one to add, each later turn one more number to add; the
assistant replies with the total so far. The reward is the fraction of turns whose reply's
last integer is the running total. The taskset is INFINITE and seeded: the same seed gives
the same tasks, `chain-<seed>-<i>` their durable ids. No dataset to download.
"""

import itertools
import random
import re
from collections.abc import Iterator

import verifiers.v1 as vf

_INT = re.compile(r"(?<![0-9])-?[0-9]{1,6}(?![0-9])")


def last_int(text: object) -> int | None:
    """The last integer written in `text`, or None. Never raises, whatever `text` is."""
    if not isinstance(text, str):
        return None
    found = _INT.findall(text)
    return int(found[-1]) if found else None


class SumChainConfig(vf.TasksetConfig):
    seed: int = 0
    """Seed of the task stream."""
    min_turns: int = 2
    max_turns: int = 3
    """Each task draws its number of user turns (assistant replies) in [min_turns, max_turns]."""
    max_operand: int = 9


class SumChainData(vf.TaskData):
    user_turns: list[str]
    """What the scripted user says, turn by turn."""
    totals: list[int]
    """The running total each reply should give."""


class SumChainTask(vf.Task[SumChainData]):
    @property
    def key(self) -> str:
        return self.data.id or self.hash

    @vf.reward(weight=1.0)
    async def running_total(self, trace: vf.Trace) -> float:
        replies = [m.content or "" for m in trace.assistant_messages]
        totals = self.data.totals
        right = sum(1 for t, want in enumerate(totals) if t < len(replies) and last_int(replies[t]) == want)
        return right / len(totals)


class SumChainTaskset(vf.Taskset[SumChainTask, SumChainConfig]):
    INFINITE = True

    def load(self) -> Iterator[SumChainTask]:
        c = self.config
        assert 1 <= c.min_turns <= c.max_turns, "need 1 <= min_turns <= max_turns"
        rng = random.Random(c.seed)
        for i in itertools.count():
            total = rng.randint(1, c.max_operand)
            turns, totals = [], []
            for t in range(rng.randint(c.min_turns, c.max_turns)):
                add = rng.randint(1, c.max_operand)
                turns.append(f"Start with {total}. Add {add}. Reply with just the total." if t == 0
                             else f"Now add {add}. Reply with just the new total.")
                total += add
                totals.append(total)
            yield SumChainTask(SumChainData(id=f"chain-{c.seed}-{i}", name=f"chain#{i}", prompt=None,
                                            user_turns=turns, totals=totals), self.config.task)


class SumChainEnv(vf.SingleAgentEnv):
    """Replays each task's user turns as the run's user."""

    async def run(self, task, agents):
        async with agents.agent.interaction(task) as interaction:
            for prompt in task.data.user_turns:
                if (await interaction.turn(prompt)).terminated:
                    break
