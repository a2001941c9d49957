"""Bring your own ``verifiers`` environment: run it as an episode of ours.

Verified with ``verifiers==0.3.1`` (the ``verifiers[...]`` optional extra pins it). Its classic (v0)
stack, importable as ``import verifiers as vf``, is what this adapter drives:

* ``vf.SingleTurnEnv`` / ``vf.MultiTurnEnv`` / ``vf.ToolEnv`` (and subclasses that keep the
  ``Environment.run_rollout(input, client, model, sampling_args)`` contract);
* ``vf.ClientConfig`` with ``client_type="openai_chat_completions"`` (the adapter builds it);
* ``vf.Rubric`` (``funcs``/``weights``; weight-0 entries are metrics) -> our ``ScoringSpec(kind="rubric")``.

verifiers 0.4.0 replaced that surface with ``verifiers.v1`` (Env/Taskset/Harness, model calls made by a
harness program launched through ``uv`` in a runtime, behind an interception server); it is not covered.

How it works: a ``CaptureProxy`` (an in-process OpenAI-compatible endpoint) stands in for the model.
The verifiers environment's OpenAI client is pointed at it, with the rollout id in an
``x-rollout-id`` header; every chat completion it receives becomes ``ctx.call_model(member, messages,
tools, sampling)``: routed through the GenerationPlan, recorded as a Step with token ids and logprobs,
and answered in the OpenAI shape (with vLLM's ``token_ids``/``prompt_token_ids``). Tool calls are
dispatched by verifiers itself (its ``ToolEnv``), and their results reach the next Step's prompt.

The rubric is handed to the verifier service: ``artifacts["scoring"] = {"kind": "rubric", "funcs":
[{"fn": "module:function", "weight": w}], "metrics": [...], "params": {"verifiers_version",
"not_importable": [...]}}`` (reward functions that are not module-level functions cannot be named by
import path; they are listed by name). verifiers' own reward and metrics for the rollout are kept in
``artifacts["verifiers"]`` for cross-checking.

    env = verifiers_environment(vf.SingleTurnEnv(dataset=ds, rubric=rubric), name="my-env", version="1")
    Arena(plan, {"my-env": env}, emitter=..., policy_base_url=...)
"""

from __future__ import annotations

import asyncio
import importlib
import os
from typing import Any, ClassVar

from producers.environment import Environment, Example
from producers.episodes import Episode, EpisodeState
from producers.http_server import JsonHttpServer, Request, Response, error
from producers.inference import SAMPLING_KEYS, InferenceError, from_openai_message, to_openai_message
from schemas.scoring import ScoringSpec, WeightedFunc

KEY_VAR = "ROLLOUT_VERIFIERS_PROXY_KEY"
ROLLOUT_HEADER = "x-rollout-id"


class CaptureProxy:
    """OpenAI-compatible endpoint whose completions are ``ctx.call_model`` calls of registered rollouts."""

    def __init__(self) -> None:
        self.http = JsonHttpServer()
        self.http.route("POST", "/v1/chat/completions", self._chat)
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

    async def _chat(self, req: Request) -> Response:
        rid = req.headers.get(ROLLOUT_HEADER)
        session = self.sessions.get(rid or "")
        if session is None:
            return error(400, f"unknown rollout {rid!r}: the capture proxy serves registered rollouts only")
        ctx, member, errors = session
        body = req.json()
        try:
            messages = [from_openai_message(m) for m in body.get("messages") or []]
            sampling = {k: v for k, v in body.items() if k in SAMPLING_KEYS and k != "n" and v is not None}
            comp = await ctx.call_model(member, messages, tools=body.get("tools") or None, sampling=sampling)
        except InferenceError as e:
            errors.append(e)  # the episode re-raises it: a failed Rollout, with the reason
            return error(400, f"inference failed: {e}")
        except Exception as e:  # noqa: BLE001
            errors.append(e)
            return error(400, f"capture failed: {type(e).__name__}: {e}")
        message = to_openai_message(comp.message)
        if message.get("tool_calls"):
            message["content"] = message.get("content") or None
        choice = {"index": 0, "message": message, "finish_reason": comp.finish_reason,
                  "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": lp, "bytes": [], "top_logprobs": []}
                                           for t, lp in zip(comp.completion_token_ids, comp.logprobs)]},
                  "token_ids": comp.completion_token_ids}
        n_prompt, n_out = len(comp.prompt_token_ids), len(comp.completion_token_ids)
        return Response(200, {"id": f"chatcmpl-{rid}-{n_prompt}", "object": "chat.completion", "created": 0,
                              "model": body.get("model", "policy"), "choices": [choice],
                              "prompt_token_ids": comp.prompt_token_ids,
                              "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                                        "total_tokens": n_prompt + n_out}})


def _import_path(fn: Any) -> str | None:
    module, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or "<" in qual or "." in qual:
        return None
    try:
        if getattr(importlib.import_module(module), qual, None) is not fn:
            return None
    except ImportError:
        return None
    return f"{module}:{qual}"


def rubric_spec(rubric: Any, answer: str | None = None) -> ScoringSpec:
    """A verifiers Rubric as our rubric ScoringSpec (weight 0 -> metric)."""
    import verifiers

    funcs, metrics, missing = [], [], []
    pairs: list[tuple[Any, float]] = []
    stack = [rubric]
    while stack:  # a RubricGroup (verifiers wraps the user's rubric with its monitor rubrics) is flattened
        r = stack.pop(0)
        stack.extend(getattr(r, "rubrics", None) or [])
        pairs.extend(zip(getattr(r, "funcs", []) or [], getattr(r, "weights", []) or []))
    for fn, w in pairs:
        path = _import_path(fn)
        if path is None:
            missing.append(getattr(fn, "__name__", repr(fn)))
            continue
        (funcs if w else metrics).append(WeightedFunc(fn=path, weight=float(w)))
    if not funcs:
        raise ValueError("the rubric has no importable reward function with a non-zero weight "
                         f"(not importable: {missing}); define reward functions at module level")
    return ScoringSpec(kind="rubric", answer=answer, funcs=funcs, metrics=metrics,
                       params={"verifiers_version": verifiers.__version__, "not_importable": missing,
                               "parser": type(getattr(rubric, "parser", None)).__name__})


class VerifiersEpisode(Episode):
    episode_type: ClassVar[str] = "verifiers"

    def __init__(self, vf_env: Any, *, member: str = "policy", model: str = "policy",
                 sampling: dict[str, Any] | None = None) -> None:
        self.vf_env = vf_env
        self.members = (member,)
        self.model = model
        self.vf_sampling = dict(sampling or {})
        self.rows: dict[str, dict[str, Any]] = {}
        self.proxy = CaptureProxy()
        os.environ.setdefault(KEY_VAR, "captured-by-rollout-log")

    async def rollout(self, ctx, state: EpisodeState) -> None:
        import verifiers as vf

        proxy = await self.proxy.ensure_started()
        errors: list[BaseException] = []
        proxy.sessions[state.rollout_id] = (ctx, self.members[0], errors)
        try:
            cfg = vf.ClientConfig(client_type="openai_chat_completions", api_base_url=proxy.base_url,
                                  api_key_var=KEY_VAR, max_retries=0, extra_headers={ROLLOUT_HEADER: state.rollout_id})
            row = dict(self.rows[state.example.id])
            out = await self.vf_env.run_rollout(row, cfg, self.model, dict(self.vf_sampling))
        finally:
            proxy.sessions.pop(state.rollout_id, None)
        if errors:
            raise errors[0]
        out = dict(out)
        if out.get("error"):
            raise RuntimeError(f"verifiers rollout error: {out['error']}")
        msgs = []
        for m in list(_as_list(out.get("prompt"))) + list(_as_list(out.get("completion"))):
            d = m.model_dump() if hasattr(m, "model_dump") else dict(m)
            d = {k: v for k, v in d.items() if k in ("role", "content", "name", "tool_calls", "tool_call_id")}
            msgs.append(from_openai_message(d))
        state.messages = msgs
        state.turn = sum(1 for m in msgs if m.role == "assistant")
        state.stop_reason = str(out.get("stop_condition") or "verifiers")
        state.data["verifiers"] = {"reward": _num(out.get("reward")), "metrics": _jsonish(out.get("metrics")),
                                   "stop_condition": out.get("stop_condition"),
                                   "is_truncated": bool(out.get("is_truncated"))}

    def finalize(self, state: EpisodeState) -> dict[str, Any]:
        art = super().finalize(state)
        art["verifiers"] = state.data.get("verifiers")
        return art


def _as_list(x: Any) -> list:
    if x is None:
        return []
    if isinstance(x, str):
        return [{"role": "assistant", "content": x}]
    return list(x)


def _num(x: Any) -> float | None:
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def _jsonish(x: Any) -> Any:
    import json

    return json.loads(json.dumps(x, default=str)) if x is not None else None


def verifiers_environment(vf_env: Any, *, name: str, version: str, member: str = "policy", model: str = "policy",
                          num_examples: int = -1, sampling: dict[str, Any] | None = None) -> Environment:
    """Wrap a verifiers (v0 API) environment: its dataset, run as a VerifiersEpisode, scored by its rubric."""
    episode = VerifiersEpisode(vf_env, member=member, model=model, sampling=sampling)
    examples = []
    for i, row in enumerate(vf_env.get_dataset(n=num_examples)):
        row = dict(row)
        ex_id = str(row.get("example_id", i))
        episode.rows[ex_id] = row
        prompt = [dict(m) for m in row["prompt"]] if isinstance(row.get("prompt"), list) else str(row.get("prompt"))
        prompt = _jsonish(prompt)
        examples.append(Example(id=ex_id, prompt=prompt, answer=None if row.get("answer") is None else str(row["answer"]),
                                info={"source": "verifiers"}))

    def scoring(example: Example, state: EpisodeState | None = None) -> ScoringSpec:
        return rubric_spec(vf_env.rubric, example.answer)

    return Environment(name=name, version=version, dataset=examples, episode=episode, scoring=scoring,
                       description=f"verifiers environment {type(vf_env).__name__}")
