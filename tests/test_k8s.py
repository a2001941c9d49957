"""deploy/k8s, checked offline (no cluster): every manifest validates against the Kubernetes API schemas
(kubernetes-validate's bundled ones, strict), kustomization.yaml lists every manifest, and each container runs
what the project really accepts: its command parses with the real parser of what it starts (`rollout`'s, torchrun's
and then `python -m consumers`', vLLM's) and builds its settings from the mounted plan and its environment; its
ROLLOUT_* variables are settings the code reads; its metrics annotation is the port the process serves on; its
SASL user is its principal in streams/security.py; and what several manifests share (the checkpoint path, the
rendezvous and vLLM addresses, replica counts, Secret keys) agrees. ``problems`` collects every disagreement;
test_each_check_can_fail breaks one fact at a time in a copy and sees it reported."""

from __future__ import annotations

import contextlib
import copy
import io
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import urlparse

import pytest
import yaml

from consumers.registry import SERVICES

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
KUSTOMIZATION, SECRETS = "kustomization.yaml", "secrets.example.yaml"
# StatefulSet pods carry their ordinal as a label from 1.28 on (the arenas' POD_INDEX); and the newest bundled
K8S_VERSIONS = ("1.28", "1.37")
WORKLOADS = ("Deployment", "StatefulSet", "Job")
KUSTOMIZE_KEYS = {"apiVersion", "kind", "resources", "images"}
Files = dict[str, list[dict[str, Any]]]


def load() -> Files:
    return {p.name: [d for d in yaml.safe_load_all(p.read_text()) if d] for p in sorted(K8S.glob("*.yaml"))}


# -- what the code reads and runs ---------------------------------------------------------------------------


@cache
def known_settings() -> frozenset[str]:
    """Every ROLLOUT_* variable the code reads: the fields of its pydantic settings (env_prefix ROLLOUT_) and
    each name its sources quote (streams.config's table, the os.environ reads)."""
    from consumers.settings import ServiceSettings
    from streams.settings import ProcessingSettings

    names = {f"ROLLOUT_{f.upper()}" for cls in (ServiceSettings, ProcessingSettings) for f in cls.model_fields}
    for pkg in ("schemas", "streams", "policy", "producers", "consumers", "replay", "rollout"):
        for src in (ROOT / pkg).rglob("*.py"):
            names |= set(re.findall(r"""["'](ROLLOUT_[A-Z0-9_]+)["']""", src.read_text()))
    return frozenset(names)


@cache
def rollout_parser():
    from rollout.cli import build_parser

    return build_parser()


@cache
def consumers_parser():
    from consumers.cli import build_parser

    return build_parser()


@cache
def vllm_parser():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def parse(parser: Any, argv: list[str]) -> Any:
    """``parser.parse_args(argv)``; a refusal raises ValueError with argparse's own message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(argv)
    except SystemExit:
        raise ValueError(err.getvalue().strip().splitlines()[-1]) from None


def image_model_dir() -> str:
    """Where the app image's processes find the packaged model (revision 0's weights): policy.hf under the
    image's ROLLOUT_CACHE_DIR (Dockerfile.app)."""
    from policy.hf import model_dir

    cache_dir = re.search(r"^ENV ROLLOUT_CACHE_DIR=(\S+)", (ROOT / "Dockerfile.app").read_text(), re.M).group(1)
    with mock.patch.dict(os.environ, {"ROLLOUT_CACHE_DIR": cache_dir}):
        os.environ.pop("ROLLOUT_MODEL_DIR", None)
        return str(model_dir())


@contextlib.contextmanager
def environ(env: dict[str, str]) -> Iterator[None]:
    """The process environment a container would have: its variables, and no other ROLLOUT_* ones."""
    with mock.patch.dict(os.environ):
        for k in [k for k in os.environ if k.startswith("ROLLOUT_")]:
            del os.environ[k]
        os.environ.update(env)
        yield


# -- the checks ---------------------------------------------------------------------------------------------


class Pod:
    """One workload's pod template and what its containers were found to run."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc, self.kind, self.name = doc, doc["kind"], doc["metadata"]["name"]
        self.spec = doc["spec"]["template"]["spec"]
        self.meta = doc["spec"]["template"].get("metadata", {})
        self.containers = self.spec.get("initContainers", []) + self.spec["containers"]
        self.volumes = {v["name"]: v for v in self.spec.get("volumes", [])}
        self.runs: dict[str, Any] = {}  # what: "service" | "arena" | "trainer" | "vllm" | "copy" -> details
        self.metrics_port: int | None = None

    def mounts(self, c: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """mountPath -> the volume mounted there."""
        return {m["mountPath"]: self.volumes.get(m["name"], {}) for m in c.get("volumeMounts", [])}


def problems(files: Files) -> list[str]:
    out: list[str] = []
    kust = files[KUSTOMIZATION][0]
    listed = list(kust.get("resources", []))
    expected = sorted(set(files) - {KUSTOMIZATION, SECRETS})
    if sorted(listed) != expected:
        out.append(f"kustomization resources {sorted(listed)} != the manifests {expected}")
    if set(kust) - KUSTOMIZE_KEYS:  # anything else would change what is applied from what is validated here
        out.append(f"kustomization does more than list resources and set images: {sorted(set(kust) - KUSTOMIZE_KEYS)}")
    docs = [d for f in listed for d in files.get(f, [])]
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    secrets = {d["metadata"]["name"]: {**d.get("data", {}), **d.get("stringData", {})} for d in files[SECRETS]}
    configmaps = {n: d.get("data", {}) for (k, n), d in by.items() if k == "ConfigMap"}
    images = {i["name"]: i.get("newTag") for i in kust.get("images", [])}
    pods = [Pod(d) for d in docs if d["kind"] in WORKLOADS]
    with tempfile.TemporaryDirectory() as tmp:
        for pod in pods:
            for c in pod.containers:
                where = f"{pod.kind}/{pod.name} container {c['name']}"
                out += [f"{where}: {p}" for p in container_problems(pod, c, configmaps, secrets, images, Path(tmp))]
    out += fleet_problems(pods, by, secrets)
    return out


def container_problems(pod: Pod, c: dict[str, Any], configmaps: dict, secrets: dict, images: dict,
                       tmp: Path) -> list[str]:
    out: list[str] = []
    name, _, tag = c["image"].partition(":")
    if name not in images or images[name] != tag:
        out.append(f"image {c['image']} is not the kustomization's {name}:{images.get(name)}")
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        ref = src["configMapRef"]["name"]
        if ref not in configmaps:
            out.append(f"envFrom names no ConfigMap here: {ref}")
        env.update(configmaps.get(ref, {}))
    for e in c.get("env", []):
        vf = e.get("valueFrom", {})
        if "value" in e:
            env[e["name"]] = str(e["value"])
        elif "fieldRef" in vf:
            path = vf["fieldRef"]["fieldPath"]
            samples = {"metadata.name": f"{pod.name}-0"}
            if pod.kind == "StatefulSet":
                samples["metadata.labels['apps.kubernetes.io/pod-index']"] = "0"
            if path not in samples:
                out.append(f"{e['name']}: no {path} on a {pod.kind}'s pods")
            env[e["name"]] = samples.get(path, "")
        elif "secretKeyRef" in vf:
            ref = vf["secretKeyRef"]
            if ref["key"] not in secrets.get(ref["name"], {}):
                out.append(f"{e['name']}: Secret {ref['name']} has no key {ref['key']} ({SECRETS})")
            env[e["name"]] = secrets.get(ref["name"], {}).get(ref["key"], "")
        else:
            out.append(f"{e['name']}: no check here for {sorted(vf)}")
    unknown = sorted(k for k in env if k.startswith("ROLLOUT_") and k not in known_settings())
    if unknown:
        out.append(f"ROLLOUT_ variables the code never reads: {unknown}")
    argv = [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), str(a))
            for a in c.get("command", []) + c.get("args", [])]
    if any("$(" in a for a in argv):
        return out + [f"unresolved $(VAR) in {argv}"]
    # the files mounted from ConfigMaps (the plan), written out where a local run reads them
    local = {}
    for path, vol in pod.mounts(c).items():
        if "configMap" in vol:
            d = tmp / pod.name / vol["configMap"]["name"]
            d.mkdir(parents=True, exist_ok=True)
            for key, text in configmaps.get(vol["configMap"]["name"], {}).items():
                (d / key).write_text(text)
            local[path] = str(d)

    def here(args: list[str]) -> list[str]:
        return [next((local[p] + a[len(p):] for p in local if a.startswith(p + "/")), a) for a in args]

    try:
        with environ(env):
            out += run_problems(pod, c, argv, here, env)
    except Exception as e:  # noqa: BLE001 - any refusal is the finding
        out.append(f"{argv}: {type(e).__name__}: {e}")
    return out


def run_problems(pod: Pod, c: dict[str, Any], argv: list[str], here: Callable, env: dict[str, str]) -> list[str]:
    """Parse ``argv`` with the parser of what it runs and build its settings; note what runs in ``pod.runs``."""
    from streams import metrics

    base = int(env.get("ROLLOUT_METRICS_PORT") or 0)
    if argv[:1] == ["rollout"]:
        args = parse(rollout_parser(), here(argv[1:]))
        if args.command == "serve" and args.service in SERVICES:
            service_settings(args)
            pod.runs["service"] = args.service
            pod.metrics_port = base + metrics.SERVICE_OFFSET + list(SERVICES).index(args.service)
            return kafka_problems(env, args.service)
        if args.command == "arena":
            from producers.environments.loader import environment_from_spec
            from schemas.plan import require_runnable
            from schemas.plan_compiler import compile_plan
            from streams.security import ARENA

            plan = compile_plan(args.plan)
            require_runnable(plan)
            for spec in plan.environments:
                environment_from_spec(spec)
            pod.runs["arena"] = (args, plan)
            pod.metrics_port = base + metrics.OFFSETS["arena"]
            return kafka_problems(env, ARENA)
        if (args.command, getattr(args, "topics_command", None), getattr(args, "kafka_command", None)) in (
                ("topics", "create", None), ("kafka", None, "acls")):
            return kafka_problems(env, None)
        return [f"runs `rollout {args.command}`, which no manifest here should"]
    if argv[:1] == ["torchrun"]:
        from torch.distributed.run import config_from_args, get_args_parser

        targs = parse(get_args_parser(), argv[1:])
        with mock.patch.dict(os.environ, {"OMP_NUM_THREADS": "1"}):
            config, _, cmd_args = config_from_args(targs)
        if cmd_args[:3] != ["-u", "-m", "consumers"]:
            return [f"torchrun launches {cmd_args[:3]}, not `-m consumers`"]
        args = parse(consumers_parser(), here(cmd_args[3:]))
        if (args.cmd, getattr(args, "service", None)) != ("serve", "trainer"):
            return [f"torchrun runs `consumers {args.cmd}`, not `serve trainer`"]
        pod.runs["trainer"] = (config, service_settings(args))
        pod.metrics_port = base + metrics.SERVICE_OFFSET + list(SERVICES).index("trainer")
        return kafka_problems(env, "trainer")
    if argv[:3] in (["python", "-m", "vllm.entrypoints.openai.api_server"],
                    ["python3", "-m", "vllm.entrypoints.openai.api_server"]):
        from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

        args = parse(vllm_parser(), argv[3:])
        validate_parsed_serve_args(args)
        pod.runs["vllm"] = (c, args)
        pod.metrics_port = args.port  # vLLM's own /metrics
        return []
    if argv[:2] == ["cp", "-a"] and len(argv) == 4:
        pod.runs["copy"] = (c, argv[2], argv[3])
        return []
    return [f"no parser knows {argv[:3]}"]


def service_settings(args: Any) -> Any:
    from consumers.cli import settings_from_args

    return settings_from_args(args)


def kafka_problems(env: dict[str, str], principal: str | None) -> list[str]:
    """The processing and Kafka settings parse, name a cluster, and SASL has a user and a password, the user being
    the process's principal in streams/security.py (None: the admin, any user)."""
    from streams.config import KafkaSettings
    from streams.security import all_acls
    from streams.settings import ProcessingSettings

    ProcessingSettings()
    kafka = KafkaSettings.from_env(env)
    out = []
    if not kafka.external:
        out.append("no ROLLOUT_BOOTSTRAP_SERVERS: it would start a local broker")
    if kafka.security_protocol.startswith("SASL_"):
        if not kafka.sasl_username or kafka.sasl_password is None:
            out.append("SASL without ROLLOUT_KAFKA_SASL_USERNAME and ROLLOUT_KAFKA_SASL_PASSWORD")
        elif principal is not None and (kafka.sasl_username != principal
                                        or f"User:{principal}" not in {a.principal for a in all_acls(SERVICES)}):
            out.append(f"SASL user {kafka.sasl_username!r} is not {principal}'s principal (streams/security.py)")
    return out


def fleet_problems(pods: list[Pod], by: dict[tuple[str, str], dict[str, Any]], secrets: dict) -> list[str]:
    out: list[str] = []
    runs = {what: pod for pod in pods for what in pod.runs}
    services = {pod.runs["service"]: pod for pod in pods if "service" in pod.runs}
    for name in SERVICES:
        if name == "trainer":
            continue
        if name not in services or services[name].kind != "Deployment" or services[name].name != name:
            out.append(f"service {name}: no Deployment {name} runs `rollout serve {name}`")
    for what in ("trainer", "arena", "vllm", "copy"):
        if what not in runs:
            out.append(f"nothing runs the {what}")
    if out:
        return out
    for pod in pods:
        out += pod_problems(pod, by, secrets)
    trainer, arena, vllm = runs["trainer"], runs["arena"], runs["vllm"]
    config, settings = trainer.runs["trainer"]
    # torchrun: one agent per pod, the group meeting at pod 0 through the headless Service
    host, _, port = config.rdzv_endpoint.rpartition(":")
    svc = by.get(("Service", trainer.doc["spec"].get("serviceName", "")), {}).get("spec", {})
    if trainer.kind != "StatefulSet":
        out.append("the trainer is not a StatefulSet (stable names for the rendezvous)")
    if (config.min_nodes, config.max_nodes) != (trainer.doc["spec"]["replicas"],) * 2:
        out.append(f"torchrun --nnodes {config.min_nodes}:{config.max_nodes} != trainer replicas "
                   f"{trainer.doc['spec']['replicas']}")
    gpus = int(trainer.spec["containers"][0].get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
    if config.nproc_per_node != gpus:
        out.append(f"torchrun --nproc-per-node {config.nproc_per_node} != the trainer's {gpus} GPUs")
    if config.rdzv_backend != "c10d" or config.max_restarts < 1:
        out.append("the trainer needs --rdzv-backend c10d and --max-restarts >= 1")
    if host != f"{trainer.name}-0.{trainer.doc['spec'].get('serviceName')}" or \
            int(port) not in {p["port"] for p in svc.get("ports", [])} or svc.get("clusterIP") != "None" \
            or not svc.get("publishNotReadyAddresses"):
        out.append(f"rendezvous {config.rdzv_endpoint}: not pod 0 of the trainer through its headless Service "
                   "(publishNotReadyAddresses, that port)")
    # the checkpoints: one RWX claim, at the trainer's --checkpoint-dir in the trainer, the arenas and vLLM
    ck = settings.checkpoint_dir
    for pod, c in ((trainer, trainer.spec["containers"][0]), (arena, arena.spec["containers"][0]),
                   (vllm, vllm.runs["vllm"][0])):
        claim = pod.mounts(c).get(ck, {}).get("persistentVolumeClaim", {}).get("claimName")
        pvc = by.get(("PersistentVolumeClaim", claim or ""), {})
        if "ReadWriteMany" not in pvc.get("spec", {}).get("accessModes", []):
            out.append(f"{pod.name}: no ReadWriteMany claim mounted at the trainer's checkpoint dir {ck}")
    # arena N drives vLLM N
    args, plan = arena.runs["arena"]
    vc, vargs = vllm.runs["vllm"]
    from rollout.arena_cmd import policy_urls

    urls = policy_urls(args)
    url = urlparse(urls[0] if len(urls) == 1 else "")  # one server per arena: arena N drives vLLM N
    if arena.kind != "StatefulSet" or arena.doc["spec"]["replicas"] != vllm.doc["spec"]["replicas"]:
        out.append("the arenas are not a StatefulSet with as many replicas as vLLM (one per server)")
    if args.policy != "vllm" or url.hostname != f"{vllm.name}-0.{vllm.doc['spec'].get('serviceName')}" \
            or url.port != vargs.port or url.path != "/v1" or args.cpu_vllm:
        out.append(f"arena 0 does not drive vLLM 0 (--policy vllm --gpu-vllm --policy-url {','.join(urls)})")
    if args.arena_id != f"{arena.name}-0" or not args.run_id:
        out.append("each arena needs its pod name as --arena-id and the run's --run-id")
    # vLLM as producers/inference/vllm_server.py runs it, under the names the plan's requests use, the model where
    # revision 0 says it is (copied from the app image by the init container)
    from producers.inference.vllm_server import VllmServer

    ref = parse(vllm_parser(), VllmServer(vargs.model, host=vargs.host, port=vargs.port).command()[3:])
    for field in ("model", "served_model_name", "max_model_len", "disable_uvicorn_access_log"):
        if getattr(vargs, field) != getattr(ref, field):
            out.append(f"vLLM {field} {getattr(vargs, field)!r} != VllmServer's {getattr(ref, field)!r}")
    denv = {e["name"]: e.get("value") for e in vc.get("env", [])}
    if denv.get("VLLM_SERVER_DEV_MODE") != VllmServer(vargs.model).environment()["VLLM_SERVER_DEV_MODE"]:
        out.append("vLLM without VLLM_SERVER_DEV_MODE=1: the arena cannot swap weights")
    if plan.family not in vargs.served_model_name:
        out.append(f"vLLM does not answer to the plan's model {plan.family}")
    if vargs.model != image_model_dir():
        out.append(f"vLLM --model {vargs.model} is not where revision 0's weights are ({image_model_dir()})")
    cc, src, dst = vllm.runs["copy"]
    parent = str(Path(image_model_dir()).parent)
    vol = vllm.mounts(cc).get(dst.rstrip("/"))
    if src.rstrip("/.") != parent or vol is None or vllm.mounts(vc).get(parent) is not vol:
        out.append(f"the init container's copy {src} -> {dst} does not give vLLM {parent}")
    if not vc.get("resources", {}).get("limits", {}).get("nvidia.com/gpu"):
        out.append("vLLM requests no GPU")
    probe = vc.get("readinessProbe", {}).get("httpGet", {})
    ports = {p.get("name"): p["containerPort"] for p in vc.get("ports", [])}
    if probe.get("path") != "/health" or ports.get(probe.get("port"), probe.get("port")) != vargs.port:
        out.append(f"vLLM's readiness probe {probe} is not /health on its port {vargs.port}")
    return out


def pod_problems(pod: Pod, by: dict[tuple[str, str], dict[str, Any]], secrets: dict) -> list[str]:
    out = []
    labels = pod.meta.get("labels", {})
    if pod.kind != "Job" and pod.doc["spec"]["selector"]["matchLabels"].items() - labels.items():
        out.append(f"{pod.name}: selector does not match its pods")
    if pod.kind == "StatefulSet":
        svc = by.get(("Service", pod.doc["spec"]["serviceName"]), {}).get("spec", {})
        if not svc or svc.get("clusterIP") != "None" or svc.get("selector", {}).items() - labels.items():
            out.append(f"{pod.name}: its serviceName is no headless Service selecting its pods")
    ann = pod.meta.get("annotations", {})
    if pod.metrics_port is not None and pod.kind != "Job":
        ports = {p["containerPort"] for c in pod.spec["containers"] for p in c.get("ports", [])}
        if (ann.get("prometheus.io/scrape"), ann.get("prometheus.io/path"), ann.get("prometheus.io/port")) != \
                ("true", "/metrics", str(pod.metrics_port)) or pod.metrics_port not in ports:
            out.append(f"{pod.name}: serves /metrics on {pod.metrics_port}, annotated scrape/path/port "
                       f"{[ann.get('prometheus.io/' + k) for k in ('scrape', 'path', 'port')]}, ports {sorted(ports)}")
    for c in pod.containers:  # TLS files: where a Secret that holds them is mounted
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        for cm in c.get("envFrom", []):
            env.update(by.get(("ConfigMap", cm["configMapRef"]["name"]), {}).get("data", {}))
        for var in ("ROLLOUT_KAFKA_SSL_CAFILE", "ROLLOUT_KAFKA_SSL_CERTFILE", "ROLLOUT_KAFKA_SSL_KEYFILE"):
            if env.get(var):
                d, _, key = env[var].rpartition("/")
                secret = pod.mounts(c).get(d, {}).get("secret", {}).get("secretName")
                if secret is None:
                    out.append(f"{pod.name}/{c['name']}: {var}={env[var]} but no Secret is mounted at {d}")
                elif key not in secrets.get(secret, {}):
                    out.append(f"{pod.name}/{c['name']}: {var}: Secret {secret} has no key {key} ({SECRETS})")
    return out


# -- the tests ----------------------------------------------------------------------------------------------


def test_manifests_validate_against_the_kubernetes_schemas():
    import kubernetes_validate

    files = load()
    assert set(files) > {KUSTOMIZATION, SECRETS}
    kinds = set()
    for name, docs in files.items():
        if name == KUSTOMIZATION:
            continue
        for doc in docs:
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(doc, version, strict=True)
            kinds.add(doc["kind"])
    assert kinds >= {"ConfigMap", "Secret", "PersistentVolumeClaim", "Service", "Deployment", "StatefulSet", "Job"}
    broken = copy.deepcopy(files["services.yaml"][0])
    broken["spec"]["template"]["spec"]["containers"][0]["comand"] = broken["spec"]["template"]["spec"][
        "containers"][0].pop("command")
    with pytest.raises(kubernetes_validate.ValidationError, match="comand"):
        kubernetes_validate.validate(broken, K8S_VERSIONS[0], strict=True)


def test_every_container_runs_what_the_project_accepts():
    assert problems(load()) == []


def _doc(files: Files, kind: str, name: str) -> dict[str, Any]:
    return next(d for f, docs in files.items() if f != KUSTOMIZATION for d in docs
                if (d["kind"], d["metadata"]["name"]) == (kind, name))


def _container(files: Files, kind: str, name: str, index: int = 0) -> dict[str, Any]:
    return _doc(files, kind, name)["spec"]["template"]["spec"]["containers"][index]


def _replace(c: dict[str, Any], old: str, new: str) -> None:
    c["command"] = [new if a == old else a for a in c["command"]]


MUTATIONS: dict[str, tuple[Callable[[Files], None], str]] = {
    "file left out of the kustomization": (lambda f: f[KUSTOMIZATION][0]["resources"].remove("arena.yaml"),
                                           "kustomization resources"),
    "a service flag misspelled": (lambda f: _replace(_container(f, "Deployment", "verifier"), "--plan", "--plann"),
                                  "unrecognized arguments: --plann"),
    "an unknown ROLLOUT_ variable": (lambda f: _doc(f, "ConfigMap", "rollout-env")["data"].update(
        ROLLOUT_BOOTSTRAP_SERVER="kafka:9093"), "never reads: ['ROLLOUT_BOOTSTRAP_SERVER']"),
    "a bad ROLLOUT_ value": (lambda f: _doc(f, "ConfigMap", "rollout-env")["data"].update(
        ROLLOUT_TOPIC_REPLICATION_FACTOR="three"), "ValidationError"),
    "a service missing": (lambda f: f["services.yaml"].pop(1), "service credit: no Deployment"),
    "a wrong metrics port": (lambda f: _doc(f, "Deployment", "batcher")["spec"]["template"]["metadata"][
        "annotations"].update({"prometheus.io/port": "9411"}), "batcher: serves /metrics on 9412"),
    "a torchrun flag misspelled": (lambda f: _replace(_container(f, "StatefulSet", "trainer"), "--nproc-per-node",
                                                      "--nprocs-per-node"), "unrecognized arguments"),
    "a trainer flag it does not take": (lambda f: _replace(_container(f, "StatefulSet", "trainer"),
                                                           "--keep-checkpoints", "--credit"),
                                        "unrecognized arguments: --credit"),
    "nodes != replicas": (lambda f: _doc(f, "StatefulSet", "trainer")["spec"].update(replicas=2),
                          "!= trainer replicas 2"),
    "GPUs != processes per node": (lambda f: _container(f, "StatefulSet", "trainer")["resources"]["limits"].update(
        {"nvidia.com/gpu": 4}), "!= the trainer's 4 GPUs"),
    "rendezvous elsewhere": (lambda f: _replace(_container(f, "StatefulSet", "trainer"), "trainer-0.trainer:29400",
                                                "trainer:29400"), "rendezvous trainer:29400"),
    "a vLLM flag misspelled": (lambda f: _replace(_container(f, "StatefulSet", "vllm"), "--max-model-len",
                                                  "--max-model-length"), "unrecognized arguments"),
    "vLLM without dev mode": (lambda f: _container(f, "StatefulSet", "vllm")["env"].pop(0), "VLLM_SERVER_DEV_MODE"),
    "vLLM under another name": (lambda f: _replace(_container(f, "StatefulSet", "vllm"), "SmolLM2-135M-Instruct",
                                                   "smollm"), "served_model_name"),
    "arena pointed elsewhere": (lambda f: _replace(_container(f, "StatefulSet", "arena"),
                                                   "http://vllm-$(POD_INDEX).vllm:8000/v1", "http://vllm:8000/v1"),
                                "arena 0 does not drive vLLM 0"),
    "an undefined $(VAR)": (lambda f: _replace(_container(f, "StatefulSet", "arena"), "$(POD_NAME)", "$(POD)"),
                            "unresolved $(VAR)"),
    "fewer arenas than servers": (lambda f: _doc(f, "StatefulSet", "arena")["spec"].update(replicas=1),
                                  "as many replicas as vLLM"),
    "checkpoints elsewhere in vLLM": (lambda f: _container(f, "StatefulSet", "vllm")["volumeMounts"][1].update(
        mountPath="/checkpoints"), "vllm: no ReadWriteMany claim"),
    "a SASL user not the service's principal": (lambda f: _container(f, "Deployment", "batcher")["env"][1].update(
        value="credit"), "is not batcher's principal"),
    "a Secret key nobody creates": (lambda f: _container(f, "Deployment", "credit")["env"][2]["valueFrom"][
        "secretKeyRef"].update(key="credit-password"), "has no key credit-password"),
    "the CA under another name": (lambda f: _doc(f, "ConfigMap", "rollout-env")["data"].update(
        ROLLOUT_KAFKA_SSL_CAFILE="/etc/rollout/kafka-tls/ca.pem"), "Secret rollout-kafka-tls has no key ca.pem"),
    "the CA not mounted": (lambda f: _container(f, "StatefulSet", "arena")["volumeMounts"].pop(2),
                           "no Secret is mounted at /etc/rollout/kafka-tls"),
    "the plan not runnable": (lambda f: _doc(f, "ConfigMap", "rollout-plan")["data"].update({"plan.toml": _doc(
        f, "ConfigMap", "rollout-plan")["data"]["plan.toml"].replace('"arithmetic"', '"no-such-env"')}), "no-such-env"),
    "an image the kustomization does not set": (lambda f: _container(f, "Deployment", "credit").update(
        image="rollout-log/app:v2"), "not the kustomization's"),
}


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_each_check_can_fail(mutation):
    files = load()
    breaks, expected = MUTATIONS[mutation]
    breaks(files)
    found = problems(files)
    assert any(expected in p for p in found), found


@pytest.mark.integration
def test_the_trainer_runs_under_torchrun_as_written(kafka_bootstrap, tmp_path, monkeypatch):
    """trainer.yaml's command, as written (the plan, checkpoint dir and rendezvous port mapped to this machine):
    torchrun rendezvouses and starts the trainer, which publishes revision 0 of the plan's family on the test
    broker; a rank killed with SIGKILL is started again (--max-restarts); the pod's SIGTERM stops the trainer
    cleanly (torchrun itself then exits non-zero, raising its SignalException: the pod is going away anyway)."""
    import asyncio
    import signal
    import subprocess
    import sys
    import time
    import uuid

    from schemas.plan_compiler import compile_plan
    from streams.config import KafkaSettings
    from streams.local_broker import free_port
    from streams.revisions import latest_revision
    from streams.topics import TopicMissing

    files = load()
    plan = tmp_path / "plan.toml"
    plan.write_text(_doc(files, "ConfigMap", "rollout-plan")["data"]["plan.toml"])
    here = {"/etc/rollout/plan/plan.toml": str(plan), "/data/checkpoints": str(tmp_path / "checkpoints"),
            "trainer-0.trainer:29400": f"localhost:{free_port()}"}
    command = _container(files, "StatefulSet", "trainer")["command"]
    assert command[0] == "torchrun"
    argv = [sys.executable, "-m", "torch.distributed.run", *(here.get(a, a) for a in command[1:])]
    prefix = f"k8s-{uuid.uuid4().hex[:8]}."
    monkeypatch.setenv("ROLLOUT_TOPIC_PREFIX", prefix)  # this process reads the revisions topic too
    env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": kafka_bootstrap, "ROLLOUT_INSTANCE": "trainer-0"}
    log = tmp_path / "torchrun.log"
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    kw = KafkaSettings.from_env().with_bootstrap(kafka_bootstrap).client_kwargs()
    family = compile_plan(plan).family

    def wait_for(what: str, ready: Callable[[], Any]) -> Any:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"torchrun exited {proc.returncode}:\n{log.read_text()[-3000:]}"
            if result := ready():
                return result
            time.sleep(1)
        pytest.fail(f"no {what} in 180 s:\n{log.read_text()[-3000:]}")

    def worker() -> int | None:  # torchrun's one child: the rank it started
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        return int(children[0]) if children else None

    try:
        def revision_0():  # None until the trainer has created its topics (seconds after torchrun starts it)
            try:
                return asyncio.run(latest_revision(kw, family))
            except TopicMissing:
                return None

        revision = wait_for("revision 0", revision_0)
        assert revision.revision == 0 and revision.family == family
        wait_for("started trainer", lambda: log.read_text().count("service started") == 1)
        os.kill(wait_for("rank", worker), signal.SIGKILL)
        wait_for("restarted trainer", lambda: log.read_text().count("service started") == 2)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=40)  # the pod's terminationGracePeriodSeconds
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"torchrun still running 40 s after SIGTERM:\n{log.read_text()[-3000:]}")
    assert "service stopped" in log.read_text(), log.read_text()[-3000:]
