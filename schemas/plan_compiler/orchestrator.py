"""The orchestrator's scalars and multi-agent routing: batch and group sizes, the run's length, the staleness bound,
``[multi_agent]`` (train_one, fixed seats, routes)."""

from __future__ import annotations

from pydantic import ValidationError

from schemas.plan import (DEFAULT_BATCH_SIZE, DEFAULT_GROUP_SIZE, DEFAULT_MAX_ASYNC_LEVEL, DEFAULT_MAX_OFF_POLICY_STEPS,
                          LEARNER, Concurrency, MemberRoute, Target, TrainOne)
from schemas.plan_compiler.reader import RecipeReader, join_path, kind_of

MULTI_AGENT_KEYS = frozenset({"train_one", "fixed", "drop_judge", "routes"})

TRAIN_ONE_KEYS = frozenset({"members", "unselected"})

FIXED_KEYS = frozenset({"members", "model", "base_url", "api_key_var", "request_mode", "sampling", "timeout"})

# Scalar keys of the orchestrator scope (the [orchestrator] table, or the top level of an orchestrator-only file).
ORCH_SCALARS = frozenset({"batch_size", "token_batch_size", "group_size", "rollouts_per_example",
                          "max_off_policy_steps", "max_async_level", "max_steps", "seq_len"})

# Tables of the orchestrator scope the compiler reads.
ORCH_TABLES = frozenset({"sampling", "env", "environment", "train", "eval", "algo", "advantage", "multi_agent",
                         "client", "model", "concurrency"})

CONCURRENCY_KEYS = frozenset({"initial_inflight", "min_inflight", "max_inflight"})  # prime-rl's ConcurrencyConfig

TOP_SCALARS_UNIFIED = frozenset({"max_off_policy_steps", "max_async_level", "max_steps", "seq_len"})


class OrchestratorSection(RecipeReader):
    def _batching(self, orch: dict, op: str) -> tuple[int, int | None]:
        tokens = self.integer(orch["token_batch_size"], join_path(op, "token_batch_size"), 1) \
            if "token_batch_size" in orch else None
        if tokens is not None and "batch_size" in orch:
            raise self.fail(join_path(op, "token_batch_size"), "set exactly one of batch_size or token_batch_size")
        if tokens is not None:
            self.provenance["batch_size"] = f"default ({join_path(op, 'token_batch_size')} batches by tokens)"
            return DEFAULT_BATCH_SIZE, tokens
        if "batch_size" in orch:
            self.provenance["batch_size"] = join_path(op, "batch_size")
            return self.integer(orch["batch_size"], join_path(op, "batch_size"), 1), None
        self.provenance["batch_size"] = "default"
        return DEFAULT_BATCH_SIZE, None

    def _group_size(self, orch: dict, op: str) -> int:
        """prime-rl's older ``group_size`` (or ``rollouts_per_example``) of the orchestrator, or the newer
        ``[orchestrator.train] group_size``: both accepted, the one written applied, two that differ refused."""
        train = orch.get("train") if isinstance(orch.get("train"), dict) else {}
        scopes = [(train, join_path(op, "train"), "group_size")] + [(orch, op, k) for k in ("group_size",
                                                                                   "rollouts_per_example")]
        given = {join_path(p, k): self.integer(t[k], join_path(p, k), 1) for t, p, k in scopes if k in t}
        if len(set(given.values())) > 1:
            raise self.fail(next(iter(given)), f"group sizes conflict ({given}); set one")
        for key, value in given.items():
            self.provenance["group_size"] = key
            return value
        self.provenance["group_size"] = "default"
        return DEFAULT_GROUP_SIZE

    def _concurrency(self, orch: dict, op: str) -> Concurrency | None:
        """``[orchestrator.concurrency]``: the in-flight bounds, checked as prime-rl checks them."""
        path = join_path(op, "concurrency")
        table = self.table(orch, "concurrency", op)
        if table is None:
            return None
        self.strict(table, path, CONCURRENCY_KEYS)
        values = {k: None if v is None and k == "max_inflight" else self.integer(v, join_path(path, k), 1)
                  for k, v in table.items()}
        try:
            return Concurrency(**values)
        except ValidationError as exc:
            raise self.fail(path, exc.errors(include_url=False)[0]["msg"].removeprefix("Value error, ")) from None

    def _run_length(self, data: dict, orch: dict, op: str, unified: bool) -> tuple[int | None, int | None]:
        """``max_steps`` (trained revisions; top level of an rl file or the orchestrator's) and ``seq_len``."""
        out: list[int | None] = []
        for key in ("max_steps", "seq_len"):
            scopes = [(orch, op)] + ([(data, "")] if unified else [])
            found = [(s[key], join_path(p, key)) for s, p in scopes if s.get(key) is not None]
            if len({v for v, _ in found}) > 1:
                raise self.fail(found[1][1], f"conflicts with {found[0][1]} ({found[1][0]} != {found[0][0]}); set one")
            out.append(self.integer(found[0][0], found[0][1], 1) if found else None)
            self.provenance[key] = found[0][1] if found else "default"
        return out[0], out[1]

    def _staleness(self, data: dict, orch: dict, op: str, unified: bool) -> tuple[int, int]:
        scopes = [(orch, op)] + ([(data, "")] if unified else [])

        def find(key: str) -> tuple[int, str] | None:
            for scope, path in scopes:
                if key in scope:
                    return self.integer(scope[key], join_path(path, key), 0), join_path(path, key)
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

    def _multi_agent(self, orch: dict, op: str) -> tuple[TrainOne | None, list[str]]:
        """The fork's [multi_agent]: fixed targets and their members, train_one, drop_judge; our routes."""
        targets, members = self.targets, self.members
        ma = self.table(orch, "multi_agent", op)
        if ma is None:
            return None, []
        mpath = join_path(op, "multi_agent")
        self.strict(ma, mpath, MULTI_AGENT_KEYS)

        fixed = self.table(ma, "fixed", mpath) or {}
        static_owner: dict[str, str] = {}
        for name, spec in fixed.items():
            fpath = join_path(mpath, f"fixed.{name}")
            if not isinstance(spec, dict):
                raise self.fail(fpath, f"expected a table, got {kind_of(spec)}")
            if name == LEARNER:
                raise self.fail(fpath, f'"{LEARNER}" is reserved for the trainable policy; '
                                       'name the fixed target otherwise')
            if name in targets:
                raise self.fail(fpath, f"a seat pinned in {self.seat_origin.get(name, '?')} is already the "
                                       f"target {name!r}")
            self.strict(spec, fpath, FIXED_KEYS)
            if "model" not in spec:
                raise self.fail(join_path(fpath, "model"), f"fixed target {name!r} has no model")
            targets[name] = Target(
                name=name, model=self.string(spec["model"], join_path(fpath, "model")),
                base_urls=(self.string_list(spec["base_url"], join_path(fpath, "base_url"), allow_single=True)
                           if "base_url" in spec else []),
                api_key_var=(self.string(spec["api_key_var"], join_path(fpath, "api_key_var"))
                             if "api_key_var" in spec else None),
                sampling=self.sampling_of(spec, fpath),
                request_mode=self.string(spec.get("request_mode", "chat"), join_path(fpath, "request_mode")),
                timeout_s=self._timeout(spec, fpath))
            for member in self.string_list(spec.get("members", []), join_path(fpath, "members")):
                if member in members and member not in static_owner:
                    raise self.fail(join_path(fpath, "members"), f"member {member!r} is a seat pinned to "
                                    f"{members[member].target!r} in {self.seat_origin[member]}")
                if member in static_owner:
                    raise self.fail(join_path(fpath, "members"), f"member {member!r} is already routed to fixed "
                                    f"target {static_owner[member]!r}")
                static_owner[member] = name
                members[member] = MemberRoute(target=name, trainable=False)

        routes = self.table(ma, "routes", mpath) or {}
        rpath = join_path(mpath, "routes")
        for member, target in routes.items():
            target = self.string(target, join_path(rpath, member))
            if target not in targets:
                raise self.fail(join_path(rpath, member), f"member {member!r} has no target: {target!r} is not defined "
                                f"(targets: {sorted(targets)})")
            if member in members:
                raise self.fail(join_path(rpath, member), f"member {member!r} is already routed to fixed target "
                                f"{members[member].target!r}")
            members[member] = MemberRoute(target=target, trainable=target == LEARNER)

        train_one = None
        t1 = self.table(ma, "train_one", mpath)
        if t1 is not None:
            tpath = join_path(mpath, "train_one")
            self.strict(t1, tpath, TRAIN_ONE_KEYS)
            if "members" not in t1:
                raise self.fail(join_path(tpath, "members"), "train_one needs its candidate members")
            if "unselected" not in t1:
                raise self.fail(join_path(tpath, "unselected"),
                                "train_one needs the fixed target of the unselected seat")
            train_one = TrainOne(members=self.string_list(t1["members"], join_path(tpath, "members")),
                                 unselected=self.string(t1["unselected"], join_path(tpath, "unselected")))
            problem = train_one.problem(targets, members)
            if problem is not None:
                raise self.fail(join_path(tpath, problem[0]), problem[1])

        untrained: list[str] = []
        drop = ma.get("drop_judge", False)
        if not isinstance(drop, bool):
            raise self.fail(join_path(mpath, "drop_judge"), f"expected true or false, got {drop!r}")
        if drop and "judge" not in members and not (train_one and "judge" in train_one.members):
            untrained.append("judge")
        return train_one, untrained
