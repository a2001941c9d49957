"""The recipe compiler: a TOML recipe (prime-rl's formats, unchanged, and our own local-run keys)
in, a frozen ``schemas.plan.GenerationPlan`` out, or a ``PlanError`` naming the file and the key.
docs/PLANS.md maps every prime-rl key to the plan.

Formats accepted (written to prime-rl's config models, packages/prime-rl-configs/.../configs/,
and verifiers' ``vf.EnvConfig``, not to a sample of files):

* ``rl`` file: ``[model]`` at top level, the orchestrator under ``[orchestrator]``;
* orchestrator-only file: the same orchestrator keys at top level (``batch_size``,
  ``[train.sampling]``, ``[[train.source]]``, ...), and the older ``rollouts_per_example``,
  ``[sampling]``, ``[environment]`` spelling;
* training sources: ``[[train.source]]`` (``env.taskset``, one table per agent seat
  ``env.<seat>`` with its harness/runtime and, optionally, a pinned ``model``/``client``/``sampling``;
  ``name``, ``ratio`` (the environment weight), ``sampling``, ``group_size``, ``algo``,
  ``curriculum``, ``serve``) or the older ``[[train.env]]`` / ``[[env]]`` / ``[environment]``
  (``id``, ``name``, ``args``, ``sampling``); evaluation sources ``[[eval.source]]`` /
  ``[[eval.env]]`` become ``eval_environments`` (``evaluation = true``), never training;
* the evaluation cadence: ``[eval]`` ``interval`` and ``skip_first_step`` (prime-rl's defaults 100 and false)
  become the plan's ``eval_interval``/``eval_skip_first_step``, for the training sources' held-out sets and
  every evaluation source without its own ``interval``; ``[eval]`` with only those keys and no source (refused by
  prime-rl) is the cadence of the held-out sets alone; no ``[eval]``: every revision;
* algorithms: prime-rl's ``[algo]`` (also per source), or our and the multi-agent fork's
  ``[advantage]`` naming a credit strategy directly; see ``ALGORITHMS``;
* multi-agent (the fork): ``[multi_agent.train_one]`` (candidates, of which exactly one is the
  learner per rollout; the other seats go to the ``unselected`` fixed target),
  ``[multi_agent.fixed.<name>]`` (a fixed OpenAI-compatible target; its ``members`` are routed
  to it statically), ``drop_judge``; plus our own ``[multi_agent.routes]``
  (``member = "learner" | "<fixed name>"``).

The learner target's ``base_urls`` come from ``[orchestrator.model.client]`` (or the older
``[orchestrator.client]``) ``base_url`` and may be empty: then the run's local policy server
(the default endpoint) serves it.

Staleness bound: ``max_off_policy_steps`` (orchestrator or top level), else the older
``max_async_level``, else prime-rl's default for ``max_off_policy_steps``, 8.

Unknown keys: a near miss of a key we read (``temprature``) is refused with the suggestion; a
sampling key we do not know is passed to the inference server (in ``extra_body``: vLLM takes
extra sampling parameters) and listed in ``passthrough_sampling``; other keys and sections the
pipeline does not use (trainer, inference, deployment, renderer, curriculum, ...) are listed in
``ignored_sections`` / ``ignored_keys`` and never fail the compile. A file with no generation
part (trainer-only, inference-only, eval-only) is refused with a message saying what it is.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from schemas.objectives import DefaultLoss
from schemas.plan import LEARNER, GenerationPlan, OptimizerSpec, PlanError
from schemas.plan_compiler.algorithm import AlgorithmSection
from schemas.plan_compiler.model import ModelSection
from schemas.plan_compiler.orchestrator import ORCH_SCALARS, ORCH_TABLES, OrchestratorSection, TOP_SCALARS_UNIFIED
from schemas.plan_compiler.sources import SourceSection
from schemas.plan_compiler.trainer import TrainerSection


class _Compiler(ModelSection, AlgorithmSection, SourceSection, OrchestratorSection, TrainerSection):
    """One recipe compiled: each section of the recipe is read by its own module's mixin."""

    def compile(self, data: dict[str, Any]) -> GenerationPlan:
        if not isinstance(data, dict):
            raise self.fail("<root>", "a plan is a TOML table")
        orch_table = self.table(data, "orchestrator", "")
        unified = self.unified = orch_table is not None
        if not unified and not {"train", "env", "environment"} & data.keys():
            raise PlanError(f"{self.source}: {_not_a_recipe(data)}, not a generation recipe: it has no "
                            "[orchestrator] part and no training sources ([[train.source]], [[env]], [environment])")
        orch: dict[str, Any] = orch_table if unified else data
        op = "orchestrator" if unified else ""  # path prefix of the orchestrator scope

        if unified:
            self.lenient(data, "", owned={"orchestrator", "model", *TOP_SCALARS_UNIFIED}, skip={"trainer", "inference"})
        self.lenient(orch, op, owned=ORCH_SCALARS | ORCH_TABLES)

        family, model_path = self._family(data, orch, op, unified)
        learner_sampling = self._learner_sampling(orch, op)
        self.targets[LEARNER] = self._learner(orch, op, family, learner_sampling)
        advantage = self._top_algorithm(orch, op)
        environments = self._train_sources(orch, op, family, advantage)
        eval_environments = self._eval_sources(orch, op, family)
        eval_interval, eval_skip_first_step = self._eval_cadence(orch, op)
        group_size = self._group_size(orch, op)
        batch_size, token_batch_size = self._batching(orch, op)
        max_off, max_async = self._staleness(data, orch, op, unified)
        train_one, untrained = self._multi_agent(orch, op)
        max_steps, seq_len = self._run_length(data, orch, op, unified)
        concurrency = self._concurrency(orch, op)
        trainer, optimizer = self._trainer(data) if unified else ({}, OptimizerSpec())
        lora = self._lora(data) if unified else None
        max_tokens = self.targets[LEARNER].sampling.get("max_tokens")
        objective = self._objective(data, max_tokens) if unified else DefaultLoss()
        server = self._server(data) if unified else {}

        try:
            return GenerationPlan(
                source=self.source, family=family, targets=self.targets, members=self.members,
                train_one=train_one, untrained_members=untrained, environments=environments,
                eval_environments=eval_environments, eval_interval=eval_interval,
                eval_skip_first_step=eval_skip_first_step, group_size=group_size, batch_size=batch_size,
                token_batch_size=token_batch_size, max_off_policy_steps=max_off, max_async_level=max_async,
                max_steps=max_steps, seq_len=seq_len, concurrency=concurrency, trainer=trainer, lora=lora,
                optimizer=optimizer, objective=objective, server=server, refused=self.refused,
                advantage=advantage, ignored_sections=self.ignored_sections, ignored_keys=self.ignored_keys,
                passthrough_sampling=self.passthrough, provenance={"family": model_path, **self.provenance})
        except ValidationError as exc:
            errors = exc.errors(include_url=False)
            shown = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'plan'}: {e['msg']}" for e in errors[:3])
            raise PlanError(f"{self.source}: {shown}") from None


def compile_plan_dict(data: dict[str, Any], source: str) -> GenerationPlan:
    """Compile an already-parsed recipe; ``source`` names it in every error."""
    return _Compiler(source).compile(data)


def compile_plan(path: str | Path) -> GenerationPlan:
    """Read and compile a TOML recipe. Raises ``PlanError`` naming the file and the field."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise PlanError(f"{p}: cannot read plan: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PlanError(f"{p}: not valid TOML: {exc}") from None
    return compile_plan_dict(data, str(p))


def _not_a_recipe(data: dict[str, Any]) -> str:
    """What a TOML file without a generation part is, from prime-rl's other entry points' configs."""
    trainer = {"data", "optim", "loss", "scheduler"} & data.keys()
    if trainer:
        d = data.get("data") if isinstance(data.get("data"), dict) else {}
        if "fake" in d or d.get("type") == "fake":
            return "a trainer-only config with fake data ([data.fake]; prime-rl's trainer or sft entry point)"
        if "name" in d or d.get("type") == "sft":
            return "an SFT trainer config (it trains on the dataset in [data])"
        return f"a trainer-only config ({', '.join(f'[{k}]' for k in sorted(trainer))})"
    inference = {"vllm", "server", "parallel", "router", "kv_cache_offload"} & data.keys()
    if inference:
        return f"an inference-server config ({', '.join(f'[{k}]' for k in sorted(inference))})"
    if isinstance(data.get("eval"), dict):
        return "an eval-only config ([eval]: evaluation sources, nothing to train; prime-rl's eval entry point)"
    return f"a config with only {', '.join(f'[{k}]' for k in sorted(data)) or 'nothing'}"
