"""rlt-sum-quiz: a single-turn addition quiz whose dataset ships inside the package.

`data/<split>.jsonl` (package data, read with importlib.resources) holds rows
`{"id", "a", "b", "prompt", "answer"}`; the splits `train` (300 rows) and `test`
(48 rows) share no (a, b) pair. No Env is exported, so verifiers plays it with
`SingleAgentEnv` (one `agent` seat).

The one reward, `exact_answer`, is 1.0 when the last integer in the reply equals
the answer, else 0.0. `reward_bug = true` makes it raise on purpose — to test how
a raising reward function is handled downstream; `reward_error_rate` makes it raise
on that fraction of calls, and `reward_hang_rate` makes it wait for ever on that
fraction (as a hung tool or sandbox would), for chaos runs.
"""

import asyncio
import json
import random
import re
from importlib import resources
from importlib.resources.abc import Traversable

from pydantic import Field, model_validator

import verifiers.v1 as vf

DATASET = "rlt-sum-quiz"
_SPLIT_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_INT = re.compile(r"(?<![0-9])-?[0-9]{1,6}(?![0-9])")


def last_int(text: object) -> int | None:
    """The last integer written in `text`, or None. Never raises, whatever `text` is."""
    if not isinstance(text, str):
        return None
    found = _INT.findall(text.replace(",", ""))
    return int(found[-1]) if found else None


def data_dir() -> Traversable:
    return resources.files(__package__) / "data"


def splits() -> list[str]:
    """The dataset splits shipped in the package, sorted."""
    return sorted(
        entry.name.removesuffix(".jsonl")
        for entry in data_dir().iterdir()
        if entry.name.endswith(".jsonl")
    )


def split_file(split: str) -> Traversable:
    """The package-data file of `split`; FileNotFoundError naming it when absent."""
    path = data_dir() / f"{split}.jsonl"
    if not (isinstance(split, str) and _SPLIT_NAME.match(split) and path.is_file()):
        raise FileNotFoundError(
            f"{DATASET}: no dataset split {split!r} (data/{split}.jsonl); "
            f"splits: {', '.join(splits())}"
        )
    return path


class SumQuizData(vf.TaskData):
    a: int
    b: int
    answer: int


class SumQuizTaskConfig(vf.TaskConfig):
    reward_bug: bool = False
    """Make `exact_answer` raise (set through the taskset's `reward_bug`)."""
    reward_error_rate: float = Field(0.0, ge=0.0, le=1.0)
    """The fraction of `exact_answer` calls that raise."""
    reward_hang_rate: float = Field(0.0, ge=0.0, le=1.0)
    """The fraction of `exact_answer` calls that never return."""


class SumQuizTask(vf.Task[SumQuizData, vf.State, SumQuizTaskConfig]):
    @property
    def key(self) -> str:
        return self.data.id or self.hash

    @vf.reward
    async def exact_answer(self, trace: vf.Trace) -> float:
        if self.config.reward_bug:
            raise ValueError(
                f"{DATASET}: reward_bug is set, so exact_answer raises on purpose "
                f"(task {self.data.id})"
            )
        draw = random.random()
        if draw < self.config.reward_error_rate:
            raise ValueError(f"{DATASET}: exact_answer raised on purpose (reward_error_rate, task {self.data.id})")
        if draw > 1.0 - self.config.reward_hang_rate:
            await asyncio.Event().wait()  # never set: hangs as a wedged tool would
        return 1.0 if last_int(trace.last_reply) == self.data.answer else 0.0


class SumQuizTasksetConfig(vf.TasksetConfig):
    split: str = "train"
    """Which `data/<split>.jsonl` to load: `train` or `test`."""
    reward_bug: bool = False
    """Make the reward function raise (copied onto `task.reward_bug`)."""
    reward_error_rate: float = Field(0.0, ge=0.0, le=1.0)
    """The fraction of reward calls that raise (copied onto the task's config)."""
    reward_hang_rate: float = Field(0.0, ge=0.0, le=1.0)
    """The fraction of reward calls that never return (copied onto the task's config)."""
    task: SumQuizTaskConfig = SumQuizTaskConfig()

    @model_validator(mode="after")
    def _reward_faults_reach_tasks(self) -> "SumQuizTasksetConfig":
        # The task reads its own config (an env server rebuilds tasks from
        # `taskset.task`), so the taskset-level settings are carried there.
        update = {k: getattr(self, k) for k in ("reward_bug", "reward_error_rate", "reward_hang_rate")
                  if getattr(self, k) and not getattr(self.task, k)}
        if update:
            self.task = self.task.model_copy(update=update)
        return self


class SumQuizTaskset(vf.Taskset[SumQuizTask, SumQuizTasksetConfig]):
    def __init__(self, config: SumQuizTasksetConfig) -> None:
        super().__init__(config)
        self.path = split_file(config.split)  # an unknown split fails at construction

    def load(self) -> list[SumQuizTask]:
        tasks = []
        with self.path.open("r", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                row = json.loads(line)
                tasks.append(
                    SumQuizTask(
                        SumQuizData(
                            id=row["id"],
                            name=row["id"],
                            prompt=row["prompt"],
                            a=row["a"],
                            b=row["b"],
                            answer=row["answer"],
                        ),
                        self.config.task,
                    )
                )
        return tasks
