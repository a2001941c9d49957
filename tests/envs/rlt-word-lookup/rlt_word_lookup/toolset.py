"""The one tool: `words_lookup(word)` returns the word's secret number. verifiers launches this module
(`python -m rlt_word_lookup.toolset`) as an MCP server per rollout, unless the toolset is colocated."""

import hashlib

import verifiers.v1 as vf


def secret(word: str) -> int:
    """A word's secret number: 100..999, stable across processes (not Python's salted hash)."""
    return 100 + int(hashlib.sha256(word.strip().lower().encode()).hexdigest(), 16) % 900


class WordsToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "words"

    @vf.tool
    def lookup(self, word: str) -> str:
        """Look up the secret number of a word."""
        return str(secret(word))


if __name__ == "__main__":
    WordsToolset.run()
