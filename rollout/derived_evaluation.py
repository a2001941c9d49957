"""A derived run's held-out evaluation: the source run's questions, answered by the derived revisions at the source
run's evaluation cadence, so that the two runs compare by held-out accuracy in one query
(``v_eval_accuracy_by_revision`` after ``rollout replay --run <derived run>``: one row per family and revision).

The questions and the cadence are the source run's plan, as ``rollout rl`` / ``rollout demo`` recorded it on its
revision 0 (``PolicyRevision.plan``), or a recipe the user names (``--plan``) for a run that recorded none. An
arena of the derived run's own (its topics, its run id) follows the derived family, loads each revision due into
an inference server of its own (vLLM for an HF model, the local policy server for the tiny one) and answers the
held-out questions, as a live run's arena does; the derived run's verifier scores them as the environment scores
them. No training rollout is generated: nothing is admitted.
"""

from __future__ import annotations

import time
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

from schemas.plan import GenerationPlan
from schemas.policy import TINY_FAMILY, PolicyRevision

LAST_REVISION_TIMEOUT_S = 600.0  # the last revision loaded and answered, after the trainer published it


class NoPlan(Exception):
    """The source run recorded no plan and none was named: the derived run is not evaluated."""


def plan_for(source_revisions: list[PolicyRevision], recipe: str | None) -> GenerationPlan:
    """The plan whose held-out questions and cadence the derived run is evaluated by: ``recipe`` compiled, else
    the one the source run recorded on its revision 0."""
    from schemas.plan_compiler import compile_plan

    if recipe is not None:
        return compile_plan(recipe)
    recorded = next((rev.plan for rev in source_revisions if rev.revision == 0 and rev.plan), None)
    if recorded is None:
        raise NoPlan("the source run recorded no plan (it was not started by `rollout rl` or `rollout demo`)")
    return GenerationPlan.model_validate(recorded)


def served_folder(source_revisions: list[PolicyRevision]) -> Path:
    """The HF folder an inference server starts on: the source's revision 0 is its ``model.safetensors``
    (``policy.served``); every derived revision's weights are loaded over it."""
    from policy.checkpoint import checkpoint_path

    rev0 = next((rev for rev in source_revisions if rev.revision == 0 and rev.checkpoint), None)
    folder = checkpoint_path(rev0.checkpoint).parent if rev0 is not None else None
    if folder is None or not (folder / "config.json").is_file():
        raise NoPlan(f"the source run's revision 0 is not an HF model folder here ({folder}): nothing to serve "
                     "its model with")
    return folder


def server_plan(plan: GenerationPlan, source_revisions: list[PolicyRevision], fork: int) -> GenerationPlan:
    """The plan the evaluation's server is started for: it answers to the source's model name, as its requests name
    it. A derived run trains every weight (its revisions are whole checkpoints: an adapter it starts from is merged),
    so it serves no LoRA adapter, unless its fork is one (a LoRA source that served adapters, ``--fork`` >= 1): then
    the server serves that adapter first and loads the derived revisions' whole weights after it."""
    at_fork = next((rev.checkpoint for rev in source_revisions if rev.revision == fork and rev.checkpoint), None)
    if at_fork is None or not at_fork.adapter:
        return plan.model_copy(update={"lora": None})
    if plan.lora is None:
        raise NoPlan(f"the fork r{fork} is a LoRA adapter and the evaluation's plan has no [trainer.model.lora] to "
                     "serve it under (give --plan the source's recipe)")
    return plan


@asynccontextmanager
async def evaluating(plan: GenerationPlan, family: str, first: int, kw: dict[str, Any], run_id: str, log_dir: Path,
                     source_revisions: list[PolicyRevision]) -> AsyncIterator[Any]:
    """An arena answering ``plan``'s held-out questions (its server started for ``plan``: ``server_plan``) with each
    revision of ``family`` (from ``first`` on: the fork, or where a resumed run left off) due at the plan's
    cadence; ``evaluate_last`` it with the run's last revision."""
    from producers.arena.config import ArenaConfig
    from producers.arena.arena import Arena
    from producers.arena.emitter import KafkaEmitter
    from producers.environments.loader import environment_from_spec
    from schemas.plan import require_runnable
    from streams.local_broker import free_port
    from streams.revisions import RevisionFollower

    require_runnable(plan)
    served = plan
    plan = served.model_copy(update={"family": family})  # the derived chain's revisions, under the learner's name
    environments = {s.display_name: environment_from_spec(s) for s in plan.environments}
    eval_environments = [(s, environment_from_spec(s)) for s in plan.eval_environments]
    async with AsyncExitStack() as stack:
        if served.family == TINY_FAMILY:
            from policy import PolicyModel
            from producers.inference.policy_server import PolicyServer

            server = PolicyServer(PolicyModel.from_seed(0), family=family, port=free_port())
            await server.start()
            stack.push_async_callback(server.stop)
            url, weights, options = server.base_url, "auto", {}
        else:
            from producers.inference.vllm_server import CPU_CLIENT_OPTIONS, VllmServer
            from producers.inference.weights import VllmWeights
            from rollout.demo import context_length

            folder = served_folder(source_revisions)
            log_dir.mkdir(parents=True, exist_ok=True)
            vllm = VllmServer.for_plan(served, folder, port=free_port(), log_path=log_dir / "vllm.log",
                                       max_model_len=context_length(served, folder))
            t0 = time.monotonic()
            await vllm.start()
            stack.push_async_callback(vllm.stop)
            print(f"evaluation: vLLM ready in {time.monotonic() - t0:.0f}s (log {log_dir / 'vllm.log'})", flush=True)
            url, weights, options = vllm.base_url, VllmWeights.for_plan(served), dict(CPU_CLIENT_OPTIONS)
        arena_id = f"{run_id}-eval"
        arena = Arena(plan, environments, eval_environments=eval_environments,
                      emitter=KafkaEmitter(kw, f"arena-{arena_id}"), revisions=RevisionFollower(kw, family),
                      weights=weights,
                      config=ArenaConfig(policy_base_url=url, run_id=run_id, evaluate=True, base_revision=first,
                                         client_options=options, arena_id=arena_id, producer_name=f"arena-{arena_id}"))
        yield await stack.enter_async_context(arena)
