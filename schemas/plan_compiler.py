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

import difflib
import tomllib
from pathlib import Path
from typing import Any, Iterable

from pydantic import ValidationError

from schemas.objectives import OBJECTIVE_TYPES, DefaultLoss, objective_from
from schemas.recipe_keys import neutral_reason, refusals
from schemas.plan import (DEFAULT_BATCH_SIZE, DEFAULT_EVAL_INTERVAL, DEFAULT_GROUP_SIZE, DEFAULT_MAX_ASYNC_LEVEL,
                          DEFAULT_MAX_OFF_POLICY_STEPS, LEARNER, REF_KL, AdvantageSpec, EnvSpec, GenerationPlan,
                          AdmissionGate, LoraSpec, MemberRoute, OPTIMIZERS, OptimizerSpec, PlanError, SERVER_KEYS, Seat,
                          Target, TrainOne)

# Sampling keys we know: prime-rl's train/eval sampling configs (and the fork's), verifiers'
# SamplingConfig and the request fields producers.inference.client sends. Any other key is a sampling
# parameter for the server (vLLM takes extra ones), passed through in extra_body.
SAMPLING_KEYS = frozenset({
    "temperature", "max_tokens", "max_completion_tokens", "top_p", "top_k", "min_p", "min_tokens",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop", "extra_body",
    "reasoning_effort", "logprobs", "n"})
SAMPLING_IGNORED = frozenset({"temp_scheduler"})  # the fork's orchestrator-side temperature schedule
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
MULTI_AGENT_KEYS = frozenset({"train_one", "fixed", "drop_judge", "routes"})
TRAIN_ONE_KEYS = frozenset({"members", "unselected"})
FIXED_KEYS = frozenset({"members", "model", "base_url", "api_key_var", "request_mode", "sampling", "timeout"})
CLIENT_OWNED = frozenset({"base_url", "api_key_var", "timeout"})
MODEL_OWNED = frozenset({"name", "client"})
# Scalar keys of the orchestrator scope (the [orchestrator] table, or the top level of an orchestrator-only file).
ORCH_SCALARS = frozenset({"batch_size", "token_batch_size", "group_size", "rollouts_per_example",
                          "max_off_policy_steps", "max_async_level", "max_steps", "seq_len"})
# Tables of the orchestrator scope the compiler reads.
ORCH_TABLES = frozenset({"sampling", "env", "environment", "train", "eval", "algo", "advantage", "multi_agent",
                         "client", "model"})
TOP_SCALARS_UNIFIED = frozenset({"max_off_policy_steps", "max_async_level", "max_steps", "seq_len"})
# The task samplers run here: prime-rl's standard one (cycle through the taskset, admit every group).
STANDARD_SAMPLER = "standard"

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
UNRUNNABLE = {
    "echo": "GRPO plus a cross-entropy loss on env-provided (tool/user) tokens; training records here carry only "
            "the policy's completion tokens, never the environment's",
    "hierarchical_grpo": "baselines per proposed problem (solvers) and per source task (proposers); no credit "
                         "strategy here groups that way",
    "opsd": "self-distillation scores each sample under the live policy with a demonstration prepended (a prompt "
            "re-rendered per sample, at the current revision); the reference service prefills a frozen teacher only",
    "sft": "samples its training rollouts from a frozen model (sampling.source); the arena trains only on the "
           "learner's own samples",
}


class _Compiler:
    def __init__(self, source: str) -> None:
        self.source = source
        self.ignored_sections: list[str] = []
        self.ignored_keys: list[str] = []
        self.refused: list[str] = []
        self.unified = True
        self.passthrough: list[str] = []
        self.provenance: dict[str, str] = {}
        self.targets: dict[str, Target] = {}
        self.members: dict[str, MemberRoute] = {}
        self.seat_origin: dict[str, str] = {}  # seat -> path of the source that routed it

    # -- errors --------------------------------------------------------------------------------

    def fail(self, field: str, msg: str) -> PlanError:
        return PlanError(f"{self.source}: {field}: {msg}")

    def _unknown(self, path: str, key: str, known: Iterable[str]) -> PlanError:
        close = _near_miss(key, known) or difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
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
            if _near_miss(key, owned):
                raise self._unknown(path, key, owned)
            self.ignore(_join(path, key), value)

    def ignore(self, path: str, value: Any) -> None:
        """A key the generation plan does not read: refused when it changes the run (``schemas.recipe_keys``),
        else listed as not applicable here."""
        refused = refusals(path, value, orchestrator_scope=not self.unified)
        self.refused.extend(refused)
        if not refused and neutral_reason(path, orchestrator_scope=not self.unified) is not None:
            (self.ignored_sections if isinstance(value, dict) or _is_table_list(value) else self.ignored_keys).append(path)

    # -- typed readers -------------------------------------------------------------------------

    def table(self, parent: dict[str, Any], key: str, path: str) -> dict[str, Any] | None:
        value = parent.get(key)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self.fail(_join(path, key), f"expected a table, got {_kind(value)}")
        return value

    def tables(self, value: Any, path: str) -> list[tuple[str, dict[str, Any]]]:
        """One table or an array of tables, each with its path."""
        if isinstance(value, dict):
            return [(path, value)]
        if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
            raise self.fail(path, f"expected one or more tables, got {_kind(value)}")
        return [(f"{path}[{i}]", t) for i, t in enumerate(value)]

    def one_of(self, first: tuple[dict[str, Any] | None, str], second: tuple[dict[str, Any] | None, str],
               why: str = "") -> tuple[dict[str, Any], str] | None:
        """The one of two spellings of a table that the recipe uses, as (table, path); both is refused."""
        if first[0] is not None and second[0] is not None:
            raise self.fail(second[1], f"set only one of [{first[1]}] and [{second[1]}]{why}")
        return next(((t, path) for t, path in (first, second) if t is not None), None)

    def integer(self, value: Any, field: str, minimum: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(field, f"expected an integer, got {_kind(value)} {value!r}")
        if value < minimum:
            raise self.fail(field, f"must be >= {minimum}, got {value}")
        return value

    def number(self, value: Any, field: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(field, f"expected a number, got {_kind(value)} {value!r}")
        return float(value)

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
        """Known keys checked and normalised (max_completion_tokens -> max_tokens); a near miss refused;
        any other key moved into extra_body (sent to the server as is) and listed."""
        out: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in table.items():
            if key in SAMPLING_IGNORED:
                self.ignore(_join(path, key), value)
            elif key == "extra_body":
                if not isinstance(value, dict):
                    raise self.fail(_join(path, key), f"expected a table, got {_kind(value)}")
                extra.update(value)
            elif key in SAMPLING_KEYS:
                out[key] = value
            elif _near_miss(key, SAMPLING_KEYS):
                raise self._unknown(path, key, SAMPLING_KEYS)
            else:
                if key in table.get("extra_body", {}) and table["extra_body"][key] != value:
                    raise self.fail(_join(path, key), f"conflicts with extra_body.{key}; set one of them")
                extra[key] = value
                self.passthrough.append(_join(path, key))
        if extra:
            out["extra_body"] = extra
        if "max_completion_tokens" in out:
            mct = out.pop("max_completion_tokens")
            if "max_tokens" in out and out["max_tokens"] != mct:
                raise self.fail(_join(path, "max_completion_tokens"),
                                f"conflicts with max_tokens ({mct} != {out['max_tokens']}); set one of them")
            out["max_tokens"] = mct
        for key in ("max_tokens", "min_tokens", "top_k"):
            if key in out and out[key] is not None:
                self.integer(out[key], _join(path, key), 1 if key == "max_tokens" else (-1 if key == "top_k" else 0))
        for key in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            if key in out and out[key] is not None:
                self.number(out[key], _join(path, key))
        if out.get("temperature") is not None and out["temperature"] < 0:
            raise self.fail(_join(path, "temperature"), f"must be >= 0, got {out['temperature']}")
        return out

    def sampling_of(self, parent: dict[str, Any], path: str) -> dict[str, Any]:
        """The ``sampling`` table of ``parent`` (at ``path``), compiled; {} when it has none."""
        return self.sampling(self.table(parent, "sampling", path) or {}, _join(path, "sampling"))

    # -- the file ------------------------------------------------------------------------------

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
        trainer, optimizer = self._trainer(data) if unified else ({}, OptimizerSpec())
        lora = self._lora(data) if unified else None
        objective = self._objective(data, self.targets[LEARNER].sampling.get("max_tokens")) if unified else DefaultLoss()
        server = self._server(data) if unified else {}

        try:
            return GenerationPlan(
                source=self.source, family=family, targets=self.targets, members=self.members,
                train_one=train_one, untrained_members=untrained, environments=environments,
                eval_environments=eval_environments, eval_interval=eval_interval,
                eval_skip_first_step=eval_skip_first_step, group_size=group_size, batch_size=batch_size,
                token_batch_size=token_batch_size, max_off_policy_steps=max_off, max_async_level=max_async,
                max_steps=max_steps, seq_len=seq_len, trainer=trainer, lora=lora, optimizer=optimizer, objective=objective, server=server, refused=self.refused,
                advantage=advantage, ignored_sections=self.ignored_sections, ignored_keys=self.ignored_keys,
                passthrough_sampling=self.passthrough, provenance={"family": model_path, **self.provenance})
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
            self.lenient(model, mpath, owned=MODEL_OWNED if scope is orch else {"name"})
            if "name" in model:
                return self.string(model["name"], _join(mpath, "name")), _join(mpath, "name")
        raise self.fail("model.name", "the learner model is not named (add [model] name = \"...\")")

    def _learner_sampling(self, orch: dict, op: str) -> dict[str, Any]:
        train = self.table(orch, "train", op)
        given = self.one_of((self.table(train, "sampling", _join(op, "train")) if train is not None else None,
                             _join(op, "train.sampling")),
                            (self.table(orch, "sampling", op), _join(op, "sampling")))
        return self.sampling(*given) if given else {}

    def _learner(self, orch: dict, op: str, family: str, sampling: dict[str, Any]) -> Target:
        model = self.table(orch, "model", op) or {}
        client, cpath = self.one_of((self.table(model, "client", _join(op, "model")), _join(op, "model.client")),
                                    (self.table(orch, "client", op), _join(op, "client"))) or ({}, _join(op, "client"))
        self.lenient(client, cpath, owned=CLIENT_OWNED)
        base_urls = (self.string_list(client["base_url"], _join(cpath, "base_url"), allow_single=True)
                     if "base_url" in client else [])
        api_key_var = self.string(client["api_key_var"], _join(cpath, "api_key_var")) if "api_key_var" in client else None
        return Target(name=LEARNER, model=family, base_urls=base_urls, api_key_var=api_key_var,
                      sampling=sampling, timeout_s=self._timeout(client, cpath))

    def _timeout(self, table: dict, path: str) -> float | None:
        if "timeout" not in table:
            return None
        t = table["timeout"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
            raise self.fail(_join(path, "timeout"), f"expected a positive number of seconds, got {t!r}")
        return float(t)

    # -- algorithms ----------------------------------------------------------------------------

    def _top_algorithm(self, orch: dict, op: str) -> AdvantageSpec:
        train = self.table(orch, "train", op)
        algo = self.one_of((self.table(orch, "algo", op), _join(op, "algo")),
                           (self.table(train, "algo", _join(op, "train")) if train is not None else None,
                            _join(op, "train.algo"))) or (None, _join(op, "algo"))
        adv = self.table(orch, "advantage", op), _join(op, "advantage")
        self.one_of(algo, adv, why=" ([algo] is prime-rl's algorithm, [advantage] names a credit strategy)")
        if algo[0] is not None:
            return self._algo(*algo)
        if adv[0] is not None:
            return self._advantage(*adv)
        return AdvantageSpec()

    def _algo(self, algo: dict, path: str) -> AdvantageSpec:
        """prime-rl's [algo]: a discriminated union on ``type``; each type's own keys, plus ``sampling``."""
        if "type" not in algo:
            raise self.fail(_join(path, "type"), f"the algorithm has no type (one of {', '.join(ALGORITHMS)})")
        kind = self.string(algo["type"], _join(path, "type"))
        params = {k: v for k, v in algo.items() if k != "type"}
        if kind not in ALGORITHMS:
            return self._unknown_type(kind, params, path, ALGORITHMS, "algorithm",
                                      f"algorithm {kind!r} is not one of prime-rl's ({', '.join(ALGORITHMS)}); "
                                      "nothing here runs it")
        self.strict(params, path, ALGORITHMS[kind] | {"sampling"})
        sampling = self.table(params, "sampling", path) or {}
        self.strict(sampling, _join(path, "sampling"), {"source"})
        source = sampling.get("source", "policy")
        if source != "policy" and kind != "sft":
            raise self.fail(_join(path, "sampling.source"), f"algorithm {kind!r} trains on the policy's own samples; "
                            "only sft samples from a frozen model (prime-rl refuses this too)")
        if kind == "sft" and source == "policy":
            raise self.fail(_join(path, "sampling.source"), "sft needs a frozen model to sample from "
                            "(sampling.source = { name = ..., base_url = ... })")
        if kind == "opd" and not (isinstance(params.get("teacher"), dict) and "name" in params["teacher"]
                                  and "base_url" in params["teacher"]):
            raise self.fail(_join(path, "teacher"), "opd needs a teacher = { name = ..., base_url = ... }")
        if kind == "hierarchical_grpo":
            self.string_list(params.get("episode_agents"), _join(path, "episode_agents"))
        if kind == "grpo":
            shaping = self._length_penalty(params.get("length_penalty"), _join(path, "length_penalty"))
            return AdvantageSpec(type=kind, params=params, origin=path, credit="grpo",
                                 credit_params={"scale_std": False, **shaping},
                                 note="prime-rl grpo, A = r - group mean: our grpo with scale_std = false"
                                      + (", rewards shaped by prime-rl's linear length penalty first" if shaping
                                         else ""))
        if kind == "max_rl":
            return AdvantageSpec(type=kind, params=params, origin=path, credit="grpo",
                                 credit_params={"scale_std": False, "scale_mean": True},
                                 note="prime-rl max_rl, A = (r - group mean) / group mean (0 where the mean is <= 0): "
                                      "our grpo with scale_mean = true")
        if kind == "rae":
            decay = self.number(params.get("decay", 0.95), _join(path, "decay"))
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
        return _cannot_run(kind, params, path, UNRUNNABLE[kind])

    def _length_penalty(self, table: Any, path: str) -> dict[str, Any]:
        """prime-rl's ``algo.length_penalty`` (``LinearLengthPenaltyConfig``, its defaults for what it leaves out) as
        the grpo strategy's ``length_penalty`` weights; {} when unset."""
        if table is None:
            return {}
        if not isinstance(table, dict):
            raise self.fail(path, f"expected a table, got {_kind(table)} {table!r}")
        self.strict(table, path, {"type", "num_output_tokens_weight", "num_input_tokens_weight", "num_turns_weight"})
        if table.get("type", "linear") != "linear":
            raise self.fail(_join(path, "type"), f"{table['type']!r}: prime-rl's length penalty is 'linear'")
        weights = {}
        for key, name, default in (("num_output_tokens_weight", "output", 0.25),
                                   ("num_input_tokens_weight", "input", 0.1), ("num_turns_weight", "turns", 0.1)):
            w = self.number(table.get(key, default), _join(path, key))
            if w < 0:
                raise self.fail(_join(path, key), f"must be >= 0, got {w:g}")
            weights[name] = w
        return {"length_penalty": weights}

    def _advantage(self, adv: dict, path: str) -> AdvantageSpec:
        """Our (and the multi-agent fork's) [advantage]: ``type`` names a credit strategy directly. Which
        strategies exist is the credit service's open registry (``consumers.credit``), checked where the
        plan is run (``consumers.settings``), not here."""
        kind = self.string(adv.get("type", "grpo"), _join(path, "type"))
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
        close = _near_miss(kind, known)
        if close:
            raise self.fail(_join(path, "type"), f"unknown {what} {kind!r} (did you mean {close[0]!r}?)")
        return _cannot_run(kind, params, path, note)

    # -- sources -------------------------------------------------------------------------------

    def _train_sources(self, orch: dict, op: str, family: str, top: AdvantageSpec) -> list[EnvSpec]:
        train = self.table(orch, "train", op)
        tpath = _join(op, "train")
        forms: list[tuple[str, Any]] = []
        if train is not None:
            self.lenient(train, tpath, owned=TRAIN_OWNED)
            for key in ("source", "env"):
                if key in train:
                    forms.append((_join(tpath, key), train[key]))
        for key in ("env", "environment"):
            if key in orch:
                forms.append((_join(op, key), orch[key]))
        if not forms:
            only_eval = isinstance(orch.get("eval"), dict)
            raise self.fail(_join(tpath, "source"), "no training source: add [[orchestrator.train.source]] with "
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
            envs.append(env.model_copy(update={"algorithm": self._algo(algo, _join(p, "algo")) if algo else top,
                                               "options": {**shared, **env.options},
                                               "gates": env.gates or shared_gates}))
        return envs

    def _eval_sources(self, orch: dict, op: str, family: str) -> list[EnvSpec]:
        ev = self.table(orch, "eval", op)
        if ev is None:
            return []
        epath = _join(op, "eval")
        self.lenient(ev, epath, owned=EVAL_OWNED)
        forms = [(_join(epath, k), ev[k]) for k in ("source", "env") if k in ev]
        if not forms:
            # the cadence alone is the training sources' held-out sets' (rollout-log's own; prime-rl refuses an
            # [eval] block without a source)
            for_sources = sorted((EVAL_OWNED - EVAL_CADENCE) & ev.keys())
            if not for_sources:
                return []
            raise self.fail(_join(epath, "source"), f"[{epath}] sets {', '.join(for_sources)} for evaluation "
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
                self.integer(options["interval"], _join(path, "interval"), 1)
            envs.append(env.model_copy(update={"sampling": {**group_sampling, **env.sampling}, "options": options}))
        return envs

    def _eval_cadence(self, orch: dict, op: str) -> tuple[int, bool]:
        """(interval, skip_first_step) of ``[eval]``: when the training sources' held-out sets are answered, and the
        evaluation sources that set no cadence of their own. Without the block: every revision."""
        ev = self.table(orch, "eval", op)
        if ev is None:
            self.provenance["eval_interval"] = "default (no [eval]: every revision)"
            return 1, False
        epath = _join(op, "eval")
        self.provenance["eval_interval"] = _join(epath, "interval") if "interval" in ev else "default (prime-rl's)"
        interval = self.integer(ev.get("interval", DEFAULT_EVAL_INTERVAL), _join(epath, "interval"), 1)
        return interval, self._bool(ev.get("skip_first_step", False), _join(epath, "skip_first_step"))

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
            raise self.fail(_join(path, "env"), 'no env configured: set env = { taskset = { id = "<id>" } }')
        envp = _join(path, "env")
        taskset = self.table(env, "taskset", envp) or {}
        env_id = env.get("id") or ""
        task_id = taskset.get("id") or ""
        if env_id:
            self.string(env_id, _join(envp, "id"))
        if task_id:
            self.string(task_id, _join(envp, "taskset.id"))
        if not (env_id or task_id):
            raise self.fail(_join(envp, "taskset.id"), 'no env configured: set env = { taskset = { id = "<id>" } }')
        full_id = f"{env_id}+{task_id}" if env_id and task_id else task_id or env_id  # verifiers' env_id
        name = self.string(src["name"], _join(path, "name")) if "name" in src else None
        options: dict[str, Any] = {"weight": self.number(src.get("ratio", 1.0), _join(path, "ratio"))}
        if options["weight"] <= 0:
            raise self.fail(_join(path, "ratio"), f"must be > 0, got {src['ratio']}")
        for key in ("group_size", "num_examples", "interval"):
            if key in src:
                options[key] = self.integer(src[key], _join(path, key), -1 if key == "num_examples" else 1)
        if "serve" in src:
            options["serve"] = src["serve"]
        if "select" in src:
            options["select"] = self.table(src, "select", path)
        if "skip_first_step" in src:
            options["skip_first_step"] = self._bool(src["skip_first_step"], _join(path, "skip_first_step"))
        gates = self._sampling_policy(src, path)
        knobs: dict[str, Any] = {}
        seats: dict[str, Seat] = {}
        for key, value in env.items():
            if key in ("id", "taskset"):
                continue
            if key == "harness":
                raise self.fail(_join(envp, key), "a harness belongs to a seat: [...env.agent.harness] on a "
                                "single-agent env, [...env.<seat>.harness] on a multi-agent one (verifiers refuses "
                                "it too)")
            if key not in ENV_BASE_KEYS and isinstance(value, dict) and (not value or AGENT_KEYS & value.keys()):
                seats[key] = self._seat(key, value, _join(envp, key), family)
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
                self.refused.append(f"{_join(path, key)}: task sampler {kind!r}: only prime-rl's standard sampler "
                                    "runs here")
        extra = sorted(set(cur) - {"sampler", "gates"})
        if extra:
            self.refused.append(f"{_join(path, 'curriculum')}: keys {extra}: not applied by rollout-log")
        gpath = _join(path, "curriculum.gates")
        gates = self.table(cur, "gates", _join(path, "curriculum")) or {}
        out = []
        for name, gate in gates.items():
            gp = _join(gpath, name)
            if not isinstance(gate, dict):
                raise self.fail(gp, f"expected a table, got {_kind(gate)} {gate!r}")
            kind = gate.get("type", "advantage_range")
            if kind != "advantage_range":
                self.refused.append(f"{gp}: admission gate type {kind!r}: only prime-rl's advantage_range runs here")
                continue
            unknown = sorted(set(gate) - {"type", "reject_min", "reject_max"})
            if unknown:
                raise self.fail(gp, f"unknown keys {unknown} (an advantage_range gate has reject_min, reject_max)")
            bounds = {k: self.number(gate[k], _join(gp, k)) for k in ("reject_min", "reject_max") if k in gate}
            try:
                out.append(AdmissionGate(name=name, **bounds))
            except ValidationError as e:
                raise self.fail(gp, e.errors()[0]["msg"].removeprefix("Value error, ")) from None
        return out

    def _bool(self, value: Any, field: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(field, f"expected true or false, got {_kind(value)} {value!r}")
        return value

    def _seat(self, seat: str, spec: dict, path: str, family: str) -> Seat:
        """A verifiers AgentConfig: unpinned (or pinned to the learner's model) it is the learner, trainable;
        pinned to another model or its own endpoint it is a fixed target."""
        self.lenient(spec, path, owned=AGENT_KEYS)
        sampling = self.sampling_of(spec, path)
        options = {k: v for k, v in spec.items() if k in AGENT_KEYS - {"model", "client", "sampling"}}
        model = self.string(spec["model"], _join(path, "model")) if "model" in spec else None
        client = self.table(spec, "client", path)
        if (model is None or model == family) and client is None:
            self._route_seat(seat, LEARNER, path)
            return Seat(target=LEARNER, trainable=True, sampling=sampling, options=options)
        client = client or {}
        self.lenient(client, _join(path, "client"), owned=SEAT_CLIENT_KEYS)
        target = Target(name=seat, model=model or family,
                        base_urls=[self.string(client["base_url"], _join(path, "client.base_url"))]
                        if "base_url" in client else [],
                        api_key_var=self.string(client["api_key_var"], _join(path, "client.api_key_var"))
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
            raise self.fail(_join(path, "id"), "the environment has no id (nor taskset.id)")
        self.string(env_id, _join(path, "id"))
        name = self.string(env["name"], _join(path, "name")) if "name" in env else None
        args = env.get("args", {})
        if not isinstance(args, dict):
            raise self.fail(_join(path, "args"), f"expected a table, got {_kind(args)}")
        options: dict[str, Any] = {k: v for k, v in env.items() if k in ENV_PASSED}
        if env.get("ratio") is not None:
            options["weight"] = self.number(env["ratio"], _join(path, "ratio"))
        return EnvSpec(id=env_id, name=name, args=args, evaluation=evaluation, options=options,
                       sampling=self.sampling_of(env, path))

    # -- scalars -------------------------------------------------------------------------------

    def _batching(self, orch: dict, op: str) -> tuple[int, int | None]:
        tokens = self.integer(orch["token_batch_size"], _join(op, "token_batch_size"), 1) \
            if "token_batch_size" in orch else None
        if tokens is not None and "batch_size" in orch:
            raise self.fail(_join(op, "token_batch_size"), "set exactly one of batch_size or token_batch_size")
        if tokens is not None:
            self.provenance["batch_size"] = f"default ({_join(op, 'token_batch_size')} batches by tokens)"
            return DEFAULT_BATCH_SIZE, tokens
        if "batch_size" in orch:
            self.provenance["batch_size"] = _join(op, "batch_size")
            return self.integer(orch["batch_size"], _join(op, "batch_size"), 1), None
        self.provenance["batch_size"] = "default"
        return DEFAULT_BATCH_SIZE, None

    def _group_size(self, orch: dict, op: str) -> int:
        """prime-rl's older ``group_size`` (or ``rollouts_per_example``) of the orchestrator, or the newer
        ``[orchestrator.train] group_size``: both accepted, the one written applied, two that differ refused."""
        train = orch.get("train") if isinstance(orch.get("train"), dict) else {}
        scopes = [(train, _join(op, "train"), "group_size")] + [(orch, op, k) for k in ("group_size",
                                                                                   "rollouts_per_example")]
        given = {_join(p, k): self.integer(t[k], _join(p, k), 1) for t, p, k in scopes if k in t}
        if len(set(given.values())) > 1:
            raise self.fail(next(iter(given)), f"group sizes conflict ({given}); set one")
        for key, value in given.items():
            self.provenance["group_size"] = key
            return value
        self.provenance["group_size"] = "default"
        return DEFAULT_GROUP_SIZE

    def _run_length(self, data: dict, orch: dict, op: str, unified: bool) -> tuple[int | None, int | None]:
        """``max_steps`` (trained revisions; top level of an rl file or the orchestrator's) and ``seq_len``."""
        out: list[int | None] = []
        for key in ("max_steps", "seq_len"):
            scopes = [(orch, op)] + ([(data, "")] if unified else [])
            found = [(s[key], _join(p, key)) for s, p in scopes if s.get(key) is not None]
            if len({v for v, _ in found}) > 1:
                raise self.fail(found[1][1], f"conflicts with {found[0][1]} ({found[1][0]} != {found[0][0]}); set one")
            out.append(self.integer(found[0][0], found[0][1], 1) if found else None)
            self.provenance[key] = found[0][1] if found else "default"
        return out[0], out[1]

    def _server(self, data: dict) -> dict[str, Any]:
        """``SERVER_KEYS`` of prime-rl's ``[inference.vllm]`` (``[inference.model]`` in older recipes): what the
        vLLM a run starts is told. The rest of ``[inference]`` is where prime-rl's servers run (neutral)."""
        inference = self.table(data, "inference", "") or {}
        out: dict[str, Any] = {}
        if "inference" in data and not inference:  # an empty table: shown as not applied, as before it was read
            self.ignore("inference", inference)
        for part, value in inference.items():
            if part not in ("vllm", "model") or not isinstance(value, dict):
                self.ignore(f"inference.{part}", value)
                continue
            table = self.table(inference, part, "inference") or {}
            for key in table.keys() - SERVER_KEYS:
                self.ignore(f"inference.{part}.{key}", table[key])
            for key in SERVER_KEYS & table.keys():
                path = f"inference.{part}.{key}"
                if key in out and out[key] != table[key]:
                    raise self.fail(path, f"conflicts with the other [inference] table's {key} ({table[key]!r} != "
                                          f"{out[key]!r}); set one")
                out[key] = self.integer(table[key], path, 1) if key == "max_model_len" else table[key]
                self.provenance[f"server.{key}"] = path
        return out

    def _trainer(self, data: dict) -> tuple[dict[str, Any], OptimizerSpec]:
        """The reference trainer's lr and weight_decay, and its optimizer, from ``[trainer.optim]`` (prime-rl's
        defaults for what it leaves out: AdamW's betas 0.9/0.999, Muon's 0.9/0.95 and mu 0.95); every other trainer
        key is judged by ``schemas.recipe_keys`` (neutral, or refused)."""
        trainer = self.table(data, "trainer", "")
        if trainer is None:
            return {}, OptimizerSpec()
        optim = self.table(trainer, "optim", "trainer") or {}
        kind = optim.get("type", "adamw")
        if kind not in OPTIMIZERS:
            self.refused.append(f"trainer.optim.type: optimizer {kind!r}: the reference trainer runs "
                                f"{', '.join(OPTIMIZERS)}")
            kind = "adamw"
        out = {k: self.number(optim[k], _join("trainer.optim", k)) for k in ("lr", "weight_decay") if k in optim}
        for k, v in out.items():
            self.provenance[f"trainer.{k}"] = f"trainer.optim.{k}"
        spec: dict[str, Any] = {"type": kind}
        if kind != "sign_sgd":
            default = (0.9, 0.95) if kind == "muon" else (0.9, 0.999)
            spec["betas"] = tuple(self.number(optim[k], _join("trainer.optim", k)) if k in optim else d
                                  for k, d in zip(("betas1", "betas2"), default))
        if kind == "muon" and "mu" in optim:
            spec["momentum"] = self.number(optim["mu"], "trainer.optim.mu")
        if "max_norm" in optim:
            spec["max_norm"] = None if optim["max_norm"] is None else self.number(optim["max_norm"],
                                                                                  "trainer.optim.max_norm")
        for k in ("type", "betas1", "betas2", "mu", "max_norm"):
            if k in optim:
                self.provenance[f"trainer.optim.{k}"] = f"trainer.optim.{k}"
        self.ignore("trainer", {k: v for k, v in trainer.items()})
        try:
            return out, OptimizerSpec(**spec)
        except ValidationError as exc:
            raise self.fail("trainer.optim", exc.errors(include_url=False)[0]["msg"]) from None

    def _objective(self, data: dict, max_tokens: Any) -> Any:
        """``[trainer.loss]``: prime-rl's tagged union (``default``, ``ipo``, ``custom``) and ours (``trl``,
        ``ppo_clip``, ``ce``), each with its own keys and defaults (``schemas.objectives``); prime-rl's default
        when the table is absent. TRL's ``dr_grpo`` constant defaults to the learner's max_tokens."""
        trainer = self.table(data, "trainer", "") or {}
        loss = self.table(trainer, "loss", "trainer")
        if loss is None:
            return DefaultLoss()
        kind = loss.get("type", "default")
        if kind not in OBJECTIVE_TYPES:
            close = _near_miss(str(kind), OBJECTIVE_TYPES)
            hint = f"did you mean {close[0]!r}?" if close else f"one of {', '.join(OBJECTIVE_TYPES)}"
            raise self.fail("trainer.loss.type", f"unknown loss type {kind!r} ({hint})")
        if kind == "trl" and loss.get("loss_type") == "dr_grpo" and "max_completion_length" not in loss \
                and max_tokens:
            loss = {**loss, "max_completion_length": max_tokens}
        try:
            spec = objective_from(loss)
        except ValidationError as exc:
            e = exc.errors(include_url=False)[0]
            where = ".".join(str(x) for x in e["loc"][1:] if not isinstance(x, int)) or "type"
            raise self.fail(_join("trainer.loss", where), e["msg"]) from None
        for k in loss:
            self.provenance[f"objective.{k}"] = f"trainer.loss.{k}"
        return spec

    def _lora(self, data: dict) -> LoraSpec | None:
        """``[trainer.model.lora]`` (prime-rl's defaults for what it leaves out), with ``[orchestrator.model.lora]``'s
        rank and alpha over it where set, and its name (the adapter's in vLLM; prime-rl's default otherwise)."""
        table = ((data.get("trainer") or {}).get("model") or {}).get("lora")
        run = ((data.get("orchestrator") or {}).get("model") or {}).get("lora")
        if table is None:
            if run:
                raise self.fail("orchestrator.model.lora", "a LoRA adapter as the policy needs [trainer.model.lora] "
                                                           "(the adapter's rank, alpha and target modules)")
            return None
        if not isinstance(table, dict) or (run is not None and not isinstance(run, dict)):
            raise self.fail("trainer.model.lora", "must be a table")
        fields = {k: table[k] for k in ("rank", "alpha", "dropout", "target_modules") if k in table}
        fields.update({k: run[k] for k in ("rank", "alpha", "name") if run and run.get(k) is not None})
        try:
            spec = LoraSpec(**fields)
        except ValueError as e:
            raise self.fail("trainer.model.lora", str(e).splitlines()[-1] if str(e) else "invalid") from None
        for k in fields:
            self.provenance[f"lora.{k}"] = f"orchestrator.model.lora.{k}" if run and k in run else \
                f"trainer.model.lora.{k}"
        return spec

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

    def _multi_agent(self, orch: dict, op: str) -> tuple[TrainOne | None, list[str]]:
        """The fork's [multi_agent]: fixed targets and their members, train_one, drop_judge; our routes."""
        targets, members = self.targets, self.members
        ma = self.table(orch, "multi_agent", op)
        if ma is None:
            return None, []
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
            if name in targets:
                raise self.fail(fpath, f"a seat pinned in {self.seat_origin.get(name, '?')} is already the target {name!r}")
            self.strict(spec, fpath, FIXED_KEYS)
            if "model" not in spec:
                raise self.fail(_join(fpath, "model"), f"fixed target {name!r} has no model")
            targets[name] = Target(
                name=name, model=self.string(spec["model"], _join(fpath, "model")),
                base_urls=(self.string_list(spec["base_url"], _join(fpath, "base_url"), allow_single=True)
                           if "base_url" in spec else []),
                api_key_var=(self.string(spec["api_key_var"], _join(fpath, "api_key_var"))
                             if "api_key_var" in spec else None),
                sampling=self.sampling_of(spec, fpath),
                request_mode=self.string(spec.get("request_mode", "chat"), _join(fpath, "request_mode")),
                timeout_s=self._timeout(spec, fpath))
            for member in self.string_list(spec.get("members", []), _join(fpath, "members")):
                if member in members and member not in static_owner:
                    raise self.fail(_join(fpath, "members"), f"member {member!r} is a seat pinned to "
                                    f"{members[member].target!r} in {self.seat_origin[member]}")
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
            if "unselected" not in t1:
                raise self.fail(_join(tpath, "unselected"), "train_one needs the fixed target of the unselected seat")
            train_one = TrainOne(members=self.string_list(t1["members"], _join(tpath, "members")),
                                 unselected=self.string(t1["unselected"], _join(tpath, "unselected")))
            problem = train_one.problem(targets, members)
            if problem is not None:
                raise self.fail(_join(tpath, problem[0]), problem[1])

        untrained: list[str] = []
        drop = ma.get("drop_judge", False)
        if not isinstance(drop, bool):
            raise self.fail(_join(mpath, "drop_judge"), f"expected true or false, got {drop!r}")
        if drop and "judge" not in members and not (train_one and "judge" in train_one.members):
            untrained.append("judge")
        return train_one, untrained


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


def _cannot_run(kind: str, params: dict[str, Any], origin: str, note: str) -> AdvantageSpec:
    """An algorithm the plan shows but nothing here runs: no credit strategy; the services refuse it."""
    return AdvantageSpec(type=kind, params=params, origin=origin, credit=None, credit_params={}, note=note)


def _near_miss(key: str, known: Iterable[str]) -> list[str]:
    """The known key ``key`` is a typo of, if any: one edit or transposition (two for keys of 8+
    characters); for 4-character keys a transposition only, as real neighbours differ by one letter
    there (the fork's ``val`` next to ``eval``)."""
    for k in sorted(known):
        if k == key or len(k) < 4:
            continue
        n = _edits(key, k)
        if (len(k) == 4 and n == 1 and sorted(k) == sorted(key)) or (len(k) > 4 and n <= (2 if len(k) >= 8 else 1)):
            return [k]
    return []


def _edits(a: str, b: str) -> int:
    """Damerau-Levenshtein distance (optimal string alignment)."""
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            cost = a[i - 1] != b[j - 1]
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[len(a)][len(b)]


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


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _is_table_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _kind(value: Any) -> str:
    return {dict: "a table", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
            float: "a float"}.get(type(value), type(value).__name__)
