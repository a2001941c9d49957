"""Training and evaluation sources and their environments: ``[[train.source]]`` with its seats, the older
``[[env]]``/``[environment]`` forms, ``[[eval.source]]`` and the evaluation cadence, admission gates."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from schemas.plan import (DEFAULT_EVAL_INTERVAL, LEARNER, AdvantageSpec, EnvSpec, AdmissionGate, MemberRoute, Seat,
                          Target)
from schemas.plan_compiler.reader import RecipeReader, join_path, kind_of

# prime-rl EnvConfig / TrainSourceConfig / EvalSourceConfig (configs/orchestrator.py).
SOURCE_KEYS = frozenset({"env", "serve", "name", "ratio", "sampling", "group_size", "algo", "curriculum",
                         "num_examples", "interval", "select", "sampler", "skip_first_step"})

# verifiers vf.EnvConfig base fields; any other table of env is a seat (an AgentConfig) or an env knob.
ENV_BASE_KEYS = frozenset({"id", "taskset", "timeout", "retries", "max_concurrent_agents", "interception"})

AGENT_KEYS = frozenset({"harness", "runtime", "model", "client", "sampling", "max_turns", "max_input_tokens",
                        "max_output_tokens", "max_total_tokens", "timeout", "retries"})

SEAT_CLIENT_KEYS = frozenset({"base_url", "api_key_var", "headers", "type", "renderer", "renderer_model_name",
                              "multiplex"})

# The older [[orchestrator.env]] / [[orchestrator.train.env]] / [environment] form (and the fork's).
ENV_OWNED = frozenset({"id", "name", "args", "sampling", "ratio"})

ENV_PASSED = frozenset({"taskset", "harness", "num_workers", "address", "extra_env_kwargs", "max_retries",
                        "max_total_completion_tokens", "version", "score_rollouts", "num_examples",
                        "rollouts_per_example", "group_size", "interval"})

# [orchestrator.train]: prime-rl's newer shape also holds group_size, algo, select and sampler here.
TRAIN_OWNED = frozenset({"source", "env", "sampling", "group_size", "algo", "select", "sampler"})

EVAL_CADENCE = frozenset({"interval", "skip_first_step"})  # the plan's eval_interval, eval_skip_first_step

EVAL_OWNED = frozenset({"source", "env", "sampling", "num_examples", "group_size", "rollouts_per_example",
                        "select"}) | EVAL_CADENCE

# The task samplers run here: prime-rl's standard one (cycle through the taskset, admit every group).
STANDARD_SAMPLER = "standard"


class SourceSection(RecipeReader):
    def _train_sources(self, orch: dict, op: str, family: str, top: AdvantageSpec) -> list[EnvSpec]:
        train = self.table(orch, "train", op)
        tpath = join_path(op, "train")
        forms: list[tuple[str, Any]] = []
        if train is not None:
            self.lenient(train, tpath, owned=TRAIN_OWNED)
            for key in ("source", "env"):
                if key in train:
                    forms.append((join_path(tpath, key), train[key]))
        for key in ("env", "environment"):
            if key in orch:
                forms.append((join_path(op, key), orch[key]))
        if not forms:
            only_eval = isinstance(orch.get("eval"), dict)
            raise self.fail(join_path(tpath, "source"), "no training source: add [[orchestrator.train.source]] with "
                            "env.taskset.id" + (" (the recipe has evaluation sources only)" if only_eval else ""))
        path, read = self._sources(forms, "training", family, evaluation=False)
        if not read:
            raise self.fail(path, "no training source")
        shared: dict[str, Any] = {}
        shared_gates: list[AdmissionGate] = []
        if train is not None:
            shared_gates = self._sampling_policy(train, tpath)  # the older [orchestrator.train] curriculum
            if "select" in train:
                shared["select"] = self.table(train, "select", tpath)
        envs = []
        for p, t, env in read:
            algo = self.table(t, "algo", p) if path.endswith("source") else None
            envs.append(env.model_copy(update={"algorithm": self._algo(algo, join_path(p, "algo")) if algo else top,
                                               "options": {**shared, **env.options},
                                               "gates": env.gates or shared_gates}))
        return envs

    def _eval_sources(self, orch: dict, op: str, family: str) -> list[EnvSpec]:
        ev = self.table(orch, "eval", op)
        if ev is None:
            return []
        epath = join_path(op, "eval")
        self.lenient(ev, epath, owned=EVAL_OWNED)
        forms = [(join_path(epath, k), ev[k]) for k in ("source", "env") if k in ev]
        if not forms:
            # the cadence alone is the training sources' held-out sets' (rollout-log's own; prime-rl refuses an
            # [eval] block without a source)
            for_sources = sorted((EVAL_OWNED - EVAL_CADENCE) & ev.keys())
            if not for_sources:
                return []
            raise self.fail(join_path(epath, "source"), f"[{epath}] sets {', '.join(for_sources)} for evaluation "
                            f"sources and has none: add at least one [[{epath}.source]] (prime-rl refuses the block "
                            "without one too); interval and skip_first_step alone are the cadence of the training "
                            "sources' held-out sets")
        group_sampling = self.sampling_of(ev, epath)
        defaults = {"num_examples": ev.get("num_examples", -1),
                    "group_size": ev.get("group_size", ev.get("rollouts_per_example", 1))}
        if "select" in ev:
            defaults["select"] = self.table(ev, "select", epath)
        envs = []
        for path, _, env in self._sources(forms, "evaluation", family, evaluation=True)[1]:
            options = {**defaults, **env.options}
            if "rollouts_per_example" in options:  # the older spelling of an eval source's group_size
                options["group_size"] = options.pop("rollouts_per_example")
            if "interval" in options:  # the source's own cadence (GenerationPlan.eval_due), as the older form wrote it
                self.integer(options["interval"], join_path(path, "interval"), 1)
            envs.append(env.model_copy(update={"sampling": {**group_sampling, **env.sampling}, "options": options}))
        return envs

    def _eval_cadence(self, orch: dict, op: str) -> tuple[int, bool]:
        """(interval, skip_first_step) of ``[eval]``: when the training sources' held-out sets are answered, and the
        evaluation sources that set no cadence of their own. Without the block: every revision."""
        ev = self.table(orch, "eval", op)
        if ev is None:
            self.provenance["eval_interval"] = "default (no [eval]: every revision)"
            return 1, False
        epath = join_path(op, "eval")
        self.provenance["eval_interval"] = join_path(epath, "interval") if "interval" in ev else "default (prime-rl's)"
        interval = self.integer(ev.get("interval", DEFAULT_EVAL_INTERVAL), join_path(epath, "interval"), 1)
        return interval, self._bool(ev.get("skip_first_step", False), join_path(epath, "skip_first_step"))

    def _sources(self, forms: list[tuple[str, Any]], what: str, family: str, *,
                 evaluation: bool) -> tuple[str, list[tuple[str, dict[str, Any], EnvSpec]]]:
        """The one form of sources the recipe uses (``[[...source]]`` or the older env tables): its path,
        and each table with its path and EnvSpec. Names must be unique."""
        if len(forms) > 1:
            raise self.fail(forms[1][0], f"{what} sources are given twice ({forms[0][0]} and {forms[1][0]}); "
                            "use one of them")
        path, value = forms[0]
        read = [(p, t, self._source(t, p, family, evaluation=evaluation) if path.endswith("source")
                 else self._old_env(t, p, evaluation=evaluation)) for p, t in self.tables(value, path)]
        names = [env.display_name for _, _, env in read]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise self.fail(path, f"environment names repeat: {dupes}; give each a unique name")
        return path, read

    def _source(self, src: dict, path: str, family: str, *, evaluation: bool) -> EnvSpec:
        """prime-rl's TrainSourceConfig / EvalSourceConfig: ``env`` (verifiers' EnvConfig) + our per-source knobs."""
        self.lenient(src, path, owned=SOURCE_KEYS)
        env = self.table(src, "env", path)
        if env is None:
            raise self.fail(join_path(path, "env"), 'no env configured: set env = { taskset = { id = "<id>" } }')
        envp = join_path(path, "env")
        taskset = self.table(env, "taskset", envp) or {}
        env_id = env.get("id") or ""
        task_id = taskset.get("id") or ""
        if env_id:
            self.string(env_id, join_path(envp, "id"))
        if task_id:
            self.string(task_id, join_path(envp, "taskset.id"))
        if not (env_id or task_id):
            raise self.fail(join_path(envp, "taskset.id"), 'no env configured: set env = { taskset = { id = "<id>" } }')
        full_id = f"{env_id}+{task_id}" if env_id and task_id else task_id or env_id  # verifiers' env_id
        name = self.string(src["name"], join_path(path, "name")) if "name" in src else None
        options: dict[str, Any] = {"weight": self.number(src.get("ratio", 1.0), join_path(path, "ratio"))}
        if options["weight"] <= 0:
            raise self.fail(join_path(path, "ratio"), f"must be > 0, got {src['ratio']}")
        for key in ("group_size", "num_examples", "interval"):
            if key in src:
                options[key] = self.integer(src[key], join_path(path, key), -1 if key == "num_examples" else 1)
        if "serve" in src:
            options["serve"] = src["serve"]
        if "select" in src:
            options["select"] = self.table(src, "select", path)
        if "skip_first_step" in src:
            options["skip_first_step"] = self._bool(src["skip_first_step"], join_path(path, "skip_first_step"))
        gates = self._sampling_policy(src, path)
        knobs: dict[str, Any] = {}
        seats: dict[str, Seat] = {}
        for key, value in env.items():
            if key in ("id", "taskset"):
                continue
            if key == "harness":
                raise self.fail(join_path(envp, key), "a harness belongs to a seat: [...env.agent.harness] on a "
                                "single-agent env, [...env.<seat>.harness] on a multi-agent one (verifiers refuses "
                                "it too)")
            if key not in ENV_BASE_KEYS and isinstance(value, dict) and (not value or AGENT_KEYS & value.keys()):
                seats[key] = self._seat(key, value, join_path(envp, key), family)
            else:
                knobs[key] = value
        if knobs:
            options["env"] = knobs
        return EnvSpec(id=full_id, name=name, args={k: v for k, v in taskset.items() if k != "id"},
                       sampling=self.sampling_of(src, path), env_table=env,
                       options=options, evaluation=evaluation, seats=seats, gates=gates)

    def _sampling_policy(self, table: dict, path: str) -> list[AdmissionGate]:
        """prime-rl's task sampler (``sampler``, or ``curriculum.sampler``) and admission gates
        (``curriculum.gates``): the standard sampler (cycle through the taskset) and ``advantage_range`` gates run
        here; any other is refused when a run starts. The gates, as written."""
        cur = self.table(table, "curriculum", path) or {}
        for key, value in (("sampler", table.get("sampler")), ("curriculum.sampler", cur.get("sampler"))):
            if value is None:
                continue
            kind = value.get("type", STANDARD_SAMPLER) if isinstance(value, dict) else value
            if kind != STANDARD_SAMPLER:
                self.refused.append(f"{join_path(path, key)}: task sampler {kind!r}: only prime-rl's standard sampler "
                                    "runs here")
        extra = sorted(set(cur) - {"sampler", "gates"})
        if extra:
            self.refused.append(f"{join_path(path, 'curriculum')}: keys {extra}: not applied by rollout-log")
        gpath = join_path(path, "curriculum.gates")
        gates = self.table(cur, "gates", join_path(path, "curriculum")) or {}
        out = []
        for name, gate in gates.items():
            gp = join_path(gpath, name)
            if not isinstance(gate, dict):
                raise self.fail(gp, f"expected a table, got {kind_of(gate)} {gate!r}")
            kind = gate.get("type", "advantage_range")
            if kind != "advantage_range":
                self.refused.append(f"{gp}: admission gate type {kind!r}: only prime-rl's advantage_range runs here")
                continue
            unknown = sorted(set(gate) - {"type", "reject_min", "reject_max"})
            if unknown:
                raise self.fail(gp, f"unknown keys {unknown} (an advantage_range gate has reject_min, reject_max)")
            bounds = {k: self.number(gate[k], join_path(gp, k)) for k in ("reject_min", "reject_max") if k in gate}
            try:
                out.append(AdmissionGate(name=name, **bounds))
            except ValidationError as e:
                raise self.fail(gp, e.errors()[0]["msg"].removeprefix("Value error, ")) from None
        return out

    def _seat(self, seat: str, spec: dict, path: str, family: str) -> Seat:
        """A verifiers AgentConfig: unpinned (or pinned to the learner's model) it is the learner, trainable;
        pinned to another model or its own endpoint it is a fixed target."""
        self.lenient(spec, path, owned=AGENT_KEYS)
        sampling = self.sampling_of(spec, path)
        options = {k: v for k, v in spec.items() if k in AGENT_KEYS - {"model", "client", "sampling"}}
        model = self.string(spec["model"], join_path(path, "model")) if "model" in spec else None
        client = self.table(spec, "client", path)
        if (model is None or model == family) and client is None:
            self._route_seat(seat, LEARNER, path)
            return Seat(target=LEARNER, trainable=True, sampling=sampling, options=options)
        client = client or {}
        self.lenient(client, join_path(path, "client"), owned=SEAT_CLIENT_KEYS)
        target = Target(name=seat, model=model or family,
                        base_urls=[self.string(client["base_url"], join_path(path, "client.base_url"))]
                        if "base_url" in client else [],
                        api_key_var=self.string(client["api_key_var"], join_path(path, "client.api_key_var"))
                        if "api_key_var" in client else None,
                        sampling=sampling)
        name = seat
        if seat in self.targets and self.targets[seat] != target:
            name = f"{seat}@{path}"
            target = target.model_copy(update={"name": name})
        self.targets[name] = target
        self._route_seat(seat, name, path)
        return Seat(target=name, trainable=False, options=options)

    def _route_seat(self, seat: str, target: str, path: str) -> None:
        """Members are routed plan-wide: a seat name must route the same way in every source."""
        current = self.members[seat].target if seat in self.members else LEARNER
        if seat in self.seat_origin and current != target:
            raise self.fail(path, f"seat {seat!r} goes to {target!r} here but to {current!r} in "
                            f"{self.seat_origin[seat]}; members are routed plan-wide, name the seats apart")
        self.seat_origin.setdefault(seat, path)
        if target != LEARNER:
            self.members[seat] = MemberRoute(target=target, trainable=False)

    def _old_env(self, env: dict, path: str, *, evaluation: bool) -> EnvSpec:
        """The older environment table (``id``, ``name``, ``args``, ``sampling``), and the fork's keys."""
        self.lenient(env, path, owned=ENV_OWNED | ENV_PASSED)
        env_id = env.get("id")
        if env_id is None and isinstance(env.get("taskset"), dict):
            env_id = env["taskset"].get("id")  # taskset = { id = ... } in this form too
        if env_id is None:
            raise self.fail(join_path(path, "id"), "the environment has no id (nor taskset.id)")
        self.string(env_id, join_path(path, "id"))
        name = self.string(env["name"], join_path(path, "name")) if "name" in env else None
        args = env.get("args", {})
        if not isinstance(args, dict):
            raise self.fail(join_path(path, "args"), f"expected a table, got {kind_of(args)}")
        options: dict[str, Any] = {k: v for k, v in env.items() if k in ENV_PASSED}
        if env.get("ratio") is not None:
            options["weight"] = self.number(env["ratio"], join_path(path, "ratio"))
        return EnvSpec(id=env_id, name=name, args=args, evaluation=evaluation, options=options,
                       sampling=self.sampling_of(env, path))
