"""rlt-pose-solve: a proposer writes an addition problem, `num_solvers` solvers answer
it (a verifiers.v1 env package with seats `proposer` and `solver`)."""

from rlt_pose_solve.pose import (
    PoseData,
    PoseSolveEnv,
    PoseSolveEnvConfig,
    PoseSolveTaskset,
    PoseSolveTasksetConfig,
    PoseTask,
    SolveData,
    SolveTask,
    goldilocks,
    last_int,
    parse_problem,
)

__all__ = [
    "PoseData",
    "PoseSolveEnv",
    "PoseSolveEnvConfig",
    "PoseSolveTaskset",
    "PoseSolveTasksetConfig",
    "PoseTask",
    "SolveData",
    "SolveTask",
    "goldilocks",
    "last_int",
    "parse_problem",
]
