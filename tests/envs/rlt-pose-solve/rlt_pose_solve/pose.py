"""rlt-pose-solve: a proposer/solver hierarchy over small additions.

Each task is a topic seed. The `proposer` seat is asked to write one addition
problem `a + b` with small numbers (0..max_operand). The env parses the first
`a + b` in its reply; a reply without one (or with numbers out of range) falls back
to the task's built-in problem, and then the proposer earns 0. The `solver` seat
then answers the problem `num_solvers` times, each a trace of its own, rewarded
`exact_answer` (1/0: the last integer in the reply equals a + b). The proposer's
reward is the goldilocks score `1 - 2 * |solve_rate - 0.5|`: 1 when half the
solvers get it right, 0 when all or none do.
"""

import asyncio
import re
from typing import ClassVar

from pydantic import Field

import verifiers.v1 as vf

_INT = re.compile(r"(?<![0-9])-?[0-9]{1,6}(?![0-9])")
_PROBLEM = re.compile(r"(?<![0-9])([0-9]{1,4})\s*\+\s*([0-9]{1,4})(?![0-9])")


def last_int(text: object) -> int | None:
    """The last integer written in `text`, or None. Never raises, whatever `text` is."""
    if not isinstance(text, str):
        return None
    found = _INT.findall(text.replace(",", ""))
    return int(found[-1]) if found else None


def parse_problem(text: object, max_operand: int) -> tuple[int, int] | None:
    """The first `a + b` in `text` with both operands in 0..max_operand, else None.
    Never raises, whatever `text` is."""
    if not isinstance(text, str):
        return None
    for match in _PROBLEM.finditer(text):
        a, b = int(match.group(1)), int(match.group(2))
        if 0 <= a <= max_operand and 0 <= b <= max_operand:
            return a, b
    return None


def goldilocks(solve_rate: float) -> float:
    """1 at a 50% solve rate, falling linearly to 0 at 0% and 100%."""
    return 1.0 - 2.0 * abs(solve_rate - 0.5)


class PoseData(vf.TaskData):
    topic: str
    max_operand: int
    fallback_a: int
    fallback_b: int
    """The problem the solvers get when the proposer's reply holds none."""


class PoseTask(vf.Task[PoseData]):
    """The proposer's task: no per-trace reward — it is judged in the env's
    `finalize()` by what its problem does to the solvers."""

    @property
    def key(self) -> str:
        return self.data.id or self.hash


class SolveData(vf.TaskData):
    a: int
    b: int
    answer: int
    proposed: bool
    """Whether the problem is the proposer's (False: the fallback)."""


class SolveTask(vf.Task[SolveData]):
    @property
    def key(self) -> str:
        return self.data.id or self.hash

    @vf.reward
    async def exact_answer(self, trace: vf.Trace) -> float:
        return 1.0 if last_int(trace.last_reply) == self.data.answer else 0.0


class PoseSolveTasksetConfig(vf.TasksetConfig):
    max_operand: int = Field(20, ge=1, le=999)
    """Largest operand the proposer may use (and the fallback problems use)."""


class PoseSolveTaskset(vf.Taskset[PoseTask, PoseSolveTasksetConfig]):
    TOPICS: ClassVar[tuple[str, ...]] = (
        "apples", "marbles", "birds", "books", "coins",
        "stickers", "cookies", "pencils", "shells", "balloons",
        "stamps", "buttons", "flowers", "trains", "ducks",
        "keys", "cups", "boats", "socks", "stars",
    )  # fmt: skip

    def load(self) -> list[PoseTask]:
        top = self.config.max_operand
        tasks = []
        for i, topic in enumerate(self.TOPICS):
            # A fixed fallback per seed, inside 0..max_operand.
            a, b = (3 * i + 2) % (top + 1), (7 * i + 5) % (top + 1)
            tasks.append(
                PoseTask(
                    PoseData(
                        id=f"pose-{i:02d}-{topic}",
                        name=topic,
                        prompt=(
                            f"Write one addition problem about {topic} using two whole "
                            f"numbers from 0 to {top}. Reply with just the problem in the "
                            "form `a + b`, for example `4 + 9`."
                        ),
                        topic=topic,
                        max_operand=top,
                        fallback_a=a,
                        fallback_b=b,
                    ),
                    self.config.task,
                )
            )
        return tasks


def solve_task(task: PoseTask, proposer: vf.Trace) -> SolveTask:
    """The solvers' task, minted from the proposer's reply (or the fallback)."""
    parsed = parse_problem(proposer.last_reply, task.data.max_operand)
    a, b = parsed if parsed is not None else (task.data.fallback_a, task.data.fallback_b)
    return SolveTask(
        SolveData(
            idx=task.data.idx,
            id=f"{task.data.id}/solve/{a}+{b}",
            prompt=f"What is {a} + {b}? Answer with a number.",
            a=a,
            b=b,
            answer=a + b,
            proposed=parsed is not None,
        )
    )


class PoseSolveEnvConfig(vf.EnvConfig):
    proposer: vf.AgentConfig = vf.AgentConfig(
        harness={"id": "null"}, runtime={"type": "subprocess"}
    )
    solver: vf.AgentConfig = vf.AgentConfig(
        harness={"id": "null"}, runtime={"type": "subprocess"}
    )
    num_solvers: int = Field(2, ge=1)
    """Independent solver runs (traces of seat `solver`) per proposed problem."""


class PoseSolveEnv(vf.Env[PoseSolveEnvConfig]):
    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        proposer = await agents.proposer.run(task)
        minted = solve_task(task, proposer)
        proposer.info["pose_solve"] = {
            "problem": f"{minted.data.a} + {minted.data.b}",
            "proposed": minted.data.proposed,
        }
        # Independent runs; the episode's agent gate decides how many run at once.
        await asyncio.gather(
            *(agents.solver.run(minted) for _ in range(self.config.num_solvers))
        )

    async def finalize(self, task: vf.Task, episode: vf.Episode) -> None:
        by_seat = episode.by_agent
        solvers = by_seat.get("solver", [])
        scores = [
            reward.score if (reward := t.rewards.get("exact_answer")) is not None else 0.0
            for t in solvers
        ]
        rate = sum(scores) / len(scores) if scores else 0.0
        for proposer in by_seat.get("proposer", []):
            proposed = solve_task(task, proposer).data.proposed
            proposer.record_metric("solve_rate", rate)
            proposer.record_metric("valid_problem", float(proposed))
            proposer.record_reward("goldilocks", goldilocks(rate) if proposed else 0.0)
