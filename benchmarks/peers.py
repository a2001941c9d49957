"""The whole loop beside TRL's GRPOTrainer on the same job: eval accuracy per step, wall time, tokens/s.

    python -m benchmarks peers [--quick] [--steps N] [--only rollout-log|trl] [--timeout S]

One job, both sides (issue 27): the demo's plan (``examples/plans/arithmetic-smollm2.toml`` through
``rollout.demo.PROFILES["vllm"]``) on the packaged SmolLM2-135M-Instruct; the arithmetic task and its
held-out set from the plan's environment (``producers.environment.environment_from_spec``: one generator, the
same 2,000 training and 48 held-out questions); exact-answer reward (``consumers.scoring.extract``, what the
ExactMatch verifier runs); group size, records per step, learning rate, clip, epochs, max tokens, temperature
and steps from ``job()`` (the plan, the demo's profile, the reference trainer's defaults).

* rollout-log: ``rollout demo --groups G --lr L --epochs E --no-progress`` (G = steps x batch / group size),
  a subprocess: vLLM on CPU (its start is in the wall time), arena, verifier, credit, batcher, trainer; the
  held-out set answered greedily through vLLM by every revision. Kafka (ROLLOUT_BOOTSTRAP_SERVERS, else the
  local broker, ROLLOUT_KAFKA_PORT) is up before the clock starts.
* TRL: ``GRPOTrainer`` (trl 1.16.0) with its own generation (transformers' ``generate``), in its own virtual
  environment ``.venv-peers/`` made here on first use (``ensure_trl_venv``: a ``.pth`` file reuses this
  project's torch and transformers; pip installs only trl and what it adds); ``benchmarks/_trl_grpo.py`` runs
  there and evaluates the model on the same held-out set after every optimizer step, greedy, through
  transformers' ``generate`` under bf16 autocast (the demo evaluates through vLLM in bf16).

Figures for each side: eval accuracy at each step, wall time (whole subprocess, and its loop alone), completion
tokens generated for training and their rate over the wall time. Ends with a markdown table, a mermaid
``xychart-beta`` of the two curves, and one JSON line. The target: rollout-log reaches TRL's eval accuracy at
equal steps in at most TRL's wall time.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRL_VERSION = "1.16.0"
TRL_VENV = ROOT / ".venv-peers"


@dataclass(frozen=True)
class Job:
    """Everything both sides must agree on, in one place."""

    plan: str                # the GenerationPlan (task, group size, batch, sampling)
    steps: int               # revisions the demo trains = TRL's optimizer steps / epochs
    group_size: int          # completions per prompt
    batch_records: int       # completions per optimizer step (a multiple of group_size)
    lr: float
    epochs: int              # optimizer passes over each batch
    clip: float              # PPO/GRPO clip epsilon
    max_grad_norm: float
    weight_decay: float
    temperature: float
    max_tokens: int
    max_off_policy_steps: int  # the demo's pipelining bound (TRL is on-policy: 0)
    seed: int = 0

    @property
    def groups(self) -> int:
        """Groups the demo's arena admits for ``steps`` revisions."""
        return self.steps * self.batch_records // self.group_size


def job(steps: int | None = None) -> Job:
    """The demo's job (its vLLM profile and plan, the reference trainer's defaults); ``steps`` revisions
    (default: as many as the demo's default groups give)."""
    from consumers.trainer import ReferenceTrainer
    from rollout.demo import PROFILES
    from schemas.plan_compiler import compile_plan

    prof = PROFILES["vllm"]
    plan = compile_plan(prof.plan)
    defaults = inspect.signature(ReferenceTrainer.__init__).parameters
    sampling = plan.learner.sampling
    if plan.batch_size % plan.group_size:
        raise ValueError(f"batch_size {plan.batch_size} is not a multiple of group_size {plan.group_size}")
    return Job(plan=prof.plan, steps=steps or prof.groups * plan.group_size // plan.batch_size,
               group_size=plan.group_size, batch_records=plan.batch_size,
               lr=float(plan.trainer.get("lr", prof.lr)), epochs=prof.epochs,
               clip=float(defaults["clip"].default), max_grad_norm=float(defaults["max_grad_norm"].default),
               weight_decay=float(plan.trainer.get("weight_decay", defaults["weight_decay"].default)),
               temperature=float(sampling.get("temperature", 1.0)), max_tokens=int(sampling["max_tokens"]),
               max_off_policy_steps=plan.max_off_policy_steps)


def grpo_config_kwargs(j: Job, output_dir: str) -> dict[str, Any]:
    """Our job as ``trl.GRPOConfig`` keyword arguments (trl 1.16.0's names), closest to the reference trainer:

    * one optimizer step = ``batch_records`` completions, ``batch_records / group_size`` prompts, generated for
      that step (no accumulation, no reuse across steps but the epochs);
    * ``num_iterations`` = epochs, and TRL counts each pass as a step: ``max_steps`` = steps x epochs;
    * loss ``dapo``: token-level clipped objective summed over the batch and divided by its completion tokens,
      as ``ReferenceTrainer.loss``; ``beta`` 0 (no KL, no reference model); symmetric clip;
    * advantages ``(r - group mean) / (group std + eps)`` (``scale_rewards="group"``; TRL's std is Bessel-corrected
      and its eps 1e-4, ours the population std and 1e-6: not settable);
    * AdamW (torch), constant learning rate, no warmup, the same weight decay and grad-norm clip;
    * sampling at the plan's temperature, no top-p/top-k; float32 weights, bf16 autocast, on the CPU;
    * no gradient checkpointing (TRL's default is on; the reference trainer keeps its activations).
    """
    if j.batch_records % j.group_size:
        raise ValueError(f"batch_records {j.batch_records} is not a multiple of group_size {j.group_size}")
    return dict(
        output_dir=output_dir, use_cpu=True, bf16=True, seed=j.seed,
        model_init_kwargs={"dtype": "float32"},
        num_generations=j.group_size, per_device_train_batch_size=j.batch_records,
        gradient_accumulation_steps=1, steps_per_generation=1,
        num_iterations=j.epochs, max_steps=j.steps * j.epochs,
        max_completion_length=j.max_tokens, temperature=j.temperature, top_p=1.0, top_k=0,
        repetition_penalty=1.0,
        beta=0.0, epsilon=j.clip, epsilon_high=j.clip, loss_type="dapo", scale_rewards="group",
        learning_rate=j.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=j.weight_decay,
        max_grad_norm=j.max_grad_norm, optim="adamw_torch",
        gradient_checkpointing=False,  # TRL's default is True; the reference trainer keeps its activations
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0,
    )


def exact_reward(text: str, answer: str) -> float:
    """The plan's exact-answer reward on a reply: ExactMatch with ``extract="last_integer"``, its code."""
    from consumers.scoring import answer_reward

    return answer_reward(text, answer, "last_integer")


def task(plan: str) -> tuple[str | None, list[tuple[str, str]], list[tuple[str, str]]]:
    """(system prompt, training (question, answer)s, held-out (question, answer)s) of the plan's one environment."""
    from producers.environment import environment_from_spec
    from schemas.plan_compiler import compile_plan

    specs = compile_plan(plan).environments
    if len(specs) != 1:
        raise ValueError(f"{plan}: peers compares one environment, the plan has {len(specs)}")
    env = environment_from_spec(specs[0])
    system = getattr(env.episode, "system_prompt", None)
    return (system, [(e.prompt, e.answer) for e in env.dataset], [(e.prompt, e.answer) for e in env.eval_dataset])


# -- TRL's own virtual environment -----------------------------------------------------------------------------

def ensure_trl_venv(venv: Path = TRL_VENV, version: str = TRL_VERSION, log=print) -> Path:
    """``venv``'s python with trl ``version``, made if needed: ``python -m venv``, a ``.pth`` naming this
    environment's site-packages (torch, transformers, the project's own dependencies are not installed again),
    then ``pip install trl==version`` (it adds datasets, pandas and a few more, there only)."""
    py = venv / "bin" / "python"
    if py.exists():
        r = subprocess.run([str(py), "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.strip() == version:
            return py
    if not py.exists():
        log(f"peers: creating {venv} (TRL's own virtual environment)")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "_rollout_log_project.pth").write_text(str(Path(sysconfig.get_paths()["purelib"]).resolve()) + "\n")
    log(f"peers: pip install trl=={version} into {venv}")
    subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", f"trl=={version}"],
                   check=True)
    return py


# -- the two sides ---------------------------------------------------------------------------------------------

def _last_json(out: str) -> dict | None:
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def run_rollout_log(j: Job, timeout: float, log=print) -> dict:
    cmd = [sys.executable, "-m", "rollout.cli", "demo", "--plan", j.plan, "--groups", str(j.groups),
           "--lr", repr(j.lr), "--epochs", str(j.epochs), "--no-progress", "--timeout", str(timeout)]
    from streams.config import KafkaSettings, ensure_broker

    bootstrap = ensure_broker(KafkaSettings.from_env())  # up before the clock starts: Kafka is not the job's
    log(f"peers: Kafka at {bootstrap}; " + " ".join(cmd[1:]))
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout + 600,
                       env={**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": bootstrap})
    wall = time.perf_counter() - t0
    s = _last_json(p.stdout)
    if p.returncode != 0 or s is None:
        raise RuntimeError(f"rollout demo exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    s["load_before"], s["load_after"] = load0, os.getloadavg()  # other work on the machine shows here
    trained_tokens = sum(int(m.get("tokens", 0)) for m in s["trainer_metrics_by_revision"].values())
    arena = s.get("arena") or {}
    return {
        "eval_accuracy": {int(k): v for k, v in s["eval_accuracy_by_revision"].items()},
        "eval_questions": {int(k): v for k, v in s["eval_questions_by_revision"].items()},
        "train_reward": {int(k): v for k, v in s["mean_reward_by_revision"].items()},
        "steps": s["revisions"], "wall_s": round(wall, 1), "loop_s": s.get("arena_s"),
        "train_completion_tokens": trained_tokens,
        "all_completion_tokens": arena.get("completion_tokens"),  # evaluation answers included
        "step_s": s.get("step_s"), "run": s.get("run"), "failed_rollouts": s.get("failed_rollouts"),
        "load_before": [round(x, 2) for x in s["load_before"]], "load_after": s["load_after"],
    }


def run_trl(j: Job, timeout: float, log=print) -> dict:
    py = ensure_trl_venv(log=log)
    cmd = [str(py), str(ROOT / "benchmarks" / "_trl_grpo.py"), "--job", json.dumps(asdict(j))]
    log("peers: .venv-peers/bin/python benchmarks/_trl_grpo.py --job ...")
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    wall = time.perf_counter() - t0
    s = _last_json(p.stdout)
    if p.returncode != 0 or s is None:
        raise RuntimeError(f"TRL exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    s["eval_accuracy"] = {int(k): v for k, v in s["eval_accuracy"].items()}
    s["train_reward"] = {int(k): v for k, v in s["train_reward"].items()}
    s["wall_s"] = round(wall, 1)
    s["load_before"], s["load_after"] = [round(x, 2) for x in load0], os.getloadavg()
    return s


# -- the report ------------------------------------------------------------------------------------------------

def table(j: Job, ours: dict | None, trl: dict | None) -> str:
    rows = ["| step | rollout-log eval accuracy | TRL eval accuracy |", "|---:|---:|---:|"]
    pct = lambda d, k: f"{d['eval_accuracy'][k]:.1%}" if d and k in d["eval_accuracy"] else "—"  # noqa: E731
    rows += [f"| {k} | {pct(ours, k)} | {pct(trl, k)} |" for k in range(j.steps + 1)]
    rows += ["", "| | rollout-log | TRL |", "|---|---:|---:|"]
    get = lambda d, k, f="{}": f.format(d[k]) if d and d.get(k) is not None else "—"  # noqa: E731
    rows += [f"| wall time, whole run (s) | {get(ours, 'wall_s')} | {get(trl, 'wall_s')} |",
             f"| wall time, the loop (s) | {get(ours, 'loop_s')} | {get(trl, 'loop_s')} |",
             f"| completion tokens generated for training | {get(ours, 'train_completion_tokens')} | "
             f"{get(trl, 'train_completion_tokens')} |",
             f"| generated tokens/s (training tokens / whole wall) | {get(ours, 'tokens_per_s')} | "
             f"{get(trl, 'tokens_per_s')} |",
             f"| load average (1, 5, 15 min) before / after | {get(ours, 'load_before')} / {get(ours, 'load_after')} "
             f"| {get(trl, 'load_before')} / {get(trl, 'load_after')} |"]
    return "\n".join(rows)


def chart(j: Job, ours: dict | None, trl: dict | None) -> str:
    def series(d: dict | None) -> str:
        return ", ".join(f"{100 * d['eval_accuracy'][k]:.1f}" if d and k in d["eval_accuracy"] else "0"
                         for k in range(j.steps + 1))

    return "\n".join([
        "```mermaid", "xychart-beta",
        '    title "Held-out eval accuracy (%) by optimizer step (first line: rollout-log, second: TRL)"',
        f"    x-axis \"step\" [{', '.join(str(k) for k in range(j.steps + 1))}]",
        '    y-axis "eval accuracy (%)" 0 --> 100',
        f"    line [{series(ours)}]", f"    line [{series(trl)}]", "```"])


def verdict(j: Job, ours: dict | None, trl: dict | None) -> dict:
    if not ours or not trl:
        return {}
    last = j.steps
    a, b = ours["eval_accuracy"].get(last), trl["eval_accuracy"].get(last)
    return {"final_step": last, "rollout_log_final": a, "trl_final": b,
            "accuracy_met": a is not None and b is not None and a >= b,
            "wall_met": ours["wall_s"] <= trl["wall_s"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks peers", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="2 steps (a smoke run of both sides)")
    p.add_argument("--steps", type=int, help="optimizer steps (revisions) on each side (default: the demo's 24)")
    p.add_argument("--only", choices=["rollout-log", "trl"], help="run one side only")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds each side may take (default 3600)")
    args = p.parse_args(argv)
    j = job(2 if args.quick and not args.steps else args.steps)
    print(f"peers: job {json.dumps(asdict(j))}", flush=True)
    t0 = time.perf_counter()
    ours = trl = None
    keep = ROOT / ".state" / "peers"  # each side's figures as soon as it ends: the other side may still fail
    keep.mkdir(parents=True, exist_ok=True)
    if args.only in (None, "trl"):
        trl = run_trl(j, args.timeout)
        (keep / "trl.json").write_text(json.dumps(trl))
    if args.only in (None, "rollout-log"):
        ours = run_rollout_log(j, args.timeout)
        (keep / "rollout-log.json").write_text(json.dumps(ours))
    for d in (ours, trl):
        if d:
            d["tokens_per_s"] = round(d["train_completion_tokens"] / d["wall_s"], 1)
            d["load_after"] = [round(x, 2) for x in d["load_after"]]
    print(table(j, ours, trl), flush=True)
    print(chart(j, ours, trl), flush=True)
    out = {"job": asdict(j), "rollout_log": ours, "trl": trl, "verdict": verdict(j, ours, trl), "quick": args.quick,
           "wall_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(out))
    return 0
