"""A plan's verifiers source -> an arena ``Environment``, through verifiers' own loader.

    env = load_source(spec)   # spec: a schemas.plan.EnvSpec of [[orchestrator.train.source]] / [[...eval.source]]

A prime-rl recipe names its environment the way verifiers does: ``env.taskset.id`` (+ the taskset's args), an
optional env ``id``, one table per agent seat. That table, as written, goes to
``verifiers.v1.utils.loaders.resolve_env_config`` (verifiers' one entry for its CLI, TOML files and env server):
it imports the installed package by id (``my-env`` -> module ``my_env``; a hub id ``owner/name@version`` imports
``name``), narrows the config to the package's own ``EnvConfig`` and types every seat. ``load_environment``
then builds the Env, and ``producers.environments.verifiers_v1`` runs it as arena episodes.

Harnesses (who plays a seat), decided at start-up, per seat:

* every seat's calls go to the capture endpoint, routed by the plan: a seat's own ``model``/``client`` (a fixed
  target in the plan) is taken off verifiers' config, so verifiers never calls an endpoint directly;
* ``null`` (verifiers' tool-less chat program) runs in-process through the capture harness
  (``producers.environments.verifiers_v1.CHAT_HARNESS_ID``): no ``uv``, no runtime, no tunnel or login. Its runtime, as the
  recipe writes it, is not used (nothing is launched). A taskset that gives its agents tools is the exception:
  the in-process harness has no tools, so such a seat needs the real program (below);
* any other harness runs as verifiers runs it, in the local ``subprocess`` runtime, when that harness can run
  here: verifiers' bundled programs need ``uv`` on PATH;
* or in verifiers' ``docker`` runtime (``runtime = {type = "docker", image = ...}``), for the harnesses whose
  program is verifiers' chat program (``null`` with tools, ``bash``), when the ``docker`` CLI answers and the
  seat's image is in the local engine (no registry can be reached). verifiers' default image
  (``python:3.11-slim``) is replaced by ``HARNESS_IMAGE``, built locally by ``harness-image/build-image.sh``
  (python3, uv, the chat program's dependencies locked and synced: an episode needs no package index), with a
  log line (the image's label names the chat program it carries: one of another verifiers is refused, to be
  rebuilt); another image must have python3 (verifiers runs it in the image to reach the host). Refused in
  ``docker``: a restricted network policy (``allow``/``block``: verifiers builds its firewall helper FROM
  alpine on Docker Hub), and the other built-in harnesses (codex, claude_code, ...: they install their agent
  into the container at setup). A task's own image or network policy (``TaskData``) is applied by verifiers per
  episode: an image that is not here fails that rollout with docker's reason.

Every other runtime (prime, modal, e2b, podman, apptainer) is refused. A refusal is one line naming the seat,
the harness and the runtime (and the image, for ``docker``).

Every failure is one ``EnvironmentUnavailable`` line: the id no installed package provides (and how to
install it), a harness that cannot run, a taskset that raises while loading (a hub dataset that cannot be
reached included), an endless evaluation source without a bound.
"""

from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import subprocess
from typing import Any

from producers.environments.types import Environment, EnvironmentUnavailable
from producers.environments.verifiers_v1 import CHAT_HARNESS_ID, register_chat_harness, verifiers_v1_environment

# verifiers' tool-less chat harnesses: run in-process by the capture harness
IN_PROCESS_HARNESSES = frozenset({"null", CHAT_HARNESS_ID})
LOCAL_RUNTIME = "subprocess"
DOCKER_RUNTIME = "docker"
# verifiers' harnesses whose program is its bundled chat program, which HARNESS_IMAGE carries ready to run
DOCKER_HARNESSES = frozenset({"null", "bash"})
# built by harness-image/build-image.sh (.ci/setup runs it), from the project's own base image
HARNESS_IMAGE = "rollout-log/vf-harness:local"
BUILD_HARNESS_IMAGE = "bash harness-image/build-image.sh"
# what verifiers' docker runtime runs its host-callback helper in when the seat's image has no python3
PROXY_FALLBACK_IMAGE = "docker.io/library/python:3.11-alpine"

log = logging.getLogger("rollout.verifiers")


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
    images: dict[str, str | None] = {}  # image -> why it cannot run (None: it can), asked once per image
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
        why, where = None, f"runtime {runtime!r}"
        if runtime == DOCKER_RUNTIME:
            image = _docker_image(agent.runtime)
            why = _docker_refusal(agent.runtime, image, harness.id, builtin_harness_ids(), images)
            if why is None:
                if image != agent.runtime.image:
                    log.warning("%s: seat %r: runtime 'docker' runs %r in place of verifiers' default image %r "
                                "(built locally: %s; no registry can be reached)", what, seat, image,
                                agent.runtime.image, BUILD_HARNESS_IMAGE)
                    update[seat] = agent.model_copy(
                        update={"runtime": agent.runtime.model_copy(update={"image": image})})
                continue
            where = f"runtime {runtime!r} (image {image!r})"
        elif runtime != LOCAL_RUNTIME:
            why = (f"its runtime {runtime!r} is not available here (only the local {LOCAL_RUNTIME!r} and "
                   f"{DOCKER_RUNTIME!r} runtimes run: no remote sandbox, login or registry can be reached)")
        elif harness.id in builtin_harness_ids() and shutil.which("uv") is None:
            why = "verifiers runs that harness as a program under uv, and uv is not installed here"
        if why:
            tool_note = " (the taskset gives its agents tools, so the tool-less in-process chat harness cannot " \
                        "stand in for it)" if harness.id in IN_PROCESS_HARNESSES else ""
            raise EnvironmentUnavailable(
                f"{what}: seat {seat!r} uses harness {harness.id!r} in {where}, which cannot run here: {why}"
                f"{tool_note}. Harnesses that run here: "
                f"{', '.join(sorted(IN_PROCESS_HARNESSES - {CHAT_HARNESS_ID}))} (tool-less chat, in-process); "
                f"others in runtime {LOCAL_RUNTIME!r} with uv installed; bash, and null with tools, in runtime "
                f"{DOCKER_RUNTIME!r} with its image in the local Docker engine")
    return config.model_copy(update=update)


def _docker_image(runtime: Any) -> str:
    """The image a docker seat runs in: as written, or ``HARNESS_IMAGE`` in place of verifiers' default."""
    from verifiers.v1.runtimes import DockerConfig

    return HARNESS_IMAGE if runtime.image == DockerConfig.model_fields["image"].default else runtime.image


def _docker_refusal(runtime: Any, image: str, harness_id: str, builtin: list[str],
                    images: dict[str, str | None]) -> str | None:
    """Why a seat cannot run in verifiers' docker runtime with ``image`` here, or None when it can."""
    if harness_id in builtin and harness_id not in DOCKER_HARNESSES:
        return (f"verifiers' {harness_id!r} harness installs its agent into the container at setup (Node.js, npm or "
                "PyPI packages, a git checkout) from sources this machine may not reach; in the docker runtime only "
                f"verifiers' chat program (harnesses {', '.join(sorted(DOCKER_HARNESSES))}), which the harness image "
                "carries ready, runs here")
    if runtime.network_restricted:
        return (f"its network policy (allow={runtime.allow}, block={runtime.block}) needs verifiers' firewall "
                "helper image, which verifiers builds FROM docker.io/library/alpine (no registry can be reached); "
                "leave allow and block unset")
    if image not in images:
        images[image] = _image_refusal(image)
    return images[image]


def _image_refusal(image: str) -> str | None:
    """Why ``image`` cannot serve verifiers' docker runtime here (absent, or without python3), or None."""
    if shutil.which("docker") is None:
        return "the docker CLI is not installed (apt-get install docker.io, then start dockerd)"
    build = (f"build it with `{BUILD_HARNESS_IMAGE}`" if image == HARNESS_IMAGE else
             "build or load it into the local engine (docker build / docker load)")
    try:
        found = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", image],
                               capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "the Docker engine did not answer within 30 s"
    if found.returncode != 0:
        detail = " ".join(found.stderr.split())
        if "no such image" not in detail.lower():
            return f"the Docker engine cannot be asked about it: {detail[:300]}"
        return f"the image is not in the local Docker engine and no registry can be reached: {build}"
    if image == HARNESS_IMAGE:
        return _stale_harness_image()
    # verifiers runs python3 in the seat's image to reach the host's endpoints, else PROXY_FALLBACK_IMAGE
    try:
        probe = subprocess.run(["docker", "run", "--rm", "--network", "none", "--entrypoint", "python3", image,
                                "-c", ""], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "a container of the image did not start within 120 s"
    if probe.returncode != 0 and subprocess.run(["docker", "image", "inspect", PROXY_FALLBACK_IMAGE],
                                                capture_output=True, timeout=30).returncode != 0:
        return ("the image has no python3, which verifiers' docker runtime runs in it to reach the host (else it "
                f"pulls {PROXY_FALLBACK_IMAGE} from a registry); build it FROM {HARNESS_IMAGE} ({BUILD_HARNESS_IMAGE})")
    return None


def _stale_harness_image() -> str | None:
    """Why ``HARNESS_IMAGE`` does not carry the chat program of the verifiers installed here, or None when it does
    (an older image would sync the program's dependencies from a package index in every episode)."""
    import hashlib

    from verifiers import __version__
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE

    label = subprocess.run(["docker", "image", "inspect", "--format",
                            '{{index .Config.Labels "rollout-log.chat-program"}}', HARNESS_IMAGE],
                           capture_output=True, text=True, timeout=30).stdout.strip()
    if label != hashlib.sha256(CHAT_PROGRAM_SOURCE.encode()).hexdigest():
        return (f"the image does not carry the chat program of the verifiers {__version__} installed here (its label "
                f"rollout-log.chat-program: {label[:12] or 'missing'}): rebuild it with `{BUILD_HARNESS_IMAGE}`")
    return None


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
