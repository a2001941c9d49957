"""rlt-word-lookup: "what is the secret number of WORD?", answerable only through the `words_lookup` tool (an
`@vf.tool` method of an MCP toolset, as verifiers' own `glossary` ships one).

Each task's prompt is a conversation resumed after one tool exchange: the user's question, the assistant's call
`words_lookup({"word": WORD})` and the tool's answer. The toolset stays offered, so the seat may call it again
(verifiers runs the chat program with the tool's MCP server). The model's next reply is scored:
* `answered` (weight 1): the last reply holds the secret number, which only the tool's answer tells.
The task's `id` is the word, also its `Task.key`.
"""

import json

import verifiers.v1 as vf

from rlt_word_lookup.toolset import WordsToolset, secret

WORDS = (
    "apple river candle tiger piano cloud stone maple lemon garden window silver rocket forest "
    "island pepper violin castle harbor meadow orange pencil shadow thunder"
).split()


class WordLookupData(vf.TaskData):
    word: str
    answer: int


class WordLookupTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


def resumed_prompt(word: str) -> list:
    """The question, the assistant's tool call and the tool's answer: a trajectory one tool turn in."""
    call = vf.ToolCall(id=f"call-{word}", name=f"{WordsToolset.TOOL_PREFIX}_lookup",
                       arguments=json.dumps({"word": word}))
    return [
        vf.UserMessage(content=f'What is the secret number of the word "{word}"? Call the `words_lookup` tool '
                               "with the word, then reply with the number."),
        vf.AssistantMessage(content=None, tool_calls=[call]),
        vf.ToolMessage(tool_call_id=call.id, name=call.name, content=str(secret(word))),
    ]


class WordLookupTask(vf.Task[WordLookupData, vf.State, WordLookupTaskConfig]):
    @property
    def key(self) -> str:
        return self.data.id or self.hash

    @classmethod
    def toolsets(cls, config: WordLookupTaskConfig) -> list[vf.Toolset]:
        return [WordsToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def answered(self, trace: vf.Trace) -> float:
        return float(str(self.data.answer) in (trace.last_reply or ""))


class WordLookupTasksetConfig(vf.TasksetConfig):
    task: WordLookupTaskConfig = WordLookupTaskConfig()


class WordLookupTaskset(vf.Taskset[WordLookupTask, WordLookupTasksetConfig]):
    def load(self) -> list[WordLookupTask]:
        return [
            WordLookupTask(
                WordLookupData(idx=i, id=word, word=word, answer=secret(word), prompt=resumed_prompt(word)),
                self.config.task,
            )
            for i, word in enumerate(WORDS)
        ]
