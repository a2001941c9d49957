"""rlt-word-lookup: the answer is a secret number only the `words_lookup` MCP tool knows
(a verifiers.v1 taskset package; no Env, so verifiers plays it with SingleAgentEnv)."""

from rlt_word_lookup.taskset import (
    WORDS,
    WordLookupData,
    WordLookupTask,
    WordLookupTaskConfig,
    WordLookupTaskset,
    WordLookupTasksetConfig,
)
from rlt_word_lookup.toolset import WordsToolset, secret

__all__ = [
    "WORDS",
    "WordLookupData",
    "WordLookupTask",
    "WordLookupTaskConfig",
    "WordLookupTaskset",
    "WordLookupTasksetConfig",
    "WordsToolset",
    "secret",
]
