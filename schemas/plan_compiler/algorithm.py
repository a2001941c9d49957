"""Algorithms and credit: prime-rl's ``[algo]`` types (and per source), the fork's ``[advantage]``, the length penalty;
what runs here and what is shown but refused."""

from __future__ import annotations

from typing import Any, Iterable

from pydantic import ValidationError

from schemas.objectives import Demonstration
from schemas.plan import REF_KL, AdvantageSpec
from schemas.plan_compiler.reader import RecipeReader, join_path, kind_of, near_miss

# prime-rl's algorithm types (configs/algorithm.py, the AlgoConfig union): their own keys, and what
# runs them here. A mapped one names our credit strategy and its parameters; an unmapped one
# compiles, is shown, and is refused by the services (``schemas.plan.credit_strategy``) with the reason.
ALGORITHMS: dict[str, frozenset[str]] = {
    "grpo": frozenset({"length_penalty"}),
    "echo": frozenset({"length_penalty", "roles", "filter"}),
    "max_rl": frozenset(),
    "rae": frozenset({"decay"}),
    "hierarchical_grpo": frozenset({"episode_agents"}),
    "opd": frozenset({"teacher"}),
    "opsd": frozenset({"demo_key", "template", "renderer"}),
    "sft": frozenset(),
}

ECHO_ROLES = ("system", "user", "assistant", "tool")
ECHO_ALPHA = 0.1
"""prime-rl's ``EchoRoleConfig.alpha`` default; its ``EchoRolesConfig`` default enables ``tool`` alone."""

UNRUNNABLE = {
    "hierarchical_grpo": "baselines per proposed problem (solvers) and per source task (proposers); no credit "
                         "strategy here groups that way",
    "sft": "samples its training rollouts from a frozen model (sampling.source); the arena trains only on the "
           "learner's own samples",
}


class AlgorithmSection(RecipeReader):
    def _top_algorithm(self, orch: dict, op: str) -> AdvantageSpec:
        train = self.table(orch, "train", op)
        algo = self.one_of((self.table(orch, "algo", op), join_path(op, "algo")),
                           (self.table(train, "algo", join_path(op, "train")) if train is not None else None,
                            join_path(op, "train.algo"))) or (None, join_path(op, "algo"))
        adv = self.table(orch, "advantage", op), join_path(op, "advantage")
        self.one_of(algo, adv, why=" ([algo] is prime-rl's algorithm, [advantage] names a credit strategy)")
        if algo[0] is not None:
            return self._algo(*algo)
        if adv[0] is not None:
            return self._advantage(*adv)
        return AdvantageSpec()

    def _algo(self, algo: dict, path: str) -> AdvantageSpec:
        """prime-rl's [algo]: a discriminated union on ``type``; each type's own keys, plus ``sampling``."""
        if "type" not in algo:
            raise self.fail(join_path(path, "type"), f"the algorithm has no type (one of {', '.join(ALGORITHMS)})")
        kind = self.string(algo["type"], join_path(path, "type"))
        params = {k: v for k, v in algo.items() if k != "type"}
        if kind not in ALGORITHMS:
            return self._unknown_type(kind, params, path, ALGORITHMS, "algorithm",
                                      f"algorithm {kind!r} is not one of prime-rl's ({', '.join(ALGORITHMS)}); "
                                      "nothing here runs it")
        self.strict(params, path, ALGORITHMS[kind] | {"sampling"})
        sampling = self.table(params, "sampling", path) or {}
        self.strict(sampling, join_path(path, "sampling"), {"source"})
        source = sampling.get("source", "policy")
        if source != "policy" and kind != "sft":
            raise self.fail(join_path(path, "sampling.source"),
                            f"algorithm {kind!r} trains on the policy's own samples; "
                            "only sft samples from a frozen model (prime-rl refuses this too)")
        if kind == "sft" and source == "policy":
            raise self.fail(join_path(path, "sampling.source"), "sft needs a frozen model to sample from "
                            "(sampling.source = { name = ..., base_url = ... })")
        if kind == "opd" and not (isinstance(params.get("teacher"), dict) and "name" in params["teacher"]
                                  and "base_url" in params["teacher"]):
            raise self.fail(join_path(path, "teacher"), "opd needs a teacher = { name = ..., base_url = ... }")
        if kind == "hierarchical_grpo":
            self.string_list(params.get("episode_agents"), join_path(path, "episode_agents"))
        if kind in ("grpo", "echo"):
            shaping = self._length_penalty(params.get("length_penalty"), join_path(path, "length_penalty"))
            echo = self._echo_roles(params, path) if kind == "echo" else {}
            return AdvantageSpec(type=kind, params=params, origin=path, credit="grpo",
                                 credit_params={"scale_std": False, **shaping,
                                                **({"echo_roles": echo} if echo else {})},
                                 note=f"prime-rl {kind}, A = r - group mean: our grpo with scale_std = false"
                                      + (", rewards shaped by prime-rl's linear length penalty first" if shaping
                                         else "")
                                      + ("; plus cross-entropy on the environment's tokens of later turns ("
                                         + ", ".join(f"{r} alpha {a:g}" for r, a in echo.items())
                                         + "), each normalized by its own token count" if echo else ""))
        if kind == "max_rl":
            return AdvantageSpec(type=kind, params=params, origin=path, credit="grpo",
                                 credit_params={"scale_std": False, "scale_mean": True},
                                 note="prime-rl max_rl, A = (r - group mean) / group mean (0 where the mean is <= 0): "
                                      "our grpo with scale_mean = true")
        if kind == "rae":
            decay = self.number(params.get("decay", 0.95), join_path(path, "decay"))
            return AdvantageSpec(type=kind, params=params, origin=path, credit="ema_per_member",
                                 credit_params={"alpha": decay},
                                 note="prime-rl rae, A = r - EMA baseline per (source, agent), scored before the "
                                      "update: our ema_per_member with alpha = decay (our baseline starts at the "
                                      "first reward, prime-rl's at 0)")
        if kind == "opd":
            teacher = params["teacher"]
            return AdvantageSpec(type=kind, params=params, origin=path, credit=REF_KL, credit_params={},
                                 note=f"prime-rl opd, no advantage: the reference service prefills every trainable "
                                      f"token under the teacher {teacher['name']} at {teacher['base_url']}, and the "
                                      "trainer's ref_kl (prime-rl's reverse KL to it) trains the source's records")
        if kind == "opsd":
            demo = self._demonstration(params, path)
            renderer = params.get("renderer")
            return AdvantageSpec(type=kind, params=params, origin=path, credit=REF_KL, credit_params={},
                                 note=f"prime-rl opsd, no advantage: the reference service prefills every trainable "
                                      f"token under the live policy (the run's own vLLM) with the demonstration "
                                      f"{demo.key!r} prepended as a system message"
                                      + (" (rendered by the served model's chat template, not the named renderer)"
                                         if renderer not in (None, "auto", {"name": "auto"}) else "")
                                      + ", and the trainer's ref_kl (prime-rl's reverse KL to it) trains the source's "
                                      "records")
        return _cannot_run(kind, params, path, UNRUNNABLE[kind])

    def _echo_roles(self, params: dict[str, Any], path: str) -> dict[str, float]:
        """echo's ``roles`` table (prime-rl's ``EchoRolesConfig``: any role set replaces the default, tool at
        alpha 0.1) as {role: alpha}. Its ``filter`` is a function over a verifiers v1 Trace, which nothing here
        builds: refused, not dropped."""
        if "filter" in params:
            raise self.fail(join_path(path, "filter"), "echo's filter is called with a verifiers v1 Trace, which "
                            "the arena does not build: it cannot narrow the echo tokens here; remove it to train "
                            "every token of the enabled roles")
        table = self.table(params, "roles", path)
        if table is None:
            return {"tool": ECHO_ALPHA}
        roles_path = join_path(path, "roles")
        self.strict(table, roles_path, set(ECHO_ROLES))
        out = {}
        for role in ECHO_ROLES:
            role_table = self.table(table, role, roles_path)
            if role_table is None:
                continue
            self.strict(role_table, join_path(roles_path, role), {"alpha"})
            alpha = self.number(role_table.get("alpha", ECHO_ALPHA), join_path(roles_path, f"{role}.alpha"))
            if alpha <= 0:
                raise self.fail(join_path(roles_path, f"{role}.alpha"), f"must be > 0, got {alpha:g}")
            out[role] = alpha
        if not out:
            raise self.fail(roles_path, "echo needs at least one role enabled (system, user, assistant, or tool)")
        return out

    def _demonstration(self, params: dict[str, Any], path: str) -> Demonstration:
        """opsd's ``demo_key`` and ``template`` (prime-rl's ``OPSDAlgoConfig``, its defaults for what is left out)."""
        values = {}
        for key, field in (("demo_key", "key"), ("template", "template")):
            if key in params:
                values[field] = self.string(params[key], join_path(path, key))
        try:
            return Demonstration(**values)
        except ValidationError as e:
            raise self.fail(join_path(path, "template"), e.errors()[0]["msg"]) from None

    def _length_penalty(self, table: Any, path: str) -> dict[str, Any]:
        """prime-rl's ``algo.length_penalty`` (``LinearLengthPenaltyConfig``, its defaults for what it leaves out) as
        the grpo strategy's ``length_penalty`` weights; {} when unset."""
        if table is None:
            return {}
        if not isinstance(table, dict):
            raise self.fail(path, f"expected a table, got {kind_of(table)} {table!r}")
        self.strict(table, path, {"type", "num_output_tokens_weight", "num_input_tokens_weight", "num_turns_weight"})
        if table.get("type", "linear") != "linear":
            raise self.fail(join_path(path, "type"), f"{table['type']!r}: prime-rl's length penalty is 'linear'")
        weights = {}
        for key, name, default in (("num_output_tokens_weight", "output", 0.25),
                                   ("num_input_tokens_weight", "input", 0.1), ("num_turns_weight", "turns", 0.1)):
            w = self.number(table.get(key, default), join_path(path, key))
            if w < 0:
                raise self.fail(join_path(path, key), f"must be >= 0, got {w:g}")
            weights[name] = w
        return {"length_penalty": weights}

    def _advantage(self, adv: dict, path: str) -> AdvantageSpec:
        """Our (and the multi-agent fork's) [advantage]: ``type`` names a credit strategy directly. Which
        strategies exist is the credit service's open registry (``consumers.credit``), checked where the
        plan is run (``consumers.settings``), not here."""
        kind = self.string(adv.get("type", "grpo"), join_path(path, "type"))
        params = {k: v for k, v in adv.items() if k != "type"}
        if params.get("length_penalty") is not None:
            return _cannot_run(kind, params, path, f"{kind} with a length_penalty: the credit service has no "
                                                   "length shaping")
        credit_params = dict(params)
        if "momentum" in credit_params:  # the fork's name for the EMA factor
            credit_params["alpha"] = credit_params.pop("momentum")
        return AdvantageSpec(type=kind, params=params, origin=path, credit=kind, credit_params=credit_params,
                             note=f"credit strategy {kind}, as written")

    def _unknown_type(self, kind: str, params: dict, path: str, known: Iterable[str], what: str,
                      note: str) -> AdvantageSpec:
        """A type we do not know: refused when it is a near miss of a known one, else compiled to be refused
        by the services with ``note``."""
        close = near_miss(kind, known)
        if close:
            raise self.fail(join_path(path, "type"), f"unknown {what} {kind!r} (did you mean {close[0]!r}?)")
        return _cannot_run(kind, params, path, note)


def _cannot_run(kind: str, params: dict[str, Any], origin: str, note: str) -> AdvantageSpec:
    """An algorithm the plan shows but nothing here runs: no credit strategy; the services refuse it."""
    return AdvantageSpec(type=kind, params=params, origin=origin, credit=None, credit_params={}, note=note)
