"""rlt-tally-duel: an endless seeded two-seat guessing duel (a verifiers.v1 env package)."""

from rlt_tally_duel.duel import (
    TallyDuelData,
    TallyDuelEnv,
    TallyDuelEnvConfig,
    TallyDuelTask,
    TallyDuelTaskset,
    TallyDuelTasksetConfig,
    duel_outcome,
    last_int,
)

__all__ = [
    "TallyDuelData",
    "TallyDuelEnv",
    "TallyDuelEnvConfig",
    "TallyDuelTask",
    "TallyDuelTaskset",
    "TallyDuelTasksetConfig",
    "duel_outcome",
    "last_int",
]
