"""Episodes: rollout protocols, in the vocabulary of the self-play seeds.

An ``Episode`` runs one rollout against a ``RolloutContext`` (given by the arena): every model call
goes through ``ctx.call_model(member_id, messages)``, which routes it through the GenerationPlan and
records it as a Step; ``ctx.spawn(...)`` runs sub-episodes whose rollouts become children of this one.
Episode objects are shared by all rollouts of an environment and must keep no per-rollout state on
``self``: per-rollout state lives in the ``EpisodeState`` the arena creates for each rollout.

Kinds
-----
* ``SingleTurnEpisode``: prompt in, completion out (``MultiTurnEpisode`` with ``max_turns=1``).
* ``MultiTurnEpisode`` (the seeds' ``ChatEpisode``): ``env_response(messages, state)`` hook between
  model turns, ``@stop`` methods as termination conditions, ``max_turns``.
* ``AlternatingRolesEpisode``: two members take turns; each sees its own turns as ``assistant`` and
  the other's as ``user`` messages prefixed with the speaker.
* ``ToolEpisode``: Python functions become OpenAI tools (``producers.environments.tools``); calls are dispatched and
  their results fed back as ``tool`` messages; ends when the model answers without a tool call
  (completed) or at ``max_turns`` (truncated).
* ``StatefulToolEpisode``: ``setup_state(state)`` per rollout (a sandbox, a connection),
  ``update_tool_args(name, args, messages, state)`` injects it into the arguments (the injected
  parameters are hidden from the schema), ``cleanup_state(state)`` always runs at the end.
* hierarchical: any episode may ``await ctx.spawn(sub_episode, examples, scoring=...)``; each child is a
  Rollout of its own with ``parent_rollout_id``, the parent lists ``child_rollout_ids``, and the
  children share the parent's ``root_group_id``.

Lifecycle (the arena): ``state = EpisodeState(...)``; ``await episode.setup_state(state)``;
``await episode.rollout(ctx, state)``; ``artifacts = episode.finalize(state)``; always
``await episode.cleanup_state(state)``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from producers.environments.tools import ToolError, ToolRegistry
from schemas.events import ChatMessage, Rollout, Step, ToolCall

if TYPE_CHECKING:
    from producers.environments.dataset import Example
    from producers.inference.client import Completion
    from schemas.scoring import ScoringSpec


def system(text: str) -> ChatMessage:
    return ChatMessage(role="system", content=text)


def user(text: str, name: str | None = None) -> ChatMessage:
    return ChatMessage(role="user", content=text, name=name)


def assistant(text: str | None, name: str | None = None, tool_calls: Sequence[ToolCall] = ()) -> ChatMessage:
    return ChatMessage(role="assistant", content=text, name=name, tool_calls=list(tool_calls))


def as_messages(prompt: str | list[dict[str, Any]] | list[ChatMessage]) -> list[ChatMessage]:
    if isinstance(prompt, str):
        return [user(prompt)]
    return [m if isinstance(m, ChatMessage) else ChatMessage.model_validate(m) for m in prompt]


def stop(fn: Callable) -> Callable:
    """Mark a method ``(self, state) -> bool`` (sync or async) as a stop condition."""
    fn.__rollout_stop__ = True  # type: ignore[attr-defined]
    return fn


@dataclass
class GenerateResult:
    """One finished rollout, its steps, and its children's results (a tree for hierarchical episodes)."""

    rollout: Rollout
    steps: list[Step]
    children: list[GenerateResult] = field(default_factory=list)

    def walk(self):
        for c in self.children:
            yield from c.walk()
        yield self

    @property
    def completion_tokens(self) -> int:
        return sum(len(s.completion_token_ids) for r in self.walk() for s in r.steps)

    @property
    def training_records(self) -> int:
        """The training records credit assignment makes of this rollout and its sub-episodes: one per trainable
        step with tokens, none of a failed rollout (``consumers.scoring.trainable_steps``, ``consumers.credit``)."""
        return sum(1 for r in self.walk() if r.rollout.status != "failed" for s in r.steps
                   if s.trainable and len(s.completion_token_ids))


@dataclass
class EpisodeState:
    """Per-rollout state. ``data`` is the episode's own scratch space (tool handles go here)."""

    rollout_id: str
    example: Example
    messages: list[ChatMessage] = field(default_factory=list)
    turn: int = 0
    completions: list[Completion] = field(default_factory=list)
    children: list[GenerateResult] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    status: str = "completed"
    stop_reason: str | None = None

    @property
    def last_assistant(self) -> ChatMessage | None:
        for m in reversed(self.messages):
            if m.role == "assistant":
                return m
        return None


class RolloutContext(Protocol):
    rollout_id: str
    sample_seed: int

    async def call_model(self, member_id: str, messages: Sequence[ChatMessage], *,
                         tools: list[dict[str, Any]] | None = None,
                         sampling: dict[str, Any] | None = None) -> Completion: ...

    async def spawn(self, episode: Episode, examples: Sequence[Example], *,
                    scoring: ScoringSpec | Callable[[Example, EpisodeState], ScoringSpec] | None = None,
                    ) -> list[GenerateResult]: ...


class Episode:
    """Base: subclasses implement ``rollout``. ``members`` lists every seat the episode may call."""

    episode_type: ClassVar[str] = "episode"
    members: tuple[str, ...] = ("policy",)
    sampling: dict[str, dict[str, Any]] = {}

    async def setup_state(self, state: EpisodeState) -> None:
        """Per-rollout setup (called before ``rollout``)."""

    async def cleanup_state(self, state: EpisodeState) -> None:
        """Per-rollout teardown (always called, also after a failure)."""

    async def rollout(self, ctx: RolloutContext, state: EpisodeState) -> None:
        raise NotImplementedError

    def finalize(self, state: EpisodeState) -> dict[str, Any]:
        """Summary artifacts for the verifier (JSON). Default: final answers and a text transcript."""
        final: dict[str, str | None] = {}
        for m in state.messages:
            if m.role == "assistant":
                final[m.name or self.members[0]] = m.content
        return {
            "final_text": state.last_assistant.content if state.last_assistant else None,
            "final_by_member": final,
            "transcript": [{"role": m.role, "name": m.name, "content": m.content,
                            **({"tool_calls": [c.model_dump() for c in m.tool_calls]} if m.tool_calls else {}),
                            **({"tool_call_id": m.tool_call_id} if m.tool_call_id else {})}
                           for m in state.messages],
            "turns": state.turn,
            "stop_reason": state.stop_reason,
        }


class MultiTurnEpisode(Episode):
    """The chat loop: model turn, ``env_response``, until a ``@stop`` condition or ``max_turns``.

    ``truncate_at_max_turns``: whether running out of turns marks the rollout ``truncated``
    (tool use: yes; a fixed-length dialogue: no).
    """

    episode_type: ClassVar[str] = "multi_turn"
    members: tuple[str, ...] = ("policy",)
    truncate_at_max_turns: bool = False

    def __init__(self, *, max_turns: int = 4, system_prompt: str | None = None, member: str | None = None) -> None:
        if max_turns < 1:
            raise ValueError("max_turns must be >= 1")
        self.max_turns = max_turns
        self.system_prompt = system_prompt
        if member is not None:
            self.members = (member,)

    # hooks --------------------------------------------------------------------------------------

    async def initial_messages(self, state: EpisodeState) -> list[ChatMessage]:
        msgs = as_messages(state.example.prompt)
        if self.system_prompt and not (msgs and msgs[0].role == "system"):
            msgs.insert(0, system(self.system_prompt))
        return msgs

    async def env_response(self, messages: list[ChatMessage], state: EpisodeState) -> list[ChatMessage]:
        """The environment's next message(s) after a model turn (default: none)."""
        return []

    def member_for_turn(self, state: EpisodeState) -> str:
        return self.members[0]

    def prompt_for(self, member: str, state: EpisodeState) -> list[ChatMessage]:
        return list(state.messages)

    def tools_for(self, member: str, state: EpisodeState) -> list[dict[str, Any]] | None:
        return None

    # loop ---------------------------------------------------------------------------------------

    async def is_done(self, state: EpisodeState) -> bool:
        for name in dir(type(self)):
            fn = getattr(type(self), name, None)
            if callable(fn) and getattr(fn, "__rollout_stop__", False):
                result = getattr(self, name)(state)
                if inspect.isawaitable(result):
                    result = await result
                if result:
                    state.stop_reason = name
                    return True
        return False

    async def rollout(self, ctx: RolloutContext, state: EpisodeState) -> None:
        state.messages = await self.initial_messages(state)
        while True:
            if await self.is_done(state):
                return
            if state.turn >= self.max_turns:
                state.stop_reason = "max_turns"
                if self.truncate_at_max_turns:
                    state.status = "truncated"
                return
            member = self.member_for_turn(state)
            comp = await ctx.call_model(member, self.prompt_for(member, state), tools=self.tools_for(member, state))
            state.completions.append(comp)
            msg = comp.message.model_copy(update={"name": member})
            state.messages.append(msg)
            state.turn += 1
            if await self.is_done(state) or state.turn >= self.max_turns:
                continue  # the loop head records the reason
            state.messages.extend(await self.env_response(state.messages, state))


class SingleTurnEpisode(MultiTurnEpisode):
    episode_type: ClassVar[str] = "single_turn"

    def __init__(self, *, system_prompt: str | None = None, member: str | None = None) -> None:
        super().__init__(max_turns=1, system_prompt=system_prompt, member=member)

    async def rollout(self, ctx: RolloutContext, state: EpisodeState) -> None:
        await super().rollout(ctx, state)
        state.stop_reason = "single_turn"


class AlternatingRolesEpisode(MultiTurnEpisode):
    """Two members take turns for ``max_turns`` turns (``members[0]`` opens).

    ``role_prompts[member]`` is that member's system prompt. Each member's prompt shows its own past
    turns as ``assistant`` and the other member's as ``user`` messages ``"<member>: <text>"``.
    """

    episode_type: ClassVar[str] = "alternating_roles"

    def __init__(self, members: tuple[str, str], *, max_turns: int = 4,
                 role_prompts: dict[str, str] | None = None) -> None:
        super().__init__(max_turns=max_turns)
        if len(members) != 2 or members[0] == members[1]:
            raise ValueError("AlternatingRolesEpisode needs two distinct members")
        self.members = tuple(members)
        self.role_prompts = role_prompts or {}

    def member_for_turn(self, state: EpisodeState) -> str:
        return self.members[state.turn % 2]

    def prompt_for(self, member: str, state: EpisodeState) -> list[ChatMessage]:
        out: list[ChatMessage] = []
        if self.role_prompts.get(member):
            out.append(system(self.role_prompts[member]))
        for m in state.messages:
            if m.role == "assistant" and m.name == member:
                out.append(assistant(m.content))
            elif m.role == "assistant":
                out.append(user(f"{m.name}: {m.content or ''}"))
            elif m.role == "system" and out and self.role_prompts.get(member):
                continue
            else:
                out.append(m)
        return out


class ToolEpisode(MultiTurnEpisode):
    """Tool use: ends when the model answers without calling a tool, or at ``max_turns`` (truncated)."""

    episode_type: ClassVar[str] = "tool_use"
    truncate_at_max_turns = True
    injected_args: tuple[str, ...] = ()

    def __init__(self, tools: Sequence[Callable[..., Any]], *, max_turns: int = 6, system_prompt: str | None = None,
                 member: str | None = None) -> None:
        super().__init__(max_turns=max_turns, system_prompt=system_prompt, member=member)
        self.registry = ToolRegistry(tools, hidden=self.injected_args)
        self._schemas = self.registry.schemas

    def tools_for(self, member: str, state: EpisodeState) -> list[dict[str, Any]] | None:
        return self._schemas

    @stop
    def no_tool_calls(self, state: EpisodeState) -> bool:
        last = state.messages[-1] if state.messages else None
        return last is not None and last.role == "assistant" and not last.tool_calls

    def update_tool_args(self, tool_name: str, args: dict[str, Any], messages: list[ChatMessage],
                         state: EpisodeState) -> dict[str, Any]:
        return args

    async def env_response(self, messages: list[ChatMessage], state: EpisodeState) -> list[ChatMessage]:
        last = messages[-1]
        out = []
        for call in last.tool_calls:
            state.data.setdefault("tool_calls_made", 0)
            state.data["tool_calls_made"] += 1
            try:
                args = self.registry.parse_arguments(call.name, call.arguments)
                args = self.update_tool_args(call.name, args, messages, state)
                result = await self.registry.call(call.name, args)
            except ToolError as e:
                result = f"error: {e}"
                state.data["tool_errors"] = state.data.get("tool_errors", 0) + 1
            except Exception as e:  # noqa: BLE001 - a failing tool is the model's feedback, not a crash
                result = f"error: {type(e).__name__}: {e}"
                state.data["tool_errors"] = state.data.get("tool_errors", 0) + 1
            out.append(ChatMessage(role="tool", content=result, tool_call_id=call.id, name=call.name))
        return out

    def finalize(self, state: EpisodeState) -> dict[str, Any]:
        art = super().finalize(state)
        art["tool_calls_made"] = state.data.get("tool_calls_made", 0)
        art["tool_errors"] = state.data.get("tool_errors", 0)
        return art


class StatefulToolEpisode(ToolEpisode):
    """Tools with per-rollout state. Subclasses set ``injected_args`` and implement ``setup_state``.

    The default ``update_tool_args`` injects ``state.data[name]`` for every injected parameter the
    tool accepts; those parameters never appear in the tool schema the model sees, and the model
    cannot override them (an injected value always wins over a model-supplied one).
    """

    episode_type: ClassVar[str] = "stateful_tool_use"

    async def setup_state(self, state: EpisodeState) -> None:
        raise NotImplementedError("StatefulToolEpisode subclasses create per-rollout state in setup_state")

    def update_tool_args(self, tool_name: str, args: dict[str, Any], messages: list[ChatMessage],
                         state: EpisodeState) -> dict[str, Any]:
        fn = self.registry.functions[tool_name]
        params = inspect.signature(fn).parameters
        args = {k: v for k, v in args.items() if k not in self.injected_args}
        for name in self.injected_args:
            if name in params:
                args[name] = state.data[name]
        return args
