"""Run a ``verifiers.v1`` environment (verifiers 0.4.0) as an arena episode.

    env = vf.SingleAgentEnv(vf.SingleAgentEnvConfig(taskset={"id": "my_taskset"},
                                                    agent={"harness": {"id": CHAT_HARNESS_ID},
                                                           "runtime": {"type": "subprocess"}}))
    Arena(plan, {"x": verifiers_v1_environment(env, name="my-env", version="1")}, emitter=..., ...)

How it works (written against verifiers 0.4.0's own API, no private patching):

* Each arena rollout is one ``Env.run_episode(task, ModelContext)``: the env's ``setup``/``run``/``finalize``
  hooks, every seat's agent runs, the task's ``@reward``/``@metric`` methods and plugged judges, all by
  verifiers itself. The env's serving resources (its interception server, shared tools) are entered once,
  on the first rollout (``Env.serving()``), and held until ``await environment.episode.aclose()``.
* The run's client is an ``EvalClientConfig`` pointing at a ``CaptureProxy`` (an in-process
  OpenAI-compatible endpoint). verifiers' interception server forwards every model call of every seat to
  it with ``X-Session-ID: <trace id>``; the episode's ``on_trace`` hook (called when a seat's trace is
  minted, before any I/O, already stamped with its seat name) maps that trace id to the rollout and the
  seat's member. Each call then becomes ``ctx.call_model(member, messages, tools, sampling)``: routed by
  the GenerationPlan, recorded as a Step (token ids, logprobs, member id, ``trainable``, policy revision)
  and answered in the OpenAI shape, which verifiers records on its own trace.
* Harness: verifiers' bundled harnesses are programs launched with ``uv`` in a runtime. ``CHAT_HARNESS_ID``
  (``InProcessChatHarness``, registered on import of this module as the plugin module
  ``rollout_log_chat``) is a tool-less chat harness that makes its one call per segment in-process, through
  the interception ``endpoint`` + ``secret`` exactly like a program would (verifiers' ``Harness.launch``
  contract allows this). It supports resume, so ``agent.interaction(...)`` multi-turn exchanges work. Any
  other harness works too where its runtime is available (``uv`` for the local ``subprocess`` runtime).
* Scoring: the rewards are the env's own. Each seat's reward is the mean of ``Trace.reward`` (verifiers'
  weighted sum of the trace's reward functions/judges, plus what ``Env.finalize`` recorded) over that seat's
  traces (one trace for most seats; a hierarchical env's solver seat runs several), kept in
  ``artifacts["verifiers"]["rewards_by_member"]`` with each trace's reward, the named components and metrics.
  The scoring spec is a ``rubric`` whose one function, ``producers.environments.verifiers_v1:verifiers_reward``, reads
  that recorded reward for the scored member (it raises when the env recorded none: no guessed reward, and
  when the env's reward function raised: the verifier dead-letters the rollout with that error).
* Seats -> members: ``members={"seat": "member"}`` (default: the seat name; ``SingleAgentEnv``'s one seat
  ``agent`` becomes ``member``, default ``"policy"``). Whether a member is trained is the plan's decision
  (``Step.trainable``); verifiers' own standing of each seat is kept in ``artifacts["verifiers"]["trainable"]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import sys
import types
from collections.abc import Mapping
from typing import Any, ClassVar

from producers.environments.dataset import Example, TaskStream
from producers.environments.types import Environment
from producers.environments.episodes import Episode, EpisodeState
from producers.inference.asgi_server import JSON, AppServer, Request, Response, body_json, error, json_app
from producers.inference.client import SAMPLING_KEYS, TOOL_KEYS, InferenceError, from_openai_message, to_openai_message
from schemas.events import ChatMessage
from schemas.scoring import ScoringSpec, WeightedFunc

log = logging.getLogger("rollout.verifiers")

EAGER_TASKS = 100_000
"""The most tasks a taskset that does not declare itself endless is read into memory at once: one that goes past it
(a ``load()`` that never ends, without ``INFINITE``) is drawn lazily instead of filling memory for ever."""

KEY_VAR = "ROLLOUT_VERIFIERS_V1_PROXY_KEY"
SESSION_HEADER = "x-session-id"  # verifiers.v1.clients.client.SESSION_ID_HEADER: the seat's trace id
CHAT_HARNESS_ID = "rollout_log_chat"
REWARD_FN = "producers.environments.verifiers_v1:verifiers_reward"


# -- the capture endpoint ------------------------------------------------------------------------------

class CaptureProxy:
    """OpenAI-compatible endpoint: each completion is a ``ctx.call_model`` of the rollout that owns the
    request's verifiers session (trace id)."""

    def __init__(self) -> None:
        self.http = AppServer(json_app({("POST", "/v1/chat/completions"): self._chat}))
        self.sessions: dict[str, tuple[Any, str, list[BaseException]]] = {}
        self._started = False
        self._lock = asyncio.Lock()

    @property
    def base_url(self) -> str:
        return self.http.base_url

    async def ensure_started(self) -> CaptureProxy:
        async with self._lock:
            if not self._started:
                await self.http.start()
                self._started = True
        return self

    async def aclose(self) -> None:
        if self._started:
            await self.http.stop()
            self._started = False

    async def _chat(self, req: Request) -> JSON:
        sid = req.headers.get(SESSION_HEADER)
        session = self.sessions.get(sid or "")
        if session is None:
            return error(400, f"unknown verifiers session {sid!r}: the capture proxy serves registered rollouts only")
        ctx, member, errors = session
        body = await body_json(req)
        try:
            messages = [from_openai_message(m) for m in body.get("messages") or []]
            sampling = {k: v for k, v in body.items()
                        if k in SAMPLING_KEYS | TOOL_KEYS and k != "n" and v is not None}
            comp = await ctx.call_model(member, messages, tools=body.get("tools") or None, sampling=sampling)
        except InferenceError as e:
            errors.append(e)  # the episode re-raises it: a failed Rollout with the reason
            return error(400, f"inference failed: {e}")
        except Exception as e:  # noqa: BLE001
            errors.append(e)
            return error(400, f"capture failed: {type(e).__name__}: {e}")
        message = to_openai_message(comp.message)
        message.pop("name", None)
        if message.get("tool_calls"):
            message["content"] = message.get("content") or None
        choice = {"index": 0, "message": message, "finish_reason": comp.finish_reason or "stop",
                  "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": lp, "bytes": [], "top_logprobs": []}
                                           for t, lp in zip(comp.completion_token_ids, comp.logprobs)]},
                  "token_ids": list(comp.completion_token_ids)}
        n_prompt, n_out = len(comp.prompt_token_ids), len(comp.completion_token_ids)
        completion = {"id": f"chatcmpl-{sid}-{n_prompt}", "object": "chat.completion", "created": 0,
                      "model": body.get("model", "policy"), "choices": [choice],
                      "prompt_token_ids": list(comp.prompt_token_ids),
                      "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                                "total_tokens": n_prompt + n_out}}
        if body.get("stream"):  # verifiers' programs stream, and its interception server relays them as asked
            from verifiers.v1.dialects import ChatDialect

            return Response(b"".join(ChatDialect().stream_events(completion)), media_type="text/event-stream")
        return JSON(completion)


# -- the in-process chat harness -----------------------------------------------------------------------

def _v1_to_openai(m: Any) -> dict[str, Any]:
    d = m.model_dump(mode="json", exclude_none=True) if hasattr(m, "model_dump") else dict(m)
    content = d.get("content")
    if isinstance(content, list):
        content = "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    out: dict[str, Any] = {"role": d["role"], "content": content}
    if d.get("tool_calls"):
        out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                              "function": {"name": c.get("name"), "arguments": c.get("arguments") or "{}"}}
                             for c in d["tool_calls"]]
    if d.get("tool_call_id"):
        out["tool_call_id"] = d["tool_call_id"]
    return out


def _harness_classes() -> tuple[type, type]:
    from verifiers.v1.configs.harness import HarnessConfig
    from verifiers.v1.harness import Harness
    from verifiers.v1.runtimes import ProgramResult

    class InProcessChatHarnessConfig(HarnessConfig):
        id: str = CHAT_HARNESS_ID
        timeout_s: float = 600.0

    class InProcessChatHarness(Harness[InProcessChatHarnessConfig]):
        """A tool-less chat segment: one model call through the rollout's interception endpoint, in-process."""

        APPENDS_SYSTEM_PROMPT = True
        SUPPORTS_RESUME = True
        EXECUTES_CODE = False
        NEEDS_CONTAINER = False

        _http: Any = None

        def _client(self) -> Any:
            """One HTTP client for every call of this harness (a client per call cost an SSL context each)."""
            import httpx

            if self._http is None or self._http.is_closed:
                self._http = httpx.AsyncClient(timeout=self.config.timeout_s)
            return self._http

        async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data,
                         tool_interception_url=None):  # noqa: ANN001 - verifiers' signature
            system, prompt = self.resolve_prompt(data)
            messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
            if isinstance(prompt, str):
                messages.append({"role": "user", "content": prompt})
            else:
                messages.extend(_v1_to_openai(m) for m in prompt or [])
            body = {"model": ctx.model, "messages": messages}
            r = await self._client().post(endpoint.rstrip("/") + "/chat/completions", json=body,
                                          headers={"Authorization": f"Bearer {secret}"})
            if r.status_code >= 400:
                return ProgramResult(exit_code=1, stdout="", stderr=f"model call failed: {r.status_code} {r.text}")
            return ProgramResult(exit_code=0, stdout=r.text, stderr="")

    return InProcessChatHarnessConfig, InProcessChatHarness


def register_plugin(module_name: str, *classes: type) -> types.ModuleType:
    """Make ``classes`` (a Taskset, Harness, Env subclass: one of each at most) loadable by verifiers under the
    plugin id ``module_name`` (verifiers resolves plugins by importing a top-level module and reading
    ``__all__``). For tasksets, harnesses and envs defined in code rather than in an installed package."""
    mod = types.ModuleType(module_name)
    for c in classes:
        setattr(mod, c.__name__, c)
    mod.__all__ = [c.__name__ for c in classes]  # type: ignore[attr-defined]
    sys.modules[module_name] = mod
    return mod


def register_chat_harness() -> type:
    """Register ``InProcessChatHarness`` as the verifiers harness ``CHAT_HARNESS_ID`` (idempotent)."""
    existing = sys.modules.get(CHAT_HARNESS_ID)
    if existing is not None:
        return existing.InProcessChatHarness
    _, harness = _harness_classes()
    register_plugin(CHAT_HARNESS_ID, harness)
    return harness


def chat_agent(**fields: Any) -> Any:
    """A ``vf.AgentConfig`` running the in-process chat harness in the local subprocess runtime."""
    from verifiers.v1 import AgentConfig

    register_chat_harness()
    return AgentConfig(**({"harness": {"id": CHAT_HARNESS_ID}, "runtime": {"type": "subprocess"}} | fields))


# -- scoring ------------------------------------------------------------------------------------------------

def verifiers_reward(state: Mapping[str, Any]) -> float:
    """The verifier's rubric function: the reward verifiers' env computed for this member."""
    rec = (state.get("artifacts") or {}).get("verifiers") or {}
    member = state.get("member")
    rewards = rec.get("rewards_by_member") or {}
    if member in (rec.get("reward_errors") or {}):
        raise ValueError(f"the verifiers env's reward raised for member {member!r}: {rec['reward_errors'][member]}")
    if rewards.get(member) is None:
        raise ValueError(f"the verifiers env recorded no reward for member {member!r} (has {sorted(rewards)})")
    return float(rewards[member])


# -- the episode ----------------------------------------------------------------------------------------------

def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _scoring_error(error: Any) -> bool:
    """A trace error from the task's scoring stage (verifiers 0.4 names the stage in a TaskError's message:
    ``task <Task> scoring: ...``); every other error means the episode itself failed."""
    return getattr(error, "type", "") == "TaskError" and " scoring: " in (getattr(error, "message", "") or "")


def _json(x: Any) -> Any:
    return json.loads(json.dumps(x, default=str))


class VerifiersV1Episode(Episode):
    episode_type: ClassVar[str] = "verifiers_v1"

    def __init__(self, vf_env: Any, *, members: Mapping[str, str] | None = None, member: str = "policy",
                 model: str = "policy") -> None:
        from verifiers.v1.configs.agent import agent_config_fields

        self.vf_env = vf_env
        seats = list(agent_config_fields(vf_env.config))
        default = {seats[0]: member} if len(seats) == 1 else {s: s for s in seats}
        self.seat_member = dict(default | dict(members or {}))
        unknown = set(self.seat_member) - set(seats)
        if unknown:
            raise ValueError(f"members name seats {sorted(unknown)} the env does not declare (it has {seats})")
        self.members = tuple(dict.fromkeys(self.seat_member[s] for s in seats))
        self.model = model
        self.proxy = CaptureProxy()
        self._stack: contextlib.AsyncExitStack | None = None
        self._serving_lock = asyncio.Lock()
        os.environ.setdefault(KEY_VAR, "captured-by-rollout-log")

    async def _ensure_serving(self) -> None:
        async with self._serving_lock:
            if self._stack is None:
                stack = contextlib.AsyncExitStack()
                await stack.enter_async_context(self.vf_env.serving())
                self._stack = stack

    async def aclose(self) -> None:
        """Leave the env's serving context and stop the capture endpoint."""
        if self._stack is not None:
            stack, self._stack = self._stack, None
            await stack.aclose()
        await self.proxy.aclose()

    def _member_of(self, trace: Any) -> str:
        name = getattr(getattr(trace, "agent", None), "name", None)
        if name in self.seat_member:
            return self.seat_member[name]
        if len(self.seat_member) == 1:
            return next(iter(self.seat_member.values()))
        raise ValueError(f"a trace of seat {name!r}, not one of {sorted(self.seat_member)}")

    async def rollout(self, ctx, state: EpisodeState) -> None:
        from verifiers.v1 import EvalClientConfig, ModelContext

        proxy = await self.proxy.ensure_started()
        await self._ensure_serving()
        errors: list[BaseException] = []
        trace_ids: list[str] = []

        def on_trace(trace: Any) -> None:
            proxy.sessions[trace.id] = (ctx, self._member_of(trace), errors)
            trace_ids.append(trace.id)

        mctx = ModelContext(model=self.model, client=EvalClientConfig(base_url=proxy.base_url, api_key_var=KEY_VAR))
        try:
            episode = await self.vf_env.run_episode(state.example.payload, mctx, on_trace=on_trace)
        finally:
            for t in trace_ids:
                proxy.sessions.pop(t, None)
        if errors:
            raise errors[0]
        problems = [f"{e.type}: {e.message}" for e in episode.errors]
        # a reward function that raised: verifiers records it on the trace as a TaskError of the task's scoring
        # stage; the episode itself ran, so the rollout is kept and the verifier refuses to score that member
        # (a dead letter naming the error), instead of the rollout being lost as failed
        reward_errors: dict[str, str] = {}
        for t in episode.traces:
            for e in t.errors:
                if _scoring_error(e):
                    reward_errors.setdefault(self._member_of(t), f"{e.type}: {e.message}")
                else:
                    problems.append(f"{t.agent.name}: {e.type}: {e.message}")
        if problems or (not episode.ok and not reward_errors):
            raise RuntimeError("verifiers episode failed: " + ("; ".join(problems) or "not ok"))

        # a seat that ran several times in the episode (a hierarchical env's solvers) scores the mean of its traces'
        # rewards, on the env's own scale; each trace's reward is kept in trace_rewards
        trace_rewards: dict[str, list[float]] = {m: [] for m in self.members}
        components: dict[str, dict[str, list[float]]] = {m: {} for m in self.members}
        metrics: dict[str, dict[str, float | None]] = {m: {} for m in self.members}
        trainable: dict[str, bool] = {}
        calls: dict[str, int] = {m: 0 for m in self.members}
        replies: list[ChatMessage] = []
        for t in episode.traces:
            m = self._member_of(t)
            trainable[m] = bool(t.agent.trainable)
            calls[m] += len(t.calls)
            if t.rewards:
                trace_rewards[m].append(float(t.reward))
                for k, r in t.rewards.items():
                    if r is not None:
                        components[m].setdefault(k, []).append(r.value)
            metrics[m].update({k: v for k, v in t.metrics.items()})
            if t.branches:
                for msg in t.branches[-1].messages:
                    if getattr(msg, "role", None) == "assistant":
                        replies.append(from_openai_message(_v1_to_openai(msg)).model_copy(update={"name": m}))
        state.messages = replies
        state.turn = len(replies)
        state.stop_reason = ",".join(sorted({t.stop_condition for t in episode.traces if t.stop_condition})) or None
        from verifiers import __version__ as vf_version

        state.data["verifiers"] = _json({
            "version": vf_version, "env_id": self.vf_env.config.env_id, "episode_id": str(episode.id),
            "ok": episode.ok, "seats": self.seat_member, "trainable": trainable,
            "model_calls": calls, "rewards_by_member": {m: _mean(v) for m, v in trace_rewards.items()},
            "trace_rewards": trace_rewards, "reward_components": {m: {k: _mean(v) for k, v in c.items()}
                                                                  for m, c in components.items()},
            "metrics": metrics,
            "trace_ids": [t.id for t in episode.traces], "errors": problems, "reward_errors": reward_errors})

    def finalize(self, state: EpisodeState) -> dict[str, Any]:
        art = super().finalize(state)
        art["verifiers"] = state.data.get("verifiers")
        return art


def task_example(task: Any, prefix: str = "") -> Example:
    """One verifiers Task as an arena example: its durable id (else its position in the taskset), its prompt,
    and its key (``Task.key``, what verifiers records on the trace) in ``info``; the Task itself rides along."""
    data = task.data
    key = data.id if data.id is not None else data.idx
    prompt = data.prompt
    prompt = prompt if isinstance(prompt, str) or prompt is None else [_v1_to_openai(m) for m in prompt]
    answer = getattr(data, "answer", None)
    return Example(id=f"{prefix}{key}", prompt=_json(prompt) if prompt is not None else "",
                   answer=None if answer is None else str(answer),
                   info={"source": "verifiers.v1", "task_key": task.key, "task_idx": data.idx,
                         **({"task_name": data.name} if data.name else {})},
                   payload=task)


def verifiers_v1_environment(vf_env: Any, *, name: str, version: str, members: Mapping[str, str] | None = None,
                             member: str = "policy", model: str = "policy", num_tasks: int | None = None,
                             eval_tasks: Any = None, tasks: Any = None, buffer: int = 256) -> Environment:
    """Wrap a ``verifiers.v1.Env``: its taskset's tasks as examples, each rollout one ``run_episode``, scored
    by the env's own rewards (see the module docstring). A finite taskset (``Taskset.bounded``, or capped by
    ``num_tasks``) is read whole, up to ``EAGER_TASKS``; an endless one, or one past that, is drawn lazily (``TaskStream``: a seeded shuffle buffer of
    ``buffer`` tasks, bounded memory). ``tasks``: a view of the env's taskset to draw from (default: all of it);
    ``eval_tasks``: a finite taskset view of held-out tasks."""
    episode = VerifiersV1Episode(vf_env, members=members, member=member, model=model)
    taskset = vf_env.taskset if tasks is None else tasks
    taskset = taskset if num_tasks is None else taskset.take(num_tasks)
    train: Any = None
    if taskset.bounded:
        first = list(itertools.islice(taskset, EAGER_TASKS + 1))
        if len(first) <= EAGER_TASKS:
            train = [task_example(t) for t in first]
        else:
            log.warning("the taskset of %r does not declare itself endless (Taskset.INFINITE) but has more than %d "
                        "tasks: drawn lazily from a shuffle buffer, as an endless one", vf_env.config.env_id,
                        EAGER_TASKS)
        del first
    if train is None:
        train = TaskStream(lambda: (task_example(t) for t in taskset), buffer=buffer)
    if eval_tasks is not None and not eval_tasks.bounded:
        raise ValueError(f"the held-out tasks of {vf_env.config.env_id!r} never end: bound them "
                         "(num_examples, or select.limit)")
    held_out = [task_example(t, "eval-") for t in eval_tasks] if eval_tasks is not None else []

    def scoring(example: Example, state: EpisodeState | None = None) -> ScoringSpec:
        from verifiers import __version__ as vf_version

        return ScoringSpec(kind="rubric", answer=example.answer, funcs=[WeightedFunc(fn=REWARD_FN, weight=1.0)],
                           params={"verifiers_version": vf_version, "env_id": vf_env.config.env_id})

    return Environment(name=name, version=version, dataset=train, episode=episode, scoring=scoring,
                       eval_dataset=held_out, description=f"verifiers.v1 env {type(vf_env).__name__} "
                                                          f"({vf_env.config.env_id})")
