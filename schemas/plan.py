"""The GenerationPlan: which endpoint serves each member of an episode, and who is trained.

One compiled object for every recipe, single-agent or multi-agent: ``schemas.plan_compiler``
builds it from a TOML recipe, and everything downstream (arena, scheduler, services, CLI)
consumes only the plan, never the TOML. The validator here holds the plan's invariants, so a
plan read back from JSON is checked as strictly as a compiled one.

Routing rules: a statically routed member goes to its target (trainable only when that target
is the learner); a seat with a pinned model other than the learner's (or its own client) is a
fixed target; a ``train_one`` candidate goes to the learner when it is the rollout's selected
seat, else to ``unselected``; any other member is the learner, trainable (self-play), unless
``drop_judge`` excludes the ``judge`` seat from training.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterable, Literal

from pydantic import Field, JsonValue, model_validator

from schemas.envelope import Record
from schemas.errors import ContractError
from schemas.objectives import DefaultLoss, Demonstration, ObjectiveSpec, Reference

LEARNER = "learner"
# A plan's values where the recipe is silent: prime-rl's defaults.
DEFAULT_GROUP_SIZE = 1            # prime-rl: rollouts_per_example = 1
DEFAULT_BATCH_SIZE = 128          # prime-rl: batch_size defaults to 128 when no token batch is set
DEFAULT_MAX_OFF_POLICY_STEPS = 8  # prime-rl orchestrator default
DEFAULT_MAX_ASYNC_LEVEL = 1       # prime-rl orchestrator default
DEFAULT_EVAL_INTERVAL = 100       # prime-rl: [orchestrator.eval] interval


class PlanError(ContractError):
    """A recipe that cannot be compiled, or a plan nothing here can run; the message names the file
    and the field."""


class Target(Record):
    """An endpoint that serves model calls: the learner, or a fixed (never trained) model."""

    name: str = Field(min_length=1, description='"learner" for the trainable policy, else the fixed target name')
    model: str = Field(min_length=1)
    base_urls: list[str] = Field(default_factory=list,
                                 description="empty for the learner: the run's local policy server")
    api_key_var: str | None = None
    sampling: dict[str, JsonValue] = Field(default_factory=dict,
                                           description="temperature, max_tokens (normalised), top_p, ...")
    request_mode: str = "chat"
    timeout_s: float | None = None

    @property
    def is_learner(self) -> bool:
        return self.name == LEARNER


class MemberRoute(Record):
    target: str = Field(min_length=1, description="a key of GenerationPlan.targets")
    trainable: bool


class TrainOne(Record):
    members: list[str] = Field(description="candidates; exactly one is trainable per rollout")
    unselected: str = Field(min_length=1, description="fixed target the other candidate seat(s) go to")

    def problem(self, targets: Iterable[str], members: dict[str, MemberRoute]) -> tuple[str, str] | None:
        """The first rule this breaks among the plan's targets and static routes, as (field, message).

        One check for the plan's validator and the compiler, which names the recipe key of the field.
        """
        if not self.members:
            return "members", "empty: name the candidate seats"
        repeated = sorted({m for m in self.members if self.members.count(m) > 1})
        if repeated:
            return "members", f"repeats {repeated}"
        clash = [m for m in self.members if m in members]
        if clash:
            return "members", (f"{clash} are train_one candidates and also statically routed (to "
                               f"{sorted({members[m].target for m in clash})}); a seat is one or the other")
        if self.unselected == LEARNER or self.unselected not in targets:
            return "unselected", (f"{self.unselected!r} names no fixed target "
                                  f"(fixed targets: {sorted(set(targets) - {LEARNER})})")
        return None


class Seat(Record):
    """One agent seat of a source's environment (verifiers' ``env.<seat>``): who plays it."""

    target: str = Field(min_length=1, description="a key of GenerationPlan.targets")
    trainable: bool
    sampling: dict[str, JsonValue] = Field(default_factory=dict, description="the seat's own sampling overrides")
    options: dict[str, JsonValue] = Field(default_factory=dict, description="harness, runtime, limits, as written")


class AdvantageSpec(Record):
    """The training algorithm as the recipe names it, and the credit strategy that runs it (if any).

    ``type``/``params`` are as written (prime-rl ``algo.type``, or an ``advantage.type`` naming our
    strategy). ``credit``/``credit_params`` are what ``consumers.credit.CreditAssigner`` runs; ``credit``
    is None when nothing here can run the algorithm, and ``note`` says why (services refuse it).
    """

    type: str = "grpo"
    params: dict[str, JsonValue] = Field(default_factory=dict)
    origin: str = Field(default="default", description="the recipe key it came from, or 'default'")
    credit: str | None = Field(default="grpo", description="our credit strategy; None: cannot run here")
    credit_params: dict[str, JsonValue] = Field(default_factory=lambda: {"scale_std": False})
    note: str = Field(default="prime-rl's default algorithm grpo: A = r - group mean, our grpo with "
                      "scale_std = false")


REF_KL = "ref_kl"
"""``AdvantageSpec.credit`` of an algorithm trained by prime-rl's ref_kl component (opd): no credit strategy, no
advantage; its records carry the reference's logprobs instead (``References``)."""


class References(Record):
    """Each training source's reference (prime-rl's opd teacher), None for a source credited by a strategy: read by
    the reference service, which scores those sources' tokens, and by credit, which trains them from its output."""

    by_source: dict[str, Reference | None] = Field(default_factory=dict)

    def of(self, source: str | None) -> Reference | None:
        """The reference of the source a score names; a score naming none (written before sources were named) or
        an unknown one gets the plan's only one when every source has the same, else ``PlanError``."""
        if source in self.by_source:
            return self.by_source[source]
        distinct = {None if r is None else r.model_dump_json() for r in self.by_source.values()}
        if len(distinct) > 1:
            raise PlanError(f"a score of source {source!r}, not one of the plan's training sources "
                            f"({', '.join(self.by_source)}), which differ in their reference")
        return next(iter(self.by_source.values()), None)

    @property
    def any(self) -> bool:
        return any(r is not None for r in self.by_source.values())


class AdmissionGate(Record):
    """prime-rl's ``advantage_range`` admission gate (``curriculum.gates.<name>``): a finished group whose every
    trainable advantage lies in ``[reject_min, reject_max]`` is not trained on, and its batch slots go to another
    group (``consumers.credit.gate_rejects``; ``schemas.admission.AdmissionRefund``). The default ``[0, 0]`` drops
    groups with no learning signal (every rollout rewarded alike)."""

    name: str = Field(min_length=1)
    type: Literal["advantage_range"] = "advantage_range"
    reject_min: float = 0.0
    reject_max: float = 0.0

    @model_validator(mode="after")
    def _ordered(self) -> AdmissionGate:
        if self.reject_min > self.reject_max:
            raise ValueError(f"gate {self.name!r}: reject_min ({self.reject_min}) is above reject_max "
                             f"({self.reject_max})")
        return self


class EnvSpec(Record):
    id: str = Field(min_length=1)
    name: str | None = None
    args: dict[str, JsonValue] = Field(default_factory=dict)
    sampling: dict[str, JsonValue] = Field(default_factory=dict, description="per-env sampling overrides")
    options: dict[str, JsonValue] = Field(
        default_factory=dict,
        description='other environment keys, kept as written; "weight" is prime-rl\'s ratio (default 1)')
    evaluation: bool = Field(default=False, description="an evaluation source: scored, never trained on")
    algorithm: AdvantageSpec | None = Field(default=None, description="this training source's algorithm")
    seats: dict[str, Seat] = Field(default_factory=dict, description="the environment's agent seats, by name")
    gates: list[AdmissionGate] = Field(default_factory=list, description="this training source's admission gates")
    env_table: dict[str, JsonValue] | None = Field(
        default=None, description="the source's verifiers env table (prime-rl's ``env``) as written; resolved by "
                                  "verifiers' own loader where the environment runs (producers.environments.verifiers_loader)")

    @property
    def display_name(self) -> str:
        return self.name or self.id.split("@")[0]


SERVER_KEYS = frozenset({"tool_call_parser", "reasoning_parser", "chat_template", "max_model_len",
                         "enable_auto_tool_choice"})
"""The inference-server settings of a recipe that change what the server accepts or how it renders a prompt
(prime-rl's ``[inference.vllm]``, vLLM's argument names): applied to the vLLM a run starts, never dropped."""


# prime-rl's [trainer.model.lora] defaults (prime_rl.configs.trainer.LoRAConfig)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "experts",
                "fc1_latent_proj", "fc2_latent_proj")


LORA_SERVING = ("adapter", "merged")
"""How each revision of a LoRA run reaches vLLM: its adapter alone (prime-rl's way: a PEFT folder loaded with
``/v1/load_lora_adapter``, requests naming the adapter), or merged into the base and reloaded as whole weights."""


class LoraSpec(Record):
    """LoRA training of the learner: adapters of this rank on the target modules, every other weight frozen."""

    rank: int = Field(16, ge=1)
    alpha: float = Field(32.0, ge=0)
    dropout: float = Field(0.0, ge=0, le=1)
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGETS),
                                      description="module names; those a model lacks are left out")
    name: str | None = Field(None, min_length=1, description="the adapter's name in vLLM ([orchestrator.model.lora] "
                                                             "name); None: prime-rl's r<rank>-a<alpha>")
    serving: Literal[LORA_SERVING] = Field(  # type: ignore[valid-type]
        "adapter", description="how each revision reaches vLLM (``LORA_SERVING``)")

    @property
    def adapter_name(self) -> str:
        """What vLLM serves the adapter as, and what requests name once a revision is an adapter (prime-rl's
        default: ``f"r{rank}-a{alpha}"``, alpha a float)."""
        return self.name or f"r{self.rank}-a{float(self.alpha)}"


OPTIMIZERS = ("adamw", "muon", "sign_sgd")
"""prime-rl's ``[trainer.optim] type`` values the reference trainer runs (``policy.optimizers``; not ``sgd``)."""


class OptimizerSpec(Record):
    """The trainer's optimizer beyond its lr and weight decay (prime-rl's ``[trainer.optim]``, with its defaults
    for each type)."""

    type: Literal[OPTIMIZERS] = "adamw"  # type: ignore[valid-type]
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW's betas (muon: for the non-Muon weights)")
    momentum: float = Field(0.95, ge=0, description="muon: Muon's momentum (prime-rl's mu)")
    max_norm: float | None = Field(1.0, ge=0, description="gradient-norm clipping; None: none")


class Concurrency(Record):
    """prime-rl's ``[orchestrator.concurrency]``: the bounds of the episodes in flight, which the arena sizes at run
    time from the engine's KV capacity, the machine's memory and each episode's learned cost
    (``producers.arena.concurrency``). ``min_inflight == max_inflight`` fixes the number."""

    initial_inflight: int | None = Field(None, ge=1, description="where the cap starts; None: derived at run time "
                                                                 "from the engine's KV capacity")
    min_inflight: int = Field(1, ge=1)
    max_inflight: int | None = Field(1024, ge=1, description="None: no ceiling but the machine's")

    @model_validator(mode="after")
    def _ordered(self) -> Concurrency:
        top = self.max_inflight if self.max_inflight is not None else float("inf")
        if self.min_inflight > top:
            raise ValueError(f"min_inflight ({self.min_inflight}) is above max_inflight ({self.max_inflight})")
        if self.initial_inflight is not None and not self.min_inflight <= self.initial_inflight <= top:
            raise ValueError(f"initial_inflight ({self.initial_inflight}) is outside [min_inflight, max_inflight] "
                             f"([{self.min_inflight}, {self.max_inflight}])")
        return self


class GenerationPlan(Record):
    source: str = Field(description="file the plan was compiled from")
    family: str = Field(min_length=1, description="learner model family (the learner model name)")
    targets: dict[str, Target]
    members: dict[str, MemberRoute] = Field(
        default_factory=dict,
        description="statically routed members; unlisted members are the learner, trainable (self-play)")
    train_one: TrainOne | None = None
    untrained_members: list[str] = Field(
        default_factory=list, description="members served by the learner but never trained (drop_judge)")
    environments: list[EnvSpec] = Field(min_length=1, description="training sources")
    eval_environments: list[EnvSpec] = Field(default_factory=list, description="evaluation sources, never trained")
    group_size: int = Field(ge=1)
    batch_size: int = Field(ge=1)
    token_batch_size: int | None = Field(default=None, ge=1,
                                         description="prime-rl's token-based batching, when the recipe uses it")
    max_off_policy_steps: int = Field(ge=0)
    max_async_level: int = Field(default=DEFAULT_MAX_ASYNC_LEVEL, ge=0)
    eval_interval: int = Field(
        default=1, ge=1, description="revisions between evaluations (prime-rl's [orchestrator.eval] interval): of the "
                                     "training sources' held-out sets, and of each evaluation source that sets no "
                                     "interval of its own; 1 (every revision) for a recipe without [orchestrator.eval]")
    eval_skip_first_step: bool = Field(default=False, description="revision 0 is not evaluated (prime-rl's "
                                                                  "[orchestrator.eval] skip_first_step)")
    max_steps: int | None = Field(default=None, ge=1,
                                  description="trained revisions after which the run stops (None: until stopped)")
    seq_len: int | None = Field(default=None, ge=1, description="longest sample (prompt + completion) in tokens: "
                                "the context length of the inference server the run starts")
    server: dict[str, JsonValue] = Field(
        default_factory=dict, description="the recipe's inference-server settings that change what the server "
                                          "accepts, under vLLM's argument names (``SERVER_KEYS``: its tool-call and "
                                          "reasoning parsers, chat template, context length): passed to the vLLM "
                                          "a run starts")
    trainer: dict[str, JsonValue] = Field(
        default_factory=dict, description="the recipe's optimizer settings for the reference trainer (lr, "
                                          "weight_decay); empty: the trainer's own defaults")
    lora: LoraSpec | None = Field(default=None, description="LoRA training ([trainer.model.lora]); None: every "
                                                          "weight trains")
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec, description="the trainer's optimizer "
                                                                              "([trainer.optim] type and its settings)")
    objective: ObjectiveSpec = Field(default_factory=DefaultLoss, description="what the trainer optimizes "
                                     "([trainer.loss]; prime-rl's default DPPO+KL when the recipe names none): "
                                     "schemas.objectives")
    served_model: str | None = Field(
        default=None, description="the weights that stand in for ``family`` where its own model cannot be served "
                                  "here (``--model``); None: the family's own model")
    refused: list[str] = Field(
        default_factory=list, description="recipe keys that change the run and that nothing here applies, each "
                                          "with why: the plan compiles (to be shown) but no run starts with it")
    concurrency: Concurrency | None = Field(
        default=None, description="the recipe's in-flight bounds ([orchestrator.concurrency]); None: the arena's "
                                  "--concurrency fixes where the cap starts and its ceiling")
    advantage: AdvantageSpec = Field(default_factory=AdvantageSpec)
    ignored_sections: list[str] = Field(default_factory=list)
    ignored_keys: list[str] = Field(default_factory=list)
    passthrough_sampling: list[str] = Field(
        default_factory=list, description="sampling keys we do not know, sent to the server in extra_body")
    provenance: dict[str, str] = Field(
        default_factory=dict, description="where a defaulted or aliased value came from (field -> key or 'default')")

    @model_validator(mode="after")
    def _consistent(self) -> GenerationPlan:
        if LEARNER not in self.targets:
            raise ValueError('targets must contain "learner"')
        for name, target in self.targets.items():
            if target.name != name:
                raise ValueError(f"targets[{name!r}].name is {target.name!r}")
        if self.targets[LEARNER].model != self.family:
            raise ValueError(f"the learner model {self.targets[LEARNER].model!r} is not the family {self.family!r}")
        for env in self.environments:
            if env.evaluation:
                raise ValueError(f"environment {env.display_name!r} is an evaluation source; it belongs in "
                                 "eval_environments")
        for env in self.eval_environments:
            if not env.evaluation:
                raise ValueError(f"eval environment {env.display_name!r} is not marked evaluation")
        for env in self.environments + self.eval_environments:
            for seat, s in env.seats.items():
                if s.target not in self.targets:
                    raise ValueError(f"seat {seat!r} of {env.display_name!r} routes to undefined target {s.target!r}")
        for member, route in self.members.items():
            if route.target not in self.targets:
                raise ValueError(f"member {member!r} routes to target {route.target!r}, which is not defined")
            if route.trainable and route.target != LEARNER:
                raise ValueError(f"member {member!r} is trainable but routes to fixed target {route.target!r}")
        problem = self.train_one.problem(self.targets, self.members) if self.train_one is not None else None
        if problem is not None:
            raise ValueError(f"train_one.{problem[0]}: {problem[1]}")
        return self

    # -- routing -------------------------------------------------------------------------------

    def selected_member(self, rollout_id: str, seed: int) -> str | None:
        """The train_one candidate that is the learner in this rollout (None without train_one).

        ``sha256(f"{seed}:{rollout_id}") mod len(members)``: deterministic, so a replay of the
        rollout picks the same seat.
        """
        if self.train_one is None:
            return None
        h = int(hashlib.sha256(f"{seed}:{rollout_id}".encode()).hexdigest(), 16)
        return self.train_one.members[h % len(self.train_one.members)]

    def route(self, member_id: str, rollout_id: str, seed: int) -> tuple[Target, bool]:
        """(target, trainable) for one member's calls in one rollout."""
        static = self.members.get(member_id)
        if static is not None:
            return self.targets[static.target], static.trainable
        if self.train_one is not None and member_id in self.train_one.members:
            if member_id == self.selected_member(rollout_id, seed):
                return self.targets[LEARNER], True
            return self.targets[self.train_one.unselected], False
        return self.targets[LEARNER], member_id not in self.untrained_members

    def trainable_members(self, member_ids: Iterable[str], rollout_id: str, seed: int) -> set[str]:
        return {m for m in member_ids if self.route(m, rollout_id, seed)[1]}

    def eval_due(self, revision: int, source: EnvSpec | None = None, last: int | None = None) -> bool:
        """Whether ``revision`` answers the training sources' held-out sets (``source`` None) or the evaluation
        ``source``: ``eval_due_at`` with the plan's cadence, or the source's own ``interval`` and
        ``skip_first_step`` where it sets them. ``last``: the run's last revision, when known."""
        opts = source.options if source is not None else {}
        return eval_due_at(revision, int(opts.get("interval", self.eval_interval)),  # type: ignore[arg-type]
                           bool(opts.get("skip_first_step", self.eval_skip_first_step)), last)

    def group_size_of(self, env: EnvSpec) -> int:
        """Rollouts per example for one source: its own ``group_size``, else the plan's."""
        return int(env.options.get("group_size") or self.group_size)

    @property
    def one_record_per_rollout(self) -> bool:
        """Whether each rollout yields exactly one training record (one trainable member: no seats, no routed
        members), so that rollouts and batch records count alike. Never for a training source that is a verifiers
        env: its own seats and turns are not in the plan (``kuhn-poker`` with no seat tables yields 3.3 a rollout)."""
        return self.train_one is None and not self.members and not any(
            env.seats or (env.env_table is not None and not env.evaluation) for env in self.environments)

    @property
    def learner(self) -> Target:
        return self.targets[LEARNER]

    @property
    def fixed_targets(self) -> dict[str, Target]:
        return {k: v for k, v in self.targets.items() if k != LEARNER}

    def seat_sources(self) -> dict[str, list[str]]:
        """Each agent seat the recipe declares -> the sources (train, then eval) that declare it."""
        out: dict[str, list[str]] = {}
        for env in self.environments + self.eval_environments:
            for seat in env.seats:
                out.setdefault(seat, []).append(env.display_name + (" (eval)" if env.evaluation else ""))
        return out

    def route_table(self) -> list[dict[str, Any]]:
        """One row per member the plan names, for display: member, target(s), trainable, rule."""
        rows: list[dict[str, Any]] = []
        for member, r in sorted(self.members.items()):
            rows.append({"member": member, "target": r.target, "trainable": r.trainable, "rule": "static"})
        if self.train_one is not None:
            for member in self.train_one.members:
                rows.append({"member": member, "target": f"{LEARNER} | {self.train_one.unselected}",
                             "trainable": "when selected", "rule": "train_one"})
        for member in self.untrained_members:
            rows.append({"member": member, "target": LEARNER, "trainable": False, "rule": "drop_judge"})
        named = {r["member"] for r in rows}
        for seat, sources in self.seat_sources().items():
            if seat not in named:
                target, trainable = self.route(seat, "", 0)
                rows.append({"member": seat, "target": target.name, "trainable": trainable,
                             "rule": f"seat of {', '.join(sources)}"})
        rows.append({"member": "*", "target": LEARNER, "trainable": True, "rule": "default (self-play)"})
        return rows



def eval_due_at(revision: int, interval: int, skip_first_step: bool = False, last: int | None = None) -> bool:
    """prime-rl's evaluation cadence: revision 0 unless ``skip_first_step``, then every ``interval`` revisions;
    and the run's ``last`` revision whatever the interval, so the curve ends where the run does (prime-rl's evals
    process force-fires the final checkpoint too)."""
    return revision == last or (revision % interval == 0 and not (revision == 0 and skip_first_step))


def require_runnable(plan: GenerationPlan) -> None:
    """Refuse to start a run whose recipe has keys that change the run and that nothing here applies."""
    if plan.refused:
        raise PlanError(f"{plan.source}: cannot run as written; not applied here: " + "; ".join(plan.refused))


def admission_gates(plan: GenerationPlan) -> list[AdmissionGate]:
    """The gates the credit service applies: every training source's, which must be the same (one credit service
    runs one set per run, as it runs one strategy). Raises ``PlanError`` naming the sources where they differ."""
    sets = {json.dumps([g.model_dump() for g in env.gates], sort_keys=True) for env in plan.environments}
    if len(sets) > 1:
        shown = "; ".join(f"{env.display_name}: {', '.join(g.name for g in env.gates) or 'none'}"
                          for env in plan.environments)
        raise PlanError(f"{plan.source}: training sources have different admission gates ({shown}); the credit "
                        "service applies one set per run")
    return list(plan.environments[0].gates) if plan.environments else []


def references(plan: GenerationPlan) -> References:
    """Each training source's reference: its opd teacher (``[algo] teacher``, prime-rl's ``FrozenModelConfig``), or
    for opsd the learner itself under the demonstration (its servers, else the run's own: ``base_url`` None)."""
    out: dict[str, Reference | None] = {}
    for env in plan.environments:
        algo = env.algorithm or plan.advantage
        ref = None
        if algo.credit == REF_KL and algo.type == "opsd":
            demo = Demonstration(**{f: algo.params[k] for k, f in (("demo_key", "key"), ("template", "template"))
                                    if k in algo.params})
            ref = Reference(model=plan.learner.model, base_url=next(iter(plan.learner.base_urls), None),
                            demonstration=demo)
        elif algo.credit == REF_KL and algo.params.get("teacher") is not None:
            teacher = algo.params["teacher"]
            ref = Reference(model=teacher["name"], base_url=teacher["base_url"], api_key_var=teacher.get("api_key_var"))
        out[env.display_name] = ref
    return References(by_source=out)


def credit_strategy(plan: GenerationPlan) -> tuple[str, dict[str, Any]]:
    """(strategy, params) for ``consumers.credit.CreditAssigner``: what runs the plan's algorithm.

    Raises ``PlanError`` naming the algorithm and why when nothing here can run it (e.g. echo), or when
    training sources credited by a strategy use different ones (one credit service runs one strategy); a ref_kl
    source (opd) needs none, and beside one it mixes with any. Never falls back to GRPO.
    """
    algos = [(env.display_name, env.algorithm or plan.advantage) for env in plan.environments]
    for name, algo in algos:
        if algo.credit is None:
            raise PlanError(f"{plan.source}: {algo.origin}: algorithm {algo.type!r} (source {name!r}) cannot run "
                            f"here: {algo.note}")
    if plan.lora is not None and plan.lora.serving == "adapter" and any(a.type == "opsd" for _, a in algos):
        raise PlanError(f"{plan.source}: opsd scores each sample under the live policy, which a LoRA run serves as "
                        "an adapter under another name from its first revision on; the reference service scores the family's "
                        "name: train this recipe without [trainer.model.lora]")
    algos = [(name, a) for name, a in algos if a.credit != REF_KL]  # trained from their reference's logprobs
    if not algos:
        return "per_step", {}  # no source is credited: every record comes from the reference service
    runs = {(a.credit, json.dumps(a.credit_params, sort_keys=True)) for _, a in algos}
    if len(runs) > 1:
        shown = ", ".join(f"{n}: {a.type}" for n, a in algos)
        raise PlanError(f"{plan.source}: training sources use different algorithms ({shown}); the credit "
                        "service runs one strategy per run")
    algo = algos[0][1]
    return algo.credit, dict(algo.credit_params)  # type: ignore[return-value]
