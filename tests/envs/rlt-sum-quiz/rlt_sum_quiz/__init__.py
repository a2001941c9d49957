"""rlt-sum-quiz: a single-turn addition quiz with its dataset as package data
(a verifiers.v1 taskset package; no Env, so verifiers plays it with SingleAgentEnv)."""

from rlt_sum_quiz.quiz import (
    SumQuizData,
    SumQuizTask,
    SumQuizTaskConfig,
    SumQuizTaskset,
    SumQuizTasksetConfig,
    last_int,
    split_file,
    splits,
)

__all__ = [
    "SumQuizData",
    "SumQuizTask",
    "SumQuizTaskConfig",
    "SumQuizTaskset",
    "SumQuizTasksetConfig",
    "last_int",
    "split_file",
    "splits",
]
