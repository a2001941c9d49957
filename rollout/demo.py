"""`rollout demo`: the full loop, locally: a real LLM served by vLLM, trained from the log.

Broker up (ROLLOUT_BOOTSTRAP_SERVERS, else the local one), fresh topics for this run (prefix
``demo-<run>.``), vLLM started on the packaged SmolLM2-135M-Instruct, revision 0 (the model as packaged)
published; then the services (verifier, credit, batcher, reference trainer) run in this process while the
arena (``rollout arena PLAN --policy vllm --follow-revisions --evaluate``) generates arithmetic rollouts in a
subprocess. Every revision the trainer publishes is loaded into the running vLLM (no restart); revision 0, every
``eval_interval``-th (the plan's ``[orchestrator.eval] interval``: 8 for the demo's, so evaluation stays a small
part of the run and still draws a curve; ``--eval-interval``) and the last answer a held-out question set
(evaluation rollouts, never trained on). A live line shows the phase, revisions, the
last batch's reward and the eval accuracy; the summary gives eval accuracy and training reward by revision,
the trainer-inference logprob mismatch, step and reload times, and what to run next.

    rollout demo                      # vLLM + SmolLM2-135M-Instruct, ~5 minutes on 2 cores
    rollout demo --policy tiny        # the byte-level GRU and its local server: the fast loop (~1 minute)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout.argtypes import at_least

log = logging.getLogger("rollout.demo")
ROOT = Path(__file__).resolve().parents[1]
DEMO_KEEP_CHECKPOINTS = 4  # a demo run writes one checkpoint per revision (270 MB each for SmolLM2): keep the newest
RUNS_DIR = ROOT / ".state" / "demo"  # one folder per run: vllm.log and checkpoints/
KEEP_RUNS = 5  # run folders kept (~1 GB each for SmolLM2: DEMO_KEEP_CHECKPOINTS checkpoints); older ones removed


@dataclass(frozen=True)
class Profile:
    """The defaults of one policy kind (each overridable on the command line)."""

    plan: str
    groups: int
    lr: float
    epochs: int


PROFILES = {
    "vllm": Profile(str(ROOT / "examples" / "plans" / "arithmetic-smollm2.toml"), groups=96, lr=2e-5, epochs=1),
    "tiny": Profile(str(ROOT / "examples" / "plans" / "arithmetic.toml"), groups=192, lr=1e-2, epochs=4),
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo", help="the main job: Kafka, vLLM with SmolLM2-135M-Instruct, the services, a real trainer, a summary",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", choices=sorted(PROFILES), default="vllm",
                   help="vllm: SmolLM2-135M-Instruct on vLLM (default); tiny: the byte-level GRU (fast)")
    p.add_argument("--plan", help="GenerationPlan (default: arithmetic-smollm2.toml, or arithmetic.toml for tiny)")
    defaults = lambda f: " / ".join(f"{getattr(v, f)} ({k})" for k, v in PROFILES.items())  # noqa: E731
    p.add_argument("--groups", type=at_least(1), help="groups the arena admits (plan.group_size rollouts each); "
                                              f"default {defaults('groups')}")
    p.add_argument("--lr", type=float, help=f"reference trainer learning rate (default {defaults('lr')})")
    p.add_argument("--epochs", type=at_least(1),
                   help=f"optimizer passes over each batch (default {defaults('epochs')})")
    p.add_argument("--vllm-port", type=int, default=0, help="vLLM's port (default: a free one)")
    p.add_argument("--vllm-url", help="use this running vLLM server (http://host:port/v1, started with "
                                      "VLLM_SERVER_DEV_MODE=1 on the packaged model) instead of starting one")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="give up on the arena after this many seconds (default 3600: the default run took 22 min "
                        "on 2 AVX2-only cores, where the trainer runs in float32)")
    add_loop_flags(p)
    p.add_argument("--no-progress", action="store_true", help="no live progress line")
    p.set_defaults(func=cmd_demo)


def add_loop_flags(p: argparse.ArgumentParser) -> None:
    """The flags every whole-loop command (demo, rl) shares."""
    add_model_flag(p)
    add_eval_interval_flag(p)
    add_cores_flag(p)
    p.add_argument("--keep-runs", type=at_least(1), default=KEEP_RUNS, metavar="N",
                   help=f"keep the folders (checkpoints, vLLM log) of the newest N runs under {RUNS_DIR}, this one "
                        f"included, and remove older ones when a run starts (default {KEEP_RUNS}; their logs stay "
                        "in Kafka: replay and audit need no checkpoint, `rollout derive` from a removed revision "
                        "says so)")


def add_cores_flag(p: argparse.ArgumentParser) -> None:
    from rollout.cores import MODES, SPLIT_FROM

    p.add_argument("--cores", choices=MODES, default="auto",
                   help="how the vLLM it starts and the trainer share this machine's cores: turns (every core each, "
                        "never at once: off-policy bound 0 for the run), split (half each, overlapping, the plan's "
                        f"bound), shared (every core each, at once); auto (default): split from {SPLIT_FROM} cores, "
                        "turns below, or shared for a plan with seats, routed members or a verifiers env "
                        "(rollout/cores.py). With --vllm-url only turns applies (a server on this machine); "
                        "otherwise the two overlap")


def add_eval_interval_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--eval-interval", type=at_least(1), metavar="N",
                   help="answer the held-out questions at revision 0 and every N revisions after, and with the "
                        "run's last revision (default: the plan's [orchestrator.eval] interval, every revision "
                        "without one); an evaluation source's own interval still holds")


def add_model_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="packaged|PATH",
                   help="the weights for a plan whose model cannot be served here: 'packaged' runs the packaged "
                        "SmolLM2-135M-Instruct in its place, PATH an HF folder (the plan, the summary and every "
                        "revision say so); not needed when the plan's model is SmolLM2 itself")


def cmd_demo(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(level=logging.ERROR)
    prof = PROFILES[args.policy]
    args.plan = args.plan or prof.plan
    args.groups = args.groups or prof.groups
    args.lr = args.lr or prof.lr
    args.epochs = args.epochs or prof.epochs
    return run_loop(args, "demo")


def run_loop(args: argparse.Namespace, command: str) -> int:
    """Broker up, then the loop (``_demo``); every expected failure is one line naming ``command``."""
    from streams.config import KafkaSettings, ensure_broker

    settings = KafkaSettings.from_env()
    where = "configured cluster" if settings.external else "local broker"
    settings = settings.with_bootstrap(ensure_broker(settings))
    print(f"Kafka: {where} at {settings.bootstrap}", flush=True)
    from policy.hf import ModelUnavailable
    from producers.inference.vllm_server import VllmStartError
    from consumers.settings import PlanRefused
    from producers.environments.loader import EnvironmentUnavailable
    from schemas.plan import PlanError

    try:
        return asyncio.run(_demo(settings, args))
    except (ModelUnavailable, VllmStartError, PlanError, PlanRefused, EnvironmentUnavailable) as e:
        print(f"rollout {command}: error: {e}", file=sys.stderr)
        return 1


def _retain_runs(runs_dir: Path, keep: int) -> None:
    """Remove the run folders older than the newest ``keep``: a run leaves ~1 GB of checkpoints, and a machine that
    runs the loop every day would otherwise fill its disk."""
    import shutil

    if not runs_dir.is_dir():
        return
    old = sorted((d for d in runs_dir.iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime, reverse=True)[keep:]
    if not old:
        return
    size = sum(f.stat().st_size for d in old for f in d.rglob("*") if f.is_file())
    for d in old:
        shutil.rmtree(d, ignore_errors=True)
    print(f"removed {len(old)} older run folder(s) from {runs_dir} ({size / 1e9:.1f} GB; --keep-runs)", flush=True)


def _drop_training_states(ckdir: Path) -> None:
    """A finished run's training states (AdamW moments, 1.7 GB for SmolLM2): only a take-over reads them, and a
    finished run has none; its checkpoints stay (``rollout derive`` forks from them)."""
    import shutil

    from consumers.trainer.state import TRAINING_STATE_SUFFIX, wait_for_training_states

    wait_for_training_states()  # one may still be being written
    for d in ckdir.glob(f"*{TRAINING_STATE_SUFFIX}"):
        shutil.rmtree(d, ignore_errors=True)


def context_length(plan, model_dir: Path) -> int:
    """vLLM's context: the recipe's ``[inference.vllm] max_model_len``, else its ``seq_len``, else 2048; at most what
    the model was trained for."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    wanted = plan.server.get("max_model_len") or plan.seq_len or 2048
    return min(int(wanted), int(config.get("max_position_embeddings") or 2048))


# -- live view of the run --------------------------------------------------------------------------------

@dataclass
class Progress:
    """What the live line and the summary show, fed by a tail of the scores and revisions topics."""

    phase: str = "starting"
    train: dict[int, list[float]] = field(default_factory=dict)   # revision -> rewards of training rollouts
    parts: dict[str, dict[int, list[float]]] = field(default_factory=dict)  # reward component -> revision -> values
    evals: dict[int, list[float]] = field(default_factory=dict)   # revision -> correct (0/1) per eval question
    revisions: dict[int, dict[str, float]] = field(default_factory=dict)  # revision -> trainer metrics
    scored: int = 0       # training rollouts scored
    eval_scored: int = 0  # evaluation rollouts scored
    started: float = field(default_factory=time.monotonic)

    def add_score(self, s: Any) -> None:
        if s.evaluation:
            self.eval_scored += 1
        else:
            self.scored += 1
        rev = s.trainable_steps[0].policy.revision if s.trainable_steps else None
        if rev is None:
            return
        if s.evaluation:
            exact = next((v for k, v in s.metrics.items() if k.endswith("/reward/exact_answer")), None)
            value = exact if exact is not None else max(s.rewards.values(), default=0.0)
            self.evals.setdefault(rev, []).append(1.0 if value >= 1.0 else 0.0)
            return
        self.train.setdefault(rev, []).extend(s.rewards.values())
        for name, v in s.metrics.items():
            if "/reward/" in name:
                self.parts.setdefault(name.rsplit("/", 1)[-1], {}).setdefault(rev, []).append(v)

    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        out = [f"[{elapsed:5.0f}s] {self.phase}"]
        if self.revisions:
            r = max(self.revisions)
            m = self.revisions[r]
            out.append(f"revision r{r}")
            if "reward_mean" in m:
                out.append(f"batch reward {m['reward_mean']:.3f}")
            if "mismatch_mean" in m:
                out.append(f"mismatch {m['mismatch_mean']:.3f}")
        done = {k: v for k, v in self.evals.items() if v}
        if done:
            r = max(done)
            out.append(f"eval r{r} {_mean(done[r]):.0%} (r{min(done)} {_mean(done[min(done)]):.0%})")
        out.append(f"scored {self.scored}")
        return "  ".join(out)


def _mean(v: list[float]) -> float:
    return sum(v) / len(v) if v else 0.0


async def _tail(kw: dict, progress: Progress, stop: asyncio.Event) -> None:
    """Follow scores and revisions (read_committed, no group) until ``stop``, then read to the end."""
    from aiokafka import AIOKafkaConsumer

    from schemas import codec
    from schemas.events import PolicyRevision, RolloutScored
    from streams import topics

    c = AIOKafkaConsumer(topics.SCORES.name, topics.POLICY_REVISIONS.name, **kw, group_id=None,
                         isolation_level="read_committed", auto_offset_reset="earliest",
                         max_partition_fetch_bytes=64 * 1024 * 1024)
    await c.start()
    idle = 0
    try:
        while not stop.is_set() or idle < 3:
            got = await c.getmany(timeout_ms=300)
            idle = 0 if got else idle + 1
            for recs in got.values():
                for r in recs:
                    try:
                        ev = codec.decode(r.value)
                    except Exception:  # noqa: BLE001 - the services dead-letter bad frames; not ours to show
                        continue
                    if isinstance(ev, RolloutScored):
                        progress.add_score(ev)
                    elif isinstance(ev, PolicyRevision):
                        progress.revisions[ev.revision] = dict(ev.metrics)
    finally:
        await c.stop()


async def _show(progress: Progress, stop: asyncio.Event, enabled: bool) -> None:
    if not enabled:
        return
    from rich.console import Console
    from rich.live import Live

    with Live(progress.line(), console=Console(stderr=True), refresh_per_second=2, transient=False) as live:
        while not stop.is_set():
            live.update(progress.line())
            await asyncio.sleep(0.5)
        live.update(progress.line())


# -- the run ----------------------------------------------------------------------------------------------

async def _demo(settings, args) -> int:
    """A fresh run: its own topics (prefix ``demo-<run>.``) for everything this process starts."""
    from streams.settings import overridden

    run = uuid.uuid4().hex[:8]
    prefix = f"demo-{run}."
    # SIGTERM/SIGINT cancel the run: the arena is stopped (its episodes in flight get a few seconds), the services
    # finish or abandon their open transactions (nothing committed is lost), vLLM is stopped; all within 10 s
    main, loop, caught = asyncio.current_task(), asyncio.get_running_loop(), []
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda s=sig: caught.append(s) or main.cancel())
    try:
        with overridden(topic_prefix=prefix):
            return await _run(settings, args, run, prefix, stopping=lambda: bool(caught))
    except asyncio.CancelledError:
        if not caught:
            raise
    # not through asyncio.run's exit: it would wait for a training step in hand to finish in its thread
    print(f"rollout: stopped by {signal.Signals(caught[0]).name}: what was committed stays on the log (run {run}; "
          "`rollout runs`, `rollout replay`)", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(128 + caught[0])


def load_plan(args):
    """The plan to run, refused when it has run-changing keys nothing here applies, with the weights that serve
    its family (``policy.served``: ``args.model``) named in it."""
    from schemas.plan import require_runnable
    from schemas.plan_compiler import compile_plan

    plan = compile_plan(args.plan)
    if getattr(args, "max_steps", None):  # `rollout rl --max-steps`: the run's last revision
        plan = plan.model_copy(update={"max_steps": args.max_steps})
    require_runnable(plan)
    from schemas.plan import PlanError
    from schemas.policy import TINY_FAMILY

    if args.policy == "tiny" and plan.family != TINY_FAMILY:
        raise PlanError(f"{args.plan}: --policy tiny runs the tiny byte-level model ({TINY_FAMILY}), and this plan's "
                        f"model is {plan.family!r}: leave out --policy to serve it on vLLM, or name "
                        f"[model] name = \"{TINY_FAMILY}\" in the plan")
    served = None
    if args.policy == "vllm":
        from policy.served import served_model

        served = served_model(plan.family, getattr(args, "model", None))
        plan = plan.model_copy(update={"served_model": served.note})
    from producers.environments.loader import environment_from_spec

    for spec in plan.environments + plan.eval_environments:  # fail here, in one line, not in the arena later
        environment_from_spec(spec)
    return plan, served


async def _run(settings, args, run: str, prefix: str, stopping=lambda: False) -> int:
    from consumers.trainer.step import initial_revision
    from policy.compute import computed
    from rollout.cores import BACKGROUND_NICE, choose, pin_this_process, split_cores, vllm_bind
    from streams.local_broker import free_port

    t0 = time.monotonic()
    kw = settings.client_kwargs()
    plan, served = await asyncio.to_thread(load_plan, args)
    if args.eval_interval:  # the command line's cadence over the recipe's (the arena is told the same)
        plan = plan.model_copy(update={"eval_interval": args.eval_interval})
    family = plan.family
    rundir = RUNS_DIR / run
    _retain_runs(RUNS_DIR, args.keep_runs - 1)
    ckdir = rundir / "checkpoints"
    print(f"run {run}: topics {prefix}*, checkpoints {ckdir}, plan {args.plan} (family {family}, "
          f"group_size {plan.group_size}, batch_size {plan.batch_size}, max_off_policy_steps "
          f"{plan.max_off_policy_steps}, advantage {plan.advantage.type}, eval every "
          f"{plan.eval_interval} revisions), policy {args.policy}", flush=True)
    if plan.served_model:
        print(f"model: {plan.served_model} (every revision says so)", flush=True)
    progress = Progress()
    stop_view = asyncio.Event()
    view = asyncio.create_task(_show(progress, stop_view, not args.no_progress))
    vllm = metrics = serving = None
    arena_args: list[str] = []
    cores = "shared"  # with no vLLM started here, nothing to divide, unless --cores turns says so
    arena_nice, restore_broker = 0, lambda: None
    try:
        if args.policy == "vllm":
            from producers.metrics import endpoint, vllm_samples
            from producers.inference.vllm_server import VllmServer

            progress.phase = "preparing the model"
            rev0 = await computed(initial_revision, family, ckdir, run_id=run, served=served)
            url = args.vllm_url
            if url is None:
                port = args.vllm_port or free_port()
                cores = choose(args.cores, plan)
                split = split_cores() if cores == "split" else None
                vllm = VllmServer.for_plan(plan, served.path, port=port, log_path=rundir / "vllm.log",
                                  max_model_len=context_length(plan, served.path),
                                  cores=vllm_bind(split) if split else None)
                rundir.mkdir(parents=True, exist_ok=True)
                url = vllm.base_url

                async def serve() -> None:
                    """vLLM up (its start overlaps the topics' and the services'; the arena waits for it)."""
                    nonlocal metrics
                    t_start = time.monotonic()
                    await vllm.start()
                    metrics = endpoint("vllm", None, ("vllm", lambda: vllm_samples(vllm)))  # ROLLOUT_METRICS_PORT + 2
                    print(f"vLLM ready at {url} in {time.monotonic() - t_start:.0f}s", flush=True)
                    if split:
                        pin_this_process(split)
                        print(f"cores: {split}, overlapping (--cores)", flush=True)
                    elif cores == "turns":
                        print("cores: generation and training take turns on every core: off-policy bound 0 for "
                              "this run (--cores)", flush=True)

                progress.phase = f"vLLM starting on port {port} (log {rundir / 'vllm.log'}); services starting"
                serving = asyncio.create_task(serve())
            elif args.cores == "turns":  # a server of its own on this machine: asked to, take turns with it
                cores = "turns"
                print("cores: generation and training take turns: off-policy bound 0 for this run (--cores)",
                      flush=True)
            if cores == "turns":
                plan = plan.model_copy(update={"max_off_policy_steps": 0})
                arena_args += ["--max-off-policy-steps", "0"]
                arena_nice = BACKGROUND_NICE
                restore_broker = _broker_steps_back(settings)
            arena_args += ["--policy", "vllm", "--policy-url", url]
        else:
            from policy.checkpoint import checkpoint_path

            rev0 = await computed(initial_revision, family, ckdir, seed=0, run_id=run)
            arena_args = ["--policy", "local", "--policy-port", str(free_port()),
                          "--checkpoint", str(checkpoint_path(rev0.checkpoint))]
        rc, summary = await _loop(settings, args, plan, run, prefix, kw, rev0, ckdir, arena_args, progress,
                                  vllm_exited=lambda: vllm is not None and vllm.stopped, server_up=serving,
                                  arena_nice=arena_nice)
    finally:
        restore_broker()
        if serving is not None and not serving.done():  # the services failed to start first
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
        stop_view.set()
        await asyncio.gather(view, return_exceptions=True)
        if metrics is not None:
            metrics.close()
        if vllm is not None:
            await vllm.stop(grace_s=2.0 if stopping() else 20.0)
    if rc == 0:
        _drop_training_states(ckdir)
    summary["seconds"] = round(time.monotonic() - t0, 1)
    summary["cores"] = cores
    _print_summary(summary)
    print(json.dumps(summary))
    return rc


async def _lags(kw, running: list[str]) -> dict[str, int]:
    """The lag of each service this run started (a service it did not start, e.g. the reference of a plan without
    one, never reads its input); a poll that Kafka failed (a connection not ready yet) counts as lag, asked again."""
    from aiokafka.errors import KafkaError

    from consumers.status import service_lag

    try:
        return {r["service"]: r["lag"] for r in await service_lag(kw, sample_s=0.2) if r["service"] in running}
    except KafkaError as e:
        log.warning("draining: the services' lag not read (%s: %s); asked again", type(e).__name__, e)
        return {"?": 1}


def _broker_steps_back(settings):
    """The local broker (when this machine runs it) at the background priority for this run; what restores it."""
    from rollout.cores import step_back
    from streams.local_broker import LocalBroker

    local = LocalBroker.from_env(port=settings.local_port)
    pid = local.pid() if local.bootstrap == settings.bootstrap else None
    return step_back(pid) if pid else (lambda: None)


async def _loop(settings, args, plan, run, prefix, kw, rev0, ckdir, arena_args, progress,
                vllm_exited=lambda: False, server_up: asyncio.Future | None = None,
                arena_nice: int = 0) -> tuple[int, dict]:
    """Topics, revision 0, the services and the arena up (while ``server_up``, the inference server's start, runs;
    the arena waits for it to answer; at ``arena_nice``), then the arena to its end, then the services drained;
    the summary."""
    from consumers import settings as service_settings
    from consumers.registry import SERVICES
    from consumers.runner import System
    from producers.arena.limits import STOP_GRACE_S
    from producers.inference.children import die_with_parent_at
    from producers.inference.vllm_server import STARTUP_TIMEOUT_S
    from streams import topics
    from streams.revisions import publish

    progress.phase = "creating topics"
    await topics.create_topics(kw)
    # the plan's settings (its algorithm refused if nothing here runs it), with the demo's own pacing
    cfg = service_settings.build(plan=plan, credit=True, checkpoint_dir=str(ckdir), epochs=args.epochs,
                                 group_timeout_s=60, keep_checkpoints=DEMO_KEEP_CHECKPOINTS,
                                 **({"lr": args.lr} if args.lr is not None else {}))
    # the plan on revision 0, with the learning rate it trains at: what a derived run evaluates and trains by
    ran = plan.model_copy(update={"trainer": {**plan.trainer, "lr": cfg.lr}})
    await publish(kw, rev0.model_copy(update={"plan": ran.model_dump(mode="json")}))
    running = [n for n, s in SERVICES.items() if s.needed(cfg)]
    async with System(running, cfg, kw):
        stop_tail = asyncio.Event()
        tail = asyncio.create_task(_tail(kw, progress, stop_tail))
        env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": settings.bootstrap, "ROLLOUT_TOPIC_PREFIX": prefix}
        t0 = time.monotonic()
        # the arena starts (imports, environments, the broker) while the server does, and waits for it to answer
        arena = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "rollout.cli", "arena", args.plan, "--groups", str(args.groups), "--follow-revisions",
            "--evaluate", "--await-final-revision", "900", "--no-progress", "--run-id", run, *arena_args,
            *(["--eval-interval", str(args.eval_interval)] if args.eval_interval else []),
            *(["--await-servers", str(STARTUP_TIMEOUT_S)] if server_up is not None else []),
            *(["--until-revision", str(args.until_revision)] if getattr(args, "until_revision", None) else []),
            cwd=str(ROOT), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent_at(arena_nice))
        out = b""
        rc = 0
        try:
            if server_up is not None:
                progress.phase = "services up; waiting for vLLM"
                await server_up
            progress.phase = "generating and training"
            out, _ = await asyncio.wait_for(arena.communicate(), args.timeout)
            progress.phase = f"arena finished (rc {arena.returncode}); draining the services"

            # records short of a full batch are flushed as a partial one after flush_after_s: waited for, unless
            # every rollout was one record, none failed, and they filled whole batches (all trained: the arena
            # waited for the revision of the last one)
            done = _arena_stats(out) or {}
            whole = plan.one_record_per_rollout and done.get("failed", 1) == 0 and \
                done.get("rollouts", 1) % plan.batch_size == 0
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if not any((await _lags(kw, running)).values()):
                    if whole:
                        break
                    await asyncio.sleep(cfg.flush_after_s + 1.0)
                    if not any((await _lags(kw, running)).values()):
                        break
                await asyncio.sleep(1.0)
        except asyncio.TimeoutError:
            arena.kill()
            rc = 1
            print(f"rollout demo: the arena did not finish within {args.timeout:.0f}s (--timeout)", file=sys.stderr)
        except BaseException:  # vLLM did not start, or a signal cancelled this: no arena is left behind
            if arena.returncode is None:
                arena.terminate()  # its episodes in flight get STOP_GRACE_S to finish and be emitted
                try:
                    await asyncio.wait_for(arena.wait(), STOP_GRACE_S + 1.5)
                except asyncio.TimeoutError:
                    arena.kill()
                    await arena.wait()
            raise
        finally:
            stop_tail.set()
            await asyncio.gather(tail, return_exceptions=True)
    arena_out = out.decode(errors="replace")
    arena_stats = _arena_stats(out)
    for line in arena_out.splitlines():  # what the arena warned of (a final revision it did not see, and why)
        if line.startswith("rollout arena: warning:"):
            print(line, file=sys.stderr)
    if arena.returncode not in (0, None) or arena_stats is None:
        print(arena_out[-3000:], file=sys.stderr)
        rc = 1
        if vllm_exited():
            print(f"rollout demo: vLLM exited during the run; its log: {RUNS_DIR / run / 'vllm.log'}",
                  file=sys.stderr)
    summary = await _summary(kw, progress, arena_stats or {})
    summary.update(run=run, topic_prefix=prefix, policy=args.policy, arena_s=round(time.monotonic() - t0, 1),
                   plan=args.plan, family=plan.family, served_model=plan.served_model)
    return rc, summary


def _arena_stats(out: bytes) -> dict | None:
    """The JSON line the arena ends with."""
    lines = out.decode(errors="replace").splitlines()
    return next((json.loads(line) for line in reversed(lines) if line.startswith("{")), None)


async def _summary(kw, progress: Progress, arena_stats: dict) -> dict:
    from aiokafka import AIOKafkaConsumer

    from schemas import codec
    from streams import topics

    async def read(topic: str) -> list:
        c = AIOKafkaConsumer(topic, **kw, group_id=None, isolation_level="read_committed",
                             auto_offset_reset="earliest", max_partition_fetch_bytes=64 * 1024 * 1024)
        await c.start()
        out, idle = [], 0
        try:
            while idle < 3:
                got = await c.getmany(timeout_ms=300)
                n = sum(len(v) for v in got.values())
                idle = idle + 1 if n == 0 else 0
                for recs in got.values():
                    out.extend(codec.decode(r.value) for r in recs)
        finally:
            await c.stop()
        return out

    rollouts = await read(topics.ROLLOUTS.name)
    batches = await read(topics.TRAINER_BATCHES.name)
    letters = await read(topics.DEAD_LETTERS.name)
    r4 = lambda v: round(v, 4)  # noqa: E731
    history = [m for _, m in sorted(progress.revisions.items()) if m]  # each trained revision's step figures
    metrics = {str(k): {n: r4(x) for n, x in m.items()} for k, m in sorted(progress.revisions.items()) if m}
    return {
        "rollouts": sum(not r.evaluation for r in rollouts), "eval_rollouts": sum(r.evaluation for r in rollouts),
        "failed_rollouts": sum(r.status == "failed" for r in rollouts),
        "scored": progress.scored, "eval_scored": progress.eval_scored,
        "batches": len(batches), "records_in_batches": sum(len(b.records) for b in batches),
        "revisions": max(progress.revisions, default=0),
        "dead_letters": len(letters),
        "dead_letter_reasons": dict(Counter(f"{d.service}: {d.error_type}" for d in letters)),
        "eval_accuracy_by_revision": {str(k): r4(_mean(v)) for k, v in sorted(progress.evals.items())},
        "eval_questions_by_revision": {str(k): len(v) for k, v in sorted(progress.evals.items())},
        "mean_reward_by_revision": {str(k): r4(_mean(v)) for k, v in sorted(progress.train.items())},
        "reward_parts_by_revision": {n: {str(k): r4(_mean(v)) for k, v in sorted(p.items())}
                                     for n, p in progress.parts.items()},
        "rollouts_by_revision": {str(k): len(v) for k, v in sorted(progress.train.items())},
        "trainer_metrics_by_revision": metrics,
        "trainer_losses": [r4(h["loss"]) for h in history if "loss" in h][:50],
        "step_s": [round(h["step_s"], 2) for h in history if "step_s" in h],
        "reload_s": arena_stats.get("reload_s", []),
        "arena": {k: arena_stats.get(k) for k in ("rollouts", "evaluations", "failed", "completion_tokens",
                                                  "elapsed_s", "eval_s", "evaluated_revisions", "final_revision",
                                                  "final_revision_reached")},
    }


def _print_summary(s: dict) -> None:
    print(f"\nrun {s['run']} ({s['policy']}): rollouts {s['rollouts']} (+{s['eval_rollouts']} evaluation, "
          f"{s['failed_rollouts']} failed), batches {s['batches']} ({s['records_in_batches']} records), "
          f"revisions published {s['revisions']}, dead letters {s['dead_letters']} {s['dead_letter_reasons'] or ''}")
    if s.get("served_model"):
        print(f"model: {s['served_model']}: these results are that model's, not {s['family']}'s")
    evals = s["eval_accuracy_by_revision"]
    if evals:
        first, last = next(iter(evals)), list(evals)[-1]
        print(f"held-out eval accuracy (greedy, {s['eval_questions_by_revision'][first]} questions never trained on): "
              f"r{first} {evals[first]:.1%} -> r{last} {evals[last]:.1%}")
        print("  " + "  ".join(f"r{k} {v:.0%}" for k, v in evals.items()))
    names = list(s["reward_parts_by_revision"])
    print("training reward by the revision that generated the rollouts:")
    for rev, r in s["mean_reward_by_revision"].items():
        parts = "  ".join(f"{n} {s['reward_parts_by_revision'][n].get(rev, 0.0):.3f}" for n in names)
        m = s["trainer_metrics_by_revision"].get(str(int(rev) + 1), {})
        mm = (f"  step r{rev}->r{int(rev) + 1}: logprob mismatch mean {m['mismatch_mean']:.4f} "
              f"max {m['mismatch_max']:.3f}" if "mismatch_mean" in m else "")
        print(f"  r{rev:>3}: {r:.3f}  ({s['rollouts_by_revision'][rev]} rollouts)  {parts}{mm}")
    if s["step_s"]:
        steps = s["step_s"]
        print(f"trainer step: mean {sum(steps) / len(steps):.1f}s over {len(steps)} steps; weight reload into "
              f"the server: {', '.join(f'{x:.2f}' for x in s['reload_s'][:8])}{' ...' if len(s['reload_s']) > 8 else ''} s")
    print(f"wall time {s['seconds']:.0f}s\n")
    print("next: look at this run from the log")
    print("  .venv/bin/rollout runs                                # this run is listed first")
    print(f"  .venv/bin/rollout dashboard --prefix {s['topic_prefix']}    # its live page at http://127.0.0.1:8050")
    print("  .venv/bin/rollout replay --db run.duckdb              # the most recent run into DuckDB")
    print("  .venv/bin/rollout sql --db run.duckdb \"SELECT * FROM v_eval_accuracy_by_revision\"")
    print("  .venv/bin/rollout audit --db run.duckdb && .venv/bin/rollout report --db run.duckdb --out report.html")
