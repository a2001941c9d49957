"""rlt-tally-duel: an endless, seeded, two-seat number-guessing duel.

Each task hides a whole number from 1 to 20 and gives a hint (a range around it).
`player0` guesses first; `player1` then guesses knowing player0's guess. The closer
guess wins: +1 for the winner, -1 for the loser (zero-sum), 0 each on a tie or when
neither reply holds a number. A reply with no number loses to one with a number.

The taskset is INFINITE: `load()` draws tasks forever from `random.Random(seed)`,
so the same `seed` gives the same stream, and each task's durable `id` is
`duel-<seed>-<i>` (also its `Task.key`).
"""

import itertools
import random
import re
from collections.abc import Iterator

import verifiers.v1 as vf

LOW, HIGH = 1, 20

# A run of 1-6 ASCII digits that is not part of a longer digit run. Longer runs are
# not numbers we care about, and int() on a many-thousand-digit string would raise.
_INT = re.compile(r"(?<![0-9])-?[0-9]{1,6}(?![0-9])")


def last_int(text: object) -> int | None:
    """The last integer written in `text`, or None. Never raises, whatever `text` is."""
    if not isinstance(text, str):
        return None
    found = _INT.findall(text)
    return int(found[-1]) if found else None


def duel_outcome(guess0: int | None, guess1: int | None, target: int) -> tuple[float, float]:
    """Zero-sum rewards (player0, player1): the closer guess wins +1/-1, a tie or two
    missing guesses 0/0; a missing guess loses to a present one."""
    if guess0 is None and guess1 is None:
        return 0.0, 0.0
    if guess0 is None:
        return -1.0, 1.0
    if guess1 is None:
        return 1.0, -1.0
    d0, d1 = abs(guess0 - target), abs(guess1 - target)
    if d0 == d1:
        return 0.0, 0.0
    return (1.0, -1.0) if d0 < d1 else (-1.0, 1.0)


class TallyDuelData(vf.TaskData):
    target: int
    """The hidden number (LOW..HIGH)."""
    hint_low: int
    hint_high: int
    """The hint: the target lies in hint_low..hint_high."""
    seed: int
    """The taskset seed this task was drawn under."""


class TallyDuelTask(vf.Task[TallyDuelData]):
    @property
    def key(self) -> str:
        # The durable id, not the content hash (which includes the run-local idx).
        return self.data.id or self.hash


class TallyDuelTasksetConfig(vf.TasksetConfig):
    seed: int = 0
    """Seed of the task stream: the same seed yields the same tasks, in order."""


class TallyDuelTaskset(vf.Taskset[TallyDuelTask, TallyDuelTasksetConfig]):
    INFINITE = True

    def load(self) -> Iterator[TallyDuelTask]:
        seed = self.config.seed
        rng = random.Random(seed)
        for i in itertools.count():
            target = rng.randint(LOW, HIGH)
            low = max(LOW, target - rng.randint(0, 5))
            high = min(HIGH, target + rng.randint(0, 5))
            prompt = (
                f"A whole number from {LOW} to {HIGH} is hidden. Hint: it is between "
                f"{low} and {high} (inclusive). You are Player 0; Player 1 guesses after "
                "you. The closer guess wins. Reply with just your guess, a single number."
            )
            yield TallyDuelTask(
                TallyDuelData(
                    id=f"duel-{seed}-{i}",
                    name=f"duel#{i}",
                    prompt=prompt,
                    target=target,
                    hint_low=low,
                    hint_high=high,
                    seed=seed,
                ),
                self.config.task,
            )


def player1_prompt(data: TallyDuelData, guess0: int | None) -> str:
    told = (
        f"Player 0 guessed {guess0}."
        if guess0 is not None
        else "Player 0 gave no valid guess."
    )
    return (
        f"A whole number from {LOW} to {HIGH} is hidden. Hint: it is between "
        f"{data.hint_low} and {data.hint_high} (inclusive). You are Player 1. {told} "
        "The closer guess wins. Reply with just your guess, a single number."
    )


class TallyDuelEnvConfig(vf.EnvConfig):
    player0: vf.AgentConfig = vf.AgentConfig(
        harness={"id": "null"}, runtime={"type": "subprocess"}
    )
    player1: vf.AgentConfig = vf.AgentConfig(
        harness={"id": "null"}, runtime={"type": "subprocess"}
    )


class TallyDuelEnv(vf.Env[TallyDuelEnvConfig]):
    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        first = await agents.player0.run(task)
        guess0 = last_int(first.last_reply)
        second = task.with_data(prompt=player1_prompt(task.data, guess0))
        await agents.player1.run(second)

    async def finalize(self, task: vf.Task, episode: vf.Episode) -> None:
        by_seat = episode.by_agent
        traces = [by_seat.get("player0", []), by_seat.get("player1", [])]
        guesses = [last_int(seat[-1].last_reply) if seat else None for seat in traces]
        target = task.data.target
        rewards = duel_outcome(guesses[0], guesses[1], target)
        for i, seat in enumerate(traces):
            for trace in seat:
                trace.record_reward("duel", rewards[i])
                trace.record_metric("parsed", float(guesses[i] is not None))
                trace.info["tally_duel"] = {
                    "seat": i,
                    "guess": guesses[i],
                    "other_guess": guesses[1 - i],
                    "target": target,
                    "task_id": task.data.id,
                }
