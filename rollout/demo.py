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

    rollout demo                      # vLLM + SmolLM2-135M-Instruct, 2.5-8 minutes on 2 cores
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
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from rollout.argtypes import at_least
from rollout.run_summary import arena_stats_from, print_summary, summarize
from rollout.run_view import Progress, follow_log, show_progress

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
                   help="give up on the arena after this many seconds (default 3600: the default run took 8 min on "
                        "2 AVX2-only cores, where the trainer and vLLM run in float32, 2026-12-07)")
    add_loop_flags(p)
    p.add_argument("--no-progress", action="store_true", help="no live progress line")
    p.set_defaults(func=cmd_demo, trains=True)


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
    """The loop (``_demo``), the broker starting beside its first steps; every expected failure is one line
    naming ``command``."""
    from streams.config import KafkaSettings, broker_starting

    settings = KafkaSettings.from_env()
    where = "configured cluster" if settings.external else "local broker"
    settings, broker_up = broker_starting(settings)
    broker_up.add_done_callback(lambda f: f.exception() or print(f"Kafka: {where} at {settings.bootstrap}",
                                                                 flush=True))
    from policy.hf import ModelUnavailable
    from producers.inference.vllm_server import VllmStartError
    from consumers.settings import PlanRefused
    from producers.environments.loader import EnvironmentUnavailable
    from schemas.plan import PlanError

    try:
        return asyncio.run(_demo(settings, args, broker_up))
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


def last_revision(plan, groups: int) -> int | None:
    """The run's last revision: the plan's ``max_steps``, else what ``groups`` fill when every rollout is one record
    and they fill whole batches (the arena's own count, ``Pacer.final_revision``). Told to the trainer only, not
    written into the plan on revision 0 (a run derived from it trains on): the trainer writes no training state
    there, where the run is over and drops its states (1.3 s of both cores beside the last evaluation)."""
    if plan.max_steps is not None or not plan.one_record_per_rollout or plan.token_batch_size:
        return plan.max_steps
    rollouts = groups * plan.group_size
    return rollouts // plan.batch_size if rollouts % plan.batch_size == 0 else None


def context_length(plan, model_dir: Path) -> int:
    """vLLM's context: the recipe's ``[inference.vllm] max_model_len``, else its ``seq_len``, else 2048; at most what
    the model was trained for."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    wanted = plan.server.get("max_model_len") or plan.seq_len or 2048
    return min(int(wanted), int(config.get("max_position_embeddings") or 2048))


# -- the run ----------------------------------------------------------------------------------------------

async def _demo(settings, args, broker_up: Future) -> int:
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
            return await _run(settings, args, run, prefix, broker_up, stopping=lambda: bool(caught))
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


async def _run(settings, args, run: str, prefix: str, broker_up: Future, stopping=lambda: False) -> int:
    """The run, its first steps (the plan, the model, vLLM's start) beside the broker's start (``broker_up``), which
    is awaited where Kafka is first needed."""
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
    view = asyncio.create_task(show_progress(progress, stop_view, not args.no_progress))
    vllm = metrics = serving = None
    arena_args: list[str] = []
    cores = "shared"  # with no vLLM started here, nothing to divide, unless --cores turns says so
    arena_nice, restore_broker = 0, lambda: None
    try:
        if args.policy == "vllm":
            from producers.metrics import endpoint, vllm_samples
            from producers.inference.vllm_server import VllmServer

            progress.phase = "preparing the model"
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
            rev0 = await computed(initial_revision, family, ckdir, run_id=run, served=served)  # beside vLLM's start
            if cores == "turns":
                plan = plan.model_copy(update={"max_off_policy_steps": 0})
                arena_args += ["--max-off-policy-steps", "0"]
                arena_nice = BACKGROUND_NICE
            arena_args += ["--policy", "vllm", "--policy-url", url]
        else:
            from policy.checkpoint import checkpoint_path

            rev0 = await computed(initial_revision, family, ckdir, seed=0, run_id=run)
            arena_args = ["--policy", "local", "--policy-port", "0",
                          "--checkpoint", str(checkpoint_path(rev0.checkpoint))]
        await asyncio.wrap_future(broker_up)  # the first step that needs Kafka
        if cores == "turns":
            restore_broker = _broker_steps_back(settings)
        rc, summary = await _loop(settings, args, plan, run, prefix, kw, rev0, ckdir, arena_args, progress,
                                  vllm_exited=lambda: vllm is not None and vllm.stopped, server_up=serving,
                                  arena_nice=arena_nice, policy_url=url if args.policy == "vllm" else None)
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
    if summary.get("first_rollout_at") is not None:  # from the process's start: the broker's and imports included
        import psutil

        summary["first_rollout_s"] = round(summary["first_rollout_at"] - psutil.Process().create_time(), 1)
    summary["cores"] = cores
    print_summary(summary)
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


def initial_revision(*args, **kwargs):
    """``consumers.trainer.step.initial_revision``, imported where it runs (the torch thread): torch's import (about
    a second) then runs while vLLM starts, not before it."""
    from consumers.trainer.step import initial_revision as revision_0

    return revision_0(*args, **kwargs)


def _broker_steps_back(settings):
    """The local broker (when this machine runs it) at the background priority for this run; what restores it."""
    from rollout.cores import step_back
    from streams.local_broker import LocalBroker

    local = LocalBroker.from_env(port=settings.local_port)
    pid = local.pid() if local.bootstrap == settings.bootstrap else None
    return step_back(pid) if pid else (lambda: None)


async def _loop(settings, args, plan, run, prefix, kw, rev0, ckdir, arena_args, progress,
                vllm_exited=lambda: False, server_up: asyncio.Future | None = None,
                arena_nice: int = 0, policy_url: str | None = None) -> tuple[int, dict]:
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
    last = last_revision(plan, args.groups)
    cfg = service_settings.build(plan=plan, credit=True, checkpoint_dir=str(ckdir), epochs=args.epochs,
                                 group_timeout_s=60, keep_checkpoints=DEMO_KEEP_CHECKPOINTS, policy_url=policy_url,
                                 **({"lr": args.lr} if args.lr is not None else {}),
                                 **({"max_steps": last} if last is not None else {}))
    # the plan on revision 0, with the learning rate it trains at: what a derived run evaluates and trains by
    ran = plan.model_copy(update={"trainer": {**plan.trainer, "lr": cfg.lr}})
    await publish(kw, rev0.model_copy(update={"plan": ran.model_dump(mode="json")}))
    running = [n for n, s in SERVICES.items() if s.needed(cfg)]
    async with System(running, cfg, kw):
        stop_tail = asyncio.Event()
        tail = asyncio.create_task(follow_log(kw, progress, stop_tail))
        env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": settings.bootstrap, "ROLLOUT_TOPIC_PREFIX": prefix}
        t0 = time.monotonic()
        # the arena starts (imports, environments, the broker) while the server does, and waits for it to answer;
        # it runs in the project's folder, so the plan goes by its absolute path (a user's may be relative)
        arena = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "rollout.cli", "arena", os.path.abspath(args.plan), "--groups", str(args.groups),
            "--follow-revisions", "--evaluate", "--await-final-revision", "900", "--no-progress", "--run-id", run,
            *arena_args,
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
            done = arena_stats_from(out) or {}
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
    arena_stats = arena_stats_from(out)
    for line in arena_out.splitlines():  # what the arena warned of (a final revision it did not see, and why)
        if line.startswith("rollout arena: warning:"):
            print(line, file=sys.stderr)
    if arena.returncode not in (0, None) or arena_stats is None:
        print(arena_out[-3000:], file=sys.stderr)
        rc = 1
        if vllm_exited():
            print(f"rollout demo: vLLM exited during the run; its log: {RUNS_DIR / run / 'vllm.log'}",
                  file=sys.stderr)
    summary = await summarize(kw, progress, arena_stats or {})
    summary.update(run=run, topic_prefix=prefix, policy=args.policy, arena_s=round(time.monotonic() - t0, 1),
                   plan=args.plan, family=plan.family, served_model=plan.served_model)
    return rc, summary
