"""The GenerationPlan: which endpoint serves each member of an episode, and who is trained.

One compiled object for every recipe, single-agent or multi-agent. ``compile_plan`` reads a
TOML recipe (prime-rl's formats, unchanged, and our own local-run keys) and returns a frozen
``GenerationPlan``. Everything downstream (arena, scheduler, CLI) consumes only the plan,
never the TOML.

Formats accepted
----------------

* legacy orchestrator-only file: top-level ``batch_size``, ``rollouts_per_example``,
  ``[sampling]``, ``[model]``, ``[environment]``;
* unified ``rl`` file: ``[model]`` at top level, everything the orchestrator reads under
  ``[orchestrator]``: ``batch_size``, ``group_size`` (or ``rollouts_per_example``),
  ``[orchestrator.train.sampling]`` + ``[[orchestrator.train.env]]`` (or the older spelling
  ``[orchestrator.sampling]`` + ``[[orchestrator.env]]``), ``[orchestrator.client]``,
  ``[orchestrator.advantage]``;
* multi-agent: ``[orchestrator.multi_agent.train_one]`` (candidates, of which exactly one is the
  learner per rollout; the other seats go to the ``unselected`` fixed target),
  ``[orchestrator.multi_agent.fixed.<name>]`` (a fixed OpenAI-compatible target; its ``members``
  are routed to it statically), ``drop_judge``; plus our own
  ``[orchestrator.multi_agent.routes]`` (``member = "learner" | "<fixed name>"``).

Routing rules: a statically routed member goes to its target (trainable only when that target
is the learner); a ``train_one`` candidate goes to the learner when it is the rollout's
selected seat, else to ``unselected``; any other member is the learner, trainable (self-play),
unless ``drop_judge`` excludes the ``judge`` seat from training.

The learner target's ``base_urls`` come from ``[orchestrator.client] base_url`` and may be empty:
then the run's local policy server (the default endpoint) serves it.

Staleness bound: ``max_off_policy_steps`` (orchestrator or top level), else the older
``max_async_level``, else prime-rl's default for ``max_off_policy_steps``, 8 (its orchestrator
config: "Rollouts that are generated from more than `max_off_policy_steps` steps ahead of
training will be discarded"). ``max_async_level`` itself (how far inference may run ahead of
training; prime-rl default 1) is carried as a separate field.

Sections the pipeline does not use (trainer, inference, deployment, wandb, ckpt, eval, val,
buffer, renderer, ...) are listed in ``ignored_sections`` and never fail the compile; scalar keys
we pass over are listed in ``ignored_keys``. Inside a section the compiler owns, an unknown key
is an error (a typo must not silently become a default); in the shared top-level and
``[orchestrator]`` tables, an unknown key is passed over unless it is a near miss of one we read.
"""

from __future__ import annotations

import difflib
import hashlib
import tomllib
from pathlib import Path
from typing import Any, Iterable

from pydantic import Field, JsonValue, ValidationError, model_validator

from schemas.envelope import Record
from schemas.errors import ContractError

LEARNER = "learner"
DEFAULT_GROUP_SIZE = 1            # prime-rl: rollouts_per_example = 1
DEFAULT_BATCH_SIZE = 128          # prime-rl: batch_size defaults to 128 when no token batch is set
DEFAULT_MAX_OFF_POLICY_STEPS = 8  # prime-rl orchestrator default
DEFAULT_MAX_ASYNC_LEVEL = 1       # prime-rl orchestrator default


class PlanError(ContractError):
    """A recipe that cannot be compiled; the message names the file and the field."""


# ---------------------------------------------------------------------------------------------
# The compiled plan


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
    members: list[str] = Field(min_length=1, description="candidates; exactly one is trainable per rollout")
    unselected: str = Field(min_length=1, description="fixed target the other candidate seat(s) go to")


class EnvSpec(Record):
    id: str = Field(min_length=1)
    name: str | None = None
    args: dict[str, JsonValue] = Field(default_factory=dict)
    sampling: dict[str, JsonValue] = Field(default_factory=dict, description="per-env sampling overrides")
    options: dict[str, JsonValue] = Field(default_factory=dict,
                                          description="other environment keys, kept as written (ratio, taskset, ...)")


class AdvantageSpec(Record):
    type: str = "grpo"
    params: dict[str, JsonValue] = Field(default_factory=dict)


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
    environments: list[EnvSpec] = Field(min_length=1)
    group_size: int = Field(ge=1)
    batch_size: int = Field(ge=1)
    max_off_policy_steps: int = Field(ge=0)
    max_async_level: int = Field(default=DEFAULT_MAX_ASYNC_LEVEL, ge=0)
    advantage: AdvantageSpec = Field(default_factory=AdvantageSpec)
    ignored_sections: list[str] = Field(default_factory=list)
    ignored_keys: list[str] = Field(default_factory=list)
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
        for member, route in self.members.items():
            if route.target not in self.targets:
                raise ValueError(f"member {member!r} routes to target {route.target!r}, which is not defined")
            if route.trainable and route.target != LEARNER:
                raise ValueError(f"member {member!r} is trainable but routes to fixed target {route.target!r}")
        if self.train_one is not None:
            t1 = self.train_one
            if len(set(t1.members)) != len(t1.members):
                raise ValueError(f"train_one.members repeats a member: {t1.members}")
            if t1.unselected == LEARNER or t1.unselected not in self.targets:
                raise ValueError(f"train_one.unselected {t1.unselected!r} names no fixed target")
            both = sorted(set(t1.members) & set(self.members))
            if both:
                raise ValueError(f"members {both} are both train_one candidates and statically routed")
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

    @property
    def learner(self) -> Target:
        return self.targets[LEARNER]

    @property
    def fixed_targets(self) -> dict[str, Target]:
        return {k: v for k, v in self.targets.items() if k != LEARNER}

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
        rows.append({"member": "*", "target": LEARNER, "trainable": True, "rule": "default (self-play)"})
        return rows


# ---------------------------------------------------------------------------------------------
# The compiler

# Keys the compiler reads, per section kind. A section is "strict" when we own all of it.
SAMPLING_KEYS = frozenset({
    "temperature", "max_tokens", "max_completion_tokens", "top_p", "top_k", "min_p", "min_tokens",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop", "extra_body",
    "reasoning_effort", "logprobs"})
ENV_OWNED = frozenset({"id", "name", "args", "sampling"})
ENV_PASSED = frozenset({"taskset", "harness", "num_workers", "address", "extra_env_kwargs", "ratio",
                        "max_retries", "max_total_completion_tokens", "version"})
TRAIN_OWNED = frozenset({"env", "sampling"})
TRAIN_PASSED = frozenset({"num_workers", "max_retries"})
MULTI_AGENT_KEYS = frozenset({"train_one", "fixed", "drop_judge", "routes"})
TRAIN_ONE_KEYS = frozenset({"members", "unselected"})
FIXED_KEYS = frozenset({"members", "model", "base_url", "api_key_var", "request_mode", "sampling", "timeout"})
CLIENT_OWNED = frozenset({"base_url", "api_key_var", "timeout"})
MODEL_OWNED = frozenset({"name"})
# Scalar keys of the orchestrator scope (the [orchestrator] table, or the top level of a legacy file).
ORCH_SCALARS = frozenset({"batch_size", "group_size", "rollouts_per_example", "max_off_policy_steps",
                          "max_async_level"})
# Tables of the orchestrator scope the compiler reads.
ORCH_TABLES = frozenset({"sampling", "env", "environment", "train", "advantage", "multi_agent", "client",
                         "model"})
TOP_SCALARS_UNIFIED = frozenset({"max_off_policy_steps", "max_async_level"})


class _Compiler:
    def __init__(self, source: str) -> None:
        self.source = source
        self.ignored_sections: list[str] = []
        self.ignored_keys: list[str] = []
        self.provenance: dict[str, str] = {}

    # -- errors --------------------------------------------------------------------------------

    def fail(self, field: str, msg: str) -> PlanError:
        return PlanError(f"{self.source}: {field}: {msg}")

    def _unknown(self, path: str, key: str, known: Iterable[str]) -> PlanError:
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else f"; known keys: {', '.join(sorted(known))}"
        return self.fail(_join(path, key), f"unknown key in [{path or '<top level>'}]{hint}")

    def strict(self, table: dict[str, Any], path: str, known: Iterable[str]) -> None:
        known = frozenset(known)
        for key in table:
            if key not in known:
                raise self._unknown(path, key, known)

    def lenient(self, table: dict[str, Any], path: str, owned: Iterable[str], skip: Iterable[str] = ()) -> None:
        """Pass over keys we do not read (recording them) unless one is a near miss of an owned key."""
        owned = frozenset(owned)
        skip = frozenset(skip)
        for key, value in table.items():
            if key in owned or key in skip:
                continue
            if difflib.get_close_matches(key, sorted(owned), n=1, cutoff=0.85):
                raise self._unknown(path, key, owned)
            (self.ignored_sections if isinstance(value, dict) or _is_table_list(value)
             else self.ignored_keys).append(_join(path, key))

    # -- typed readers -------------------------------------------------------------------------

    def table(self, parent: dict[str, Any], key: str, path: str) -> dict[str, Any] | None:
        value = parent.get(key)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self.fail(_join(path, key), f"expected a table, got {_kind(value)}")
        return value

    def integer(self, value: Any, field: str, minimum: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(field, f"expected an integer, got {_kind(value)} {value!r}")
        if value < minimum:
            raise self.fail(field, f"must be >= {minimum}, got {value}")
        return value

    def string(self, value: Any, field: str) -> str:
        if not isinstance(value, str) or not value.strip():
            raise self.fail(field, f"expected a non-empty string, got {_kind(value)} {value!r}")
        return value

    def string_list(self, value: Any, field: str, *, allow_single: bool = False) -> list[str]:
        if allow_single and isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise self.fail(field, f"expected a list of strings, got {_kind(value)}")
        return [self.string(v, f"{field}[{i}]") for i, v in enumerate(value)]

    def sampling(self, table: dict[str, Any], path: str) -> dict[str, Any]:
        self.strict(table, path, SAMPLING_KEYS)
        out = dict(table)
        if "max_completion_tokens" in out:
            mct = out.pop("max_completion_tokens")
            if "max_tokens" in out and out["max_tokens"] != mct:
                raise self.fail(_join(path, "max_completion_tokens"),
                                f"conflicts with max_tokens ({mct} != {out['max_tokens']}); set one of them")
            out["max_tokens"] = mct
        for key in ("max_tokens", "min_tokens", "top_k"):
            if key in out and out[key] is not None:
                self.integer(out[key], _join(path, key), 0 if key != "max_tokens" else 1)
        for key in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            if key in out and (isinstance(out[key], bool) or not isinstance(out[key], (int, float))):
                raise self.fail(_join(path, key), f"expected a number, got {_kind(out[key])} {out[key]!r}")
        if "temperature" in out and out["temperature"] < 0:
            raise self.fail(_join(path, "temperature"), f"must be >= 0, got {out['temperature']}")
        return out

    # -- the sections --------------------------------------------------------------------------

    def compile(self, data: dict[str, Any]) -> GenerationPlan:
        if not isinstance(data, dict):
            raise self.fail("<root>", "a plan is a TOML table")
        orch_table = self.table(data, "orchestrator", "")
        unified = orch_table is not None
        orch: dict[str, Any] = orch_table if unified else data
        op = "orchestrator" if unified else ""  # path prefix of the orchestrator scope

        if unified:
            self.lenient(data, "", owned={"orchestrator", "model", *TOP_SCALARS_UNIFIED})
        self.lenient(orch, op, owned=ORCH_SCALARS | ORCH_TABLES)

        family, model_path = self._family(data, orch, op, unified)
        learner_sampling = self._learner_sampling(orch, op)
        environments = self._environments(orch, op)
        group_size = self._group_size(orch, op)
        batch_size = self._scalar(orch, op, "batch_size", DEFAULT_BATCH_SIZE, minimum=1)
        max_off, max_async = self._staleness(data, orch, op, unified)
        advantage = self._advantage(orch, op)
        learner = self._learner(orch, op, family, learner_sampling)
        targets, members, train_one, untrained = self._multi_agent(orch, op, learner)

        try:
            return GenerationPlan(
                source=self.source, family=family, targets=targets, members=members, train_one=train_one,
                untrained_members=untrained, environments=environments, group_size=group_size,
                batch_size=batch_size, max_off_policy_steps=max_off, max_async_level=max_async,
                advantage=advantage, ignored_sections=self.ignored_sections, ignored_keys=self.ignored_keys,
                provenance={"family": model_path, **self.provenance})
        except ValidationError as exc:
            errors = exc.errors(include_url=False)
            shown = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'plan'}: {e['msg']}" for e in errors[:3])
            raise PlanError(f"{self.source}: {shown}") from None

    def _family(self, data: dict, orch: dict, op: str, unified: bool) -> tuple[str, str]:
        candidates = [(orch, op)] + ([(data, "")] if unified else [])
        for scope, path in candidates:
            model = self.table(scope, "model", path)
            if model is None:
                continue
            mpath = _join(path, "model")
            self.lenient(model, mpath, owned=MODEL_OWNED)
            if "name" in model:
                return self.string(model["name"], _join(mpath, "name")), _join(mpath, "name")
        raise self.fail("model.name", "the learner model is not named (add [model] name = \"...\")")

    def _learner_sampling(self, orch: dict, op: str) -> dict[str, Any]:
        train = self.table(orch, "train", op)
        old = self.table(orch, "sampling", op)
        new = self.table(train, "sampling", _join(op, "train")) if train is not None else None
        if old is not None and new is not None:
            raise self.fail(_join(op, "sampling"), f"set only one of [{_join(op, 'sampling')}] and "
                            f"[{_join(op, 'train.sampling')}]")
        if new is not None:
            return self.sampling(new, _join(op, "train.sampling"))
        if old is not None:
            return self.sampling(old, _join(op, "sampling"))
        return {}

    def _environments(self, orch: dict, op: str) -> list[EnvSpec]:
        train = self.table(orch, "train", op)
        sources: list[tuple[str, Any]] = []
        if train is not None:
            tpath = _join(op, "train")
            self.strict(train, tpath, TRAIN_OWNED | TRAIN_PASSED)
            for k in TRAIN_PASSED & train.keys():
                self.ignored_keys.append(_join(tpath, k))
            if "env" in train:
                sources.append((_join(tpath, "env"), train["env"]))
        if "env" in orch:
            sources.append((_join(op, "env"), orch["env"]))
        if "environment" in orch:
            sources.append((_join(op, "environment"), orch["environment"]))
        if not sources:
            raise self.fail(_join(op, "train.env"), "no environment: add [[orchestrator.train.env]] with an id")
        if len(sources) > 1:
            raise self.fail(sources[1][0], f"environments are given twice ({sources[0][0]} and {sources[1][0]}); "
                            "use one of them")
        path, value = sources[0]
        tables = [value] if isinstance(value, dict) else value
        if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
            raise self.fail(path, "expected one or more environment tables")
        envs = []
        for i, env in enumerate(tables):
            epath = path if isinstance(value, dict) else f"{path}[{i}]"
            self.strict(env, epath, ENV_OWNED | ENV_PASSED)
            env_id = env.get("id")
            if env_id is None and isinstance(env.get("taskset"), dict):
                env_id = env["taskset"].get("id")  # newer prime-rl: taskset = { id = ... }
            if env_id is None:
                raise self.fail(_join(epath, "id"), "the environment has no id (nor taskset.id)")
            self.string(env_id, _join(epath, "id"))
            name = env.get("name")
            if name is not None:
                self.string(name, _join(epath, "name"))
            args = env.get("args", {})
            if not isinstance(args, dict):
                raise self.fail(_join(epath, "args"), f"expected a table, got {_kind(args)}")
            sampling = self.table(env, "sampling", epath)
            envs.append(EnvSpec(id=env_id, name=name, args=args,
                                sampling=self.sampling(sampling, _join(epath, "sampling")) if sampling else {},
                                options={k: v for k, v in env.items() if k in ENV_PASSED}))
        names = [e.name or e.id.split("@")[0] for e in envs]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise self.fail(path, f"environment names repeat: {dupes}; give each a unique name")
        return envs

    def _scalar(self, scope: dict, path: str, key: str, default: int, minimum: int) -> int:
        if key in scope:
            self.provenance[key] = _join(path, key)
            return self.integer(scope[key], _join(path, key), minimum)
        self.provenance[key] = "default"
        return default

    def _group_size(self, orch: dict, op: str) -> int:
        given = {k: self.integer(orch[k], _join(op, k), 1) for k in ("group_size", "rollouts_per_example") if k in orch}
        if len(set(given.values())) > 1:
            raise self.fail(_join(op, "group_size"), f"conflicts with rollouts_per_example ({given}); set one")
        for key, value in given.items():
            self.provenance["group_size"] = _join(op, key)
            return value
        self.provenance["group_size"] = "default"
        return DEFAULT_GROUP_SIZE

    def _staleness(self, data: dict, orch: dict, op: str, unified: bool) -> tuple[int, int]:
        scopes = [(orch, op)] + ([(data, "")] if unified else [])

        def find(key: str) -> tuple[int, str] | None:
            for scope, path in scopes:
                if key in scope:
                    return self.integer(scope[key], _join(path, key), 0), _join(path, key)
            return None

        off, lvl = find("max_off_policy_steps"), find("max_async_level")
        max_async = lvl[0] if lvl else DEFAULT_MAX_ASYNC_LEVEL
        self.provenance["max_async_level"] = lvl[1] if lvl else "default"
        if off:
            self.provenance["max_off_policy_steps"] = off[1]
            return off[0], max_async
        if lvl:  # older recipes bound staleness with max_async_level alone
            self.provenance["max_off_policy_steps"] = lvl[1]
            return lvl[0], max_async
        self.provenance["max_off_policy_steps"] = "default"
        return DEFAULT_MAX_OFF_POLICY_STEPS, max_async

    def _advantage(self, orch: dict, op: str) -> AdvantageSpec:
        adv = self.table(orch, "advantage", op)
        if adv is None:
            return AdvantageSpec()
        apath = _join(op, "advantage")
        kind = self.string(adv.get("type", "grpo"), _join(apath, "type"))
        return AdvantageSpec(type=kind, params={k: v for k, v in adv.items() if k != "type"})

    def _learner(self, orch: dict, op: str, family: str, sampling: dict[str, Any]) -> Target:
        client = self.table(orch, "client", op) or {}
        cpath = _join(op, "client")
        self.lenient(client, cpath, owned=CLIENT_OWNED)
        base_urls = (self.string_list(client["base_url"], _join(cpath, "base_url"), allow_single=True)
                     if "base_url" in client else [])
        api_key_var = self.string(client["api_key_var"], _join(cpath, "api_key_var")) if "api_key_var" in client else None
        timeout = self._timeout(client, cpath)
        return Target(name=LEARNER, model=family, base_urls=base_urls, api_key_var=api_key_var,
                      sampling=sampling, timeout_s=timeout)

    def _timeout(self, table: dict, path: str) -> float | None:
        if "timeout" not in table:
            return None
        t = table["timeout"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
            raise self.fail(_join(path, "timeout"), f"expected a positive number of seconds, got {t!r}")
        return float(t)

    def _multi_agent(self, orch: dict, op: str, learner: Target
                     ) -> tuple[dict[str, Target], dict[str, MemberRoute], TrainOne | None, list[str]]:
        targets = {LEARNER: learner}
        members: dict[str, MemberRoute] = {}
        ma = self.table(orch, "multi_agent", op)
        if ma is None:
            return targets, members, None, []
        mpath = _join(op, "multi_agent")
        self.strict(ma, mpath, MULTI_AGENT_KEYS)

        fixed = self.table(ma, "fixed", mpath) or {}
        static_owner: dict[str, str] = {}
        for name, spec in fixed.items():
            fpath = _join(mpath, f"fixed.{name}")
            if not isinstance(spec, dict):
                raise self.fail(fpath, f"expected a table, got {_kind(spec)}")
            if name == LEARNER:
                raise self.fail(fpath, f'"{LEARNER}" is reserved for the trainable policy; name the fixed target otherwise')
            self.strict(spec, fpath, FIXED_KEYS)
            if "model" not in spec:
                raise self.fail(_join(fpath, "model"), f"fixed target {name!r} has no model")
            sampling = self.table(spec, "sampling", fpath)
            targets[name] = Target(
                name=name, model=self.string(spec["model"], _join(fpath, "model")),
                base_urls=(self.string_list(spec["base_url"], _join(fpath, "base_url"), allow_single=True)
                           if "base_url" in spec else []),
                api_key_var=(self.string(spec["api_key_var"], _join(fpath, "api_key_var"))
                             if "api_key_var" in spec else None),
                sampling=self.sampling(sampling, _join(fpath, "sampling")) if sampling else {},
                request_mode=self.string(spec.get("request_mode", "chat"), _join(fpath, "request_mode")),
                timeout_s=self._timeout(spec, fpath))
            for member in self.string_list(spec.get("members", []), _join(fpath, "members")):
                if member in static_owner:
                    raise self.fail(_join(fpath, "members"), f"member {member!r} is already routed to fixed "
                                    f"target {static_owner[member]!r}")
                static_owner[member] = name
                members[member] = MemberRoute(target=name, trainable=False)

        routes = self.table(ma, "routes", mpath) or {}
        rpath = _join(mpath, "routes")
        for member, target in routes.items():
            target = self.string(target, _join(rpath, member))
            if target not in targets:
                raise self.fail(_join(rpath, member), f"member {member!r} has no target: {target!r} is not defined "
                                f"(targets: {sorted(targets)})")
            if member in members:
                raise self.fail(_join(rpath, member), f"member {member!r} is already routed to fixed target "
                                f"{members[member].target!r}")
            members[member] = MemberRoute(target=target, trainable=target == LEARNER)

        train_one = None
        t1 = self.table(ma, "train_one", mpath)
        if t1 is not None:
            tpath = _join(mpath, "train_one")
            self.strict(t1, tpath, TRAIN_ONE_KEYS)
            if "members" not in t1:
                raise self.fail(_join(tpath, "members"), "train_one needs its candidate members")
            cands = self.string_list(t1["members"], _join(tpath, "members"))
            if not cands:
                raise self.fail(_join(tpath, "members"), "train_one.members is empty")
            repeated = sorted({m for m in cands if cands.count(m) > 1})
            if repeated:
                raise self.fail(_join(tpath, "members"), f"repeats {repeated}")
            clash = [m for m in cands if m in members]
            if clash:
                raise self.fail(_join(tpath, "members"), f"{clash} are train_one candidates and also statically "
                                f"routed (to {sorted({members[m].target for m in clash})}); a seat is one or the other")
            if "unselected" not in t1:
                raise self.fail(_join(tpath, "unselected"), "train_one needs the fixed target of the unselected seat")
            unselected = self.string(t1["unselected"], _join(tpath, "unselected"))
            if unselected not in targets or unselected == LEARNER:
                raise self.fail(_join(tpath, "unselected"), f"{unselected!r} names no fixed target "
                                f"(fixed targets: {sorted(set(targets) - {LEARNER})})")
            train_one = TrainOne(members=cands, unselected=unselected)

        untrained: list[str] = []
        drop = ma.get("drop_judge", False)
        if not isinstance(drop, bool):
            raise self.fail(_join(mpath, "drop_judge"), f"expected true or false, got {drop!r}")
        if drop and "judge" not in members and not (train_one and "judge" in train_one.members):
            untrained.append("judge")
        return targets, members, train_one, untrained


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


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _is_table_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _kind(value: Any) -> str:
    return {dict: "a table", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
            float: "a float"}.get(type(value), type(value).__name__)
