"""A plan's verifiers source -> an arena ``Environment``, through verifiers' own loader.

    env = load_source(spec)   # spec: a schemas.plan.EnvSpec of [[orchestrator.train.source]] / [[...eval.source]]

A prime-rl recipe names its environment the way verifiers does: ``env.taskset.id`` (+ the taskset's args), an
optional env ``id``, one table per agent seat. That table, as written, goes to
``verifiers.v1.utils.loaders.resolve_env_config`` (verifiers' one entry for its CLI, TOML files and env server):
it imports the installed package by id (``my-env`` -> module ``my_env``; a hub id ``owner/name@version`` imports
``name``), narrows the config to the package's own ``EnvConfig`` and types every seat. ``load_environment``
then builds the Env, and ``producers.verifiers_v1`` runs it as arena episodes.

Harnesses (who plays a seat), decided at start-up, per seat:

* every seat's calls go to the capture endpoint, routed by the plan: a seat's own ``model``/``client`` (a fixed
  target in the plan) is taken off verifiers' config, so verifiers never calls an endpoint directly;
* ``null`` (verifiers' tool-less chat program) runs in-process through the capture harness
  (``producers.verifiers_v1.CHAT_HARNESS_ID``): no ``uv``, no runtime, no tunnel or login. Its runtime, as the
  recipe writes it, is not used (nothing is launched). A taskset that gives its agents tools is the exception:
  the in-process harness has no tools, so such a seat needs the real program (below);
* any other harness runs as verifiers runs it, in the local ``subprocess`` runtime, when that harness can run
  here: verifiers' bundled programs need ``uv`` on PATH. A remote runtime (prime, modal, e2b, docker images
  from a registry) is refused, naming the seat, the harness and the runtime.

Every failure is one ``EnvironmentUnavailable`` line: the id no installed package provides (and how to
install it), a harness that cannot run, a taskset that raises while loading (a hub dataset that cannot be
reached included), an endless evaluation source without a bound.
"""

from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import os
import shutil
from typing import Any

from producers.environment_types import Environment, EnvironmentUnavailable
from producers.verifiers_v1 import CHAT_HARNESS_ID, register_chat_harness, verifiers_v1_environment

# verifiers' tool-less chat harnesses: run in-process by the capture harness
IN_PROCESS_HARNESSES = frozenset({"null", CHAT_HARNESS_ID})
LOCAL_RUNTIME = "subprocess"


def _what(spec: Any) -> str:
    return f"{'evaluation' if spec.evaluation else 'training'} source {spec.display_name!r}"


def _module_of(plugin_id: str) -> str:
    """verifiers' own id -> module rule (``loaders._import_plugin``): hub owner and version dropped, ``-`` to
    ``_``, lower case."""
    return plugin_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()


def _installed_module(plugin_id: str, group: str) -> str | None:
    """The module verifiers would import for ``plugin_id`` (its own group first), or None when none is installed."""
    module = _module_of(plugin_id)
    for name in (f"{group}.{module}", module):
        try:
            if importlib.util.find_spec(name) is not None:
                return name
        except ModuleNotFoundError:
            continue
    return None


def _install_hint(plugin_id: str) -> str:
    name = plugin_id.rsplit("/", 1)[-1].split("@", 1)[0]
    if "/" in plugin_id:
        return f"install it into this environment (prime env install {plugin_id}, or pip install {name})"
    return f"install the package that provides it into this environment (e.g. pip install {name})"


def _require_installed(table: dict[str, Any], what: str) -> None:
    taskset = table.get("taskset") if isinstance(table.get("taskset"), dict) else {}
    for plugin_id, kind, group in ((taskset.get("id"), "taskset", "verifiers.v1.tasksets"),
                                   (table.get("id"), "environment", "verifiers.v1.envs")):
        if plugin_id and _installed_module(plugin_id, group) is None:
            raise EnvironmentUnavailable(
                f"{what}: no installed package provides the verifiers {kind} id {plugin_id!r} (module "
                f"{_module_of(plugin_id)}); {_install_hint(plugin_id)}")


def env_table(spec: Any) -> dict[str, Any]:
    """The verifiers env table of a source: as written in ``[[...source]] env``, or built from the older
    ``[[...env]]`` form (``id`` + ``args`` as the taskset, its ``harness = {id, runtime}`` as the one seat's)."""
    if spec.env_table is not None:
        return copy.deepcopy(spec.env_table)
    table: dict[str, Any] = {"taskset": {"id": spec.id, **dict(spec.args or {})}}
    harness = spec.options.get("harness")
    if isinstance(harness, dict):
        harness = dict(harness)
        runtime = harness.pop("runtime", None)
        table["agent"] = {"harness": harness, **({"runtime": runtime} if runtime is not None else {})}
    return table


def _import_failure(table: dict[str, Any]) -> str | None:
    """Why an installed env package does not import (verifiers reports any failed import as "not found")."""
    taskset = table.get("taskset") if isinstance(table.get("taskset"), dict) else {}
    for plugin_id, group in ((taskset.get("id"), "verifiers.v1.tasksets"), (table.get("id"), "verifiers.v1.envs")):
        name = _installed_module(plugin_id, group) if plugin_id else None
        if name is None:
            continue
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - the package's own import error, one line
            return (f"the package for {plugin_id!r} is installed (module {name}) but importing it fails: "
                    f"{_one_line(e)}; it may be written for another verifiers version (this is 0.4.0, "
                    "verifiers.v1) or miss a dependency")
    return None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:600]}"


def _seat_harnesses(config: Any, what: str) -> Any:
    """The config with each seat's harness decided (see the module docstring), or EnvironmentUnavailable."""
    from verifiers.v1 import SubprocessConfig
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.utils.loaders import builtin_harness_ids, taskset_class

    register_chat_harness()
    ts_cls = taskset_class(config.taskset.id)
    tools = bool(ts_cls.toolsets(config.taskset)) or bool(ts_cls.task_type().toolsets(config.taskset.task))
    defaults = config.agent_harnesses()
    in_process = _harness_classes_config()
    update: dict[str, Any] = {}
    for seat, agent in agent_config_fields(config).items():
        # the plan routes every seat (a pinned model/client is a fixed target there): verifiers must send each
        # call to the capture endpoint, never straight to the seat's own client, or the call is not a Step
        agent = update[seat] = agent.model_copy(update={"model": None, "client": None})
        harness = defaults[seat]
        runtime = getattr(agent.runtime, "type", type(agent.runtime).__name__)
        if harness.id in IN_PROCESS_HARNESSES and not tools:
            update[seat] = agent.model_copy(update={"harness": in_process, "runtime": SubprocessConfig()})
            continue
        why = None
        if runtime != LOCAL_RUNTIME:
            why = (f"its runtime {runtime!r} is not available here (only the local {LOCAL_RUNTIME!r} runtime "
                   "runs: no remote sandbox, login or registry can be reached)")
        elif harness.id in builtin_harness_ids() and shutil.which("uv") is None:
            why = "verifiers runs that harness as a program under uv, and uv is not installed here"
        if why:
            tool_note = " (the taskset gives its agents tools, so the tool-less in-process chat harness cannot " \
                        "stand in for it)" if harness.id in IN_PROCESS_HARNESSES else ""
            raise EnvironmentUnavailable(
                f"{what}: seat {seat!r} uses harness {harness.id!r}, which cannot run here: {why}{tool_note}. "
                f"Harnesses that run here: {', '.join(sorted(IN_PROCESS_HARNESSES - {CHAT_HARNESS_ID}))} "
                "(tool-less chat, in-process); others in runtime 'subprocess' with uv installed")
    return config.model_copy(update=update)


def _harness_classes_config() -> Any:
    from verifiers.v1.utils.loaders import harness_config_type

    return harness_config_type(CHAT_HARNESS_ID).model_validate({"id": CHAT_HARNESS_ID})


def _version(module: str) -> str:
    """The installed distribution's version for the env's module (a package found by id), else verifiers'."""
    dists = importlib.metadata.packages_distributions().get(module.split(".")[0]) or []
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    from verifiers import __version__

    return f"verifiers-{__version__}"


def _select(taskset: Any, options: dict[str, Any], what: str, *, evaluation: bool) -> Any:
    """The source's tasks: verifiers' own ``select`` view (``select = {...}``), then ``num_examples`` (-1: all)."""
    from verifiers.v1 import SelectConfig

    view = taskset
    if options.get("select"):
        try:
            view = view.select(SelectConfig.model_validate(options["select"]))
        except Exception as e:  # noqa: BLE001 - verifiers' own message, one line
            raise EnvironmentUnavailable(f"{what}: select: {_one_line(e)}") from None
    n = options.get("num_examples", -1)
    if isinstance(n, int) and n > 0:
        view = view.take(n)
    if evaluation and not view.bounded:
        raise EnvironmentUnavailable(f"{what}: its taskset never ends; an evaluation source needs a bound "
                                     "(num_examples, or select.limit)")
    return view


def load_source(spec: Any, *, buffer: int = 256) -> Environment:
    """One plan source as an arena Environment (an evaluation source's tasks are all held out). Draws are seeded
    by the arena's rng (``TaskStream.sample``); a taskset's own seed is its config's."""
    what = _what(spec)
    if importlib.util.find_spec("verifiers") is None:
        raise EnvironmentUnavailable(f"{what}: {spec.id!r} is a verifiers environment id and verifiers is not "
                                     "installed: pip install 'rollout-log[verifiers]'")
    # no model hub can be reached from here: datasets libraries fail at once, naming the dataset
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    table = env_table(spec)
    _require_installed(table, what)
    from verifiers.v1.utils.loaders import load_environment, resolve_env_config

    try:
        config = resolve_env_config(table)
    except Exception as e:  # noqa: BLE001 - a bad table or a package that fails to import: one line
        why = _import_failure(table) or f"verifiers could not resolve its env table: {_one_line(e)}"
        raise EnvironmentUnavailable(f"{what}: {why}") from None
    config = _seat_harnesses(config, what)
    try:
        vf_env = load_environment(config)
    except Exception as e:  # noqa: BLE001 - the taskset's own constructor (its data, a dataset download)
        raise EnvironmentUnavailable(f"{what}: taskset {config.taskset.id!r} failed while loading: "
                                     f"{_one_line(e)}") from None
    tasks = _select(vf_env.taskset, spec.options, what, evaluation=spec.evaluation)
    try:
        env = verifiers_v1_environment(vf_env, name=spec.display_name, version=_version(_module_of(config.taskset.id)),
                                       model=spec.id, tasks=tasks, buffer=buffer)
    except EnvironmentUnavailable:
        raise
    except Exception as e:  # noqa: BLE001 - the taskset's load() raised while its first tasks were read
        raise EnvironmentUnavailable(f"{what}: taskset {config.taskset.id!r} failed while loading its tasks: "
                                     f"{_one_line(e)}") from None
    seat_sampling = {env.episode.seat_member.get(s, s): dict(seat.sampling)
                     for s, seat in spec.seats.items() if seat.sampling}
    if seat_sampling:
        env.episode.sampling = seat_sampling
    if spec.sampling:
        env.sampling = dict(spec.sampling)
    return env
