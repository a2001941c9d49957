"""The whole loop beside TRL's GRPOTrainer on the same job: eval accuracy, wall and evaluation time, peak memory.

    python -m benchmarks peers [--quick] [--steps N] [--eval-interval N] [--runs N] [--only rollout-log|trl]
                               [--timeout S]

One job, both sides (issue 27): the demo's plan (``examples/plans/arithmetic-smollm2.toml`` through
``rollout.demo.PROFILES["vllm"]``) on the packaged SmolLM2-135M-Instruct; the arithmetic task and its
held-out set from the plan's environment (``producers.environments.loader.environment_from_spec``: one generator, the
same 2,000 training and 48 held-out questions); exact-answer reward (``consumers.scoring.extract``, what the
ExactMatch verifier runs); group size, records per step, learning rate, clip, epochs, max tokens, temperature,
steps and the evaluation cadence from ``job()`` (the plan, the demo's profile, the reference trainer's defaults).
Both sides answer the held-out set greedily at the same steps, ``Job.eval_steps``: every
``[orchestrator.eval] interval`` of the plan (``--eval-interval`` for another) and the last step, by the arena's
own rule (``schemas.plan.eval_due_at``). After every step, evaluation through transformers' ``generate`` took
about a quarter of TRL's loop on a 2-core CPU (114 s of 459 s): a side by side needs one cadence.

* rollout-log: ``rollout demo --groups G --lr L --epochs E --eval-interval I --no-progress`` (G = steps x batch /
  group size), a subprocess: vLLM on CPU (its start is in the wall time), arena, verifier, credit, batcher,
  trainer; the held-out set answered through vLLM. Kafka (ROLLOUT_BOOTSTRAP_SERVERS, else the local broker,
  ROLLOUT_KAFKA_PORT) is up before the clock starts, and its memory is not counted: it is not the job's.
* TRL: ``GRPOTrainer`` (trl 1.16.0) with its own generation (transformers' ``generate``), in its own virtual
  environment ``.venv-peers/`` made here on first use (``ensure_trl_venv``: a ``.pth`` file reuses this
  project's torch and transformers; pip installs only trl and what it adds); ``benchmarks/_trl_grpo.py`` runs
  there and answers the held-out set through transformers' ``generate`` (under bf16 autocast where the CPU has
  native bf16, as the demo's vLLM then serves bf16; float32 on both sides elsewhere). It runs on glibc's malloc,
  as it ships; ``--trl-allocator tcmalloc`` preloads tcmalloc, which our trainer's process runs on
  (``consumers.trainer.allocator``), so the trainers compare like for like (TRL's figures say which: ``allocator``).

Figures for each side and run: eval accuracy at each evaluated step; wall time (whole subprocess, and its loop);
evaluation time (TRL: its ``generate`` calls; rollout-log: the arena's ``eval_s``, while training rollouts in
flight and the trainer go on beside it, so its loop less evaluation is a lower bound of its training time); the
mean train step (TRL: generation and optimizer step; rollout-log: the trainer's optimizer step, generation runs
beside it); completion tokens generated for training and their rate over the wall time; peak memory of every
process of the side (``TreeRss``: the subprocess and its descendants, vLLM and the arena included, sampled from
/proc every 0.5 s): the peak of their summed RSS (the issue's measure), of their summed PSS (pages shared
between processes counted once) and the largest single process. ``--runs N`` alternates the two
sides N times (TRL first in the 1st, 3rd, ... run, rollout-log first in the others) and reports min / median /
max. Ends with a markdown table, a mermaid ``xychart-beta`` of the two median curves, and one JSON line (every
run's figures and their summary). The targets (issue 34, ``verdict``): rollout-log's eval accuracy at the last step
at most one held-out question below TRL's, in at most TRL's wall time, with at most 1.5x its peak memory.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

from producers.host import pss, tree_rss

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
    clip: float              # PPO/GRPO clip epsilon (TRL's epsilon; the plan's trl objective's)
    max_grad_norm: float
    weight_decay: float
    temperature: float
    max_tokens: int
    max_off_policy_steps: int  # the demo's pipelining bound (TRL is on-policy: 0)
    eval_interval: int         # the held-out set is answered every this many steps (the plan's cadence)...
    eval_skip_first_step: bool  # ... from step 0 unless this, and at the last step
    bf16: bool                 # bf16 autocast (and vLLM in bf16): only where this CPU has native bf16 (cpu_bf16)
    seed: int = 0
    loss_type: str = "dapo"    # TRL's normalisation (the plan's trl objective's)

    @property
    def groups(self) -> int:
        """Groups the demo's arena admits for ``steps`` revisions."""
        return self.steps * self.batch_records // self.group_size

    @property
    def eval_steps(self) -> list[int]:
        """The steps both sides answer the held-out set at: the arena's rule, with the last step the run's last."""
        from schemas.plan import eval_due_at

        return [s for s in range(self.steps + 1)
                if eval_due_at(s, self.eval_interval, self.eval_skip_first_step, last=self.steps)]


def job(steps: int | None = None, eval_interval: int | None = None) -> Job:
    """The demo's job (its vLLM profile and plan, the reference trainer's defaults); ``steps`` revisions
    (default: as many as the demo's default groups give), evaluated every ``eval_interval`` (default: the plan's)."""
    from consumers.trainer.step import ReferenceTrainer
    from policy.hf import cpu_bf16
    from rollout.demo import PROFILES
    from schemas.plan_compiler import compile_plan

    prof = PROFILES["vllm"]
    plan = compile_plan(prof.plan)
    defaults = inspect.signature(ReferenceTrainer.__init__).parameters
    objective = plan.objective
    if objective.type != "trl" or objective.epsilon_high not in (None, objective.epsilon):
        raise ValueError(f"{prof.plan} trains with {objective.type!r}: the side by side needs the plan's "
                         "[trainer.loss] to be TRL's (type = \"trl\", a symmetric epsilon)")
    sampling = plan.learner.sampling
    if plan.batch_size % plan.group_size:
        raise ValueError(f"batch_size {plan.batch_size} is not a multiple of group_size {plan.group_size}")
    return Job(plan=prof.plan, steps=steps or prof.groups * plan.group_size // plan.batch_size,
               group_size=plan.group_size, batch_records=plan.batch_size,
               lr=float(plan.trainer.get("lr", prof.lr)), epochs=prof.epochs,
               clip=objective.epsilon, loss_type=objective.loss_type, max_grad_norm=float(plan.optimizer.max_norm),
               weight_decay=float(plan.trainer.get("weight_decay", defaults["weight_decay"].default)),
               temperature=float(sampling.get("temperature", 1.0)), max_tokens=int(sampling["max_tokens"]),
               max_off_policy_steps=plan.max_off_policy_steps, eval_interval=eval_interval or plan.eval_interval,
               eval_skip_first_step=plan.eval_skip_first_step, bf16=cpu_bf16())


def grpo_config_kwargs(j: Job, output_dir: str) -> dict[str, Any]:
    """Our job as ``trl.GRPOConfig`` keyword arguments (trl 1.16.0's names), closest to the reference trainer:

    * one optimizer step = ``batch_records`` completions, ``batch_records / group_size`` prompts, generated for
      that step (no accumulation, no reuse across steps but the epochs);
    * ``num_iterations`` = epochs, and TRL counts each pass as a step: ``max_steps`` = steps x epochs;
    * the plan's ``trl`` objective (``[trainer.loss] type = "trl"``: the demo's ``dapo``, token-level clipped
      objective summed over the batch and divided by its completion tokens), TRL's own computation on both sides
      (``tests/test_objectives.py``); ``beta`` 0 (no KL, no reference model); symmetric clip. The demo generates
      with vLLM, so its side also applies TRL's vLLM importance weight (TRL's default with vLLM); TRL here
      generates with transformers, where it has none;
    * advantages ``(r - group mean) / (group std + eps)`` (``scale_rewards="group"``; TRL's std is Bessel-corrected
      and its eps 1e-4, ours the population std and 1e-6: not settable);
    * AdamW (torch), constant learning rate, no warmup, the same weight decay and grad-norm clip;
    * sampling at the plan's temperature, no top-p/top-k; float32 weights on the CPU, bf16 autocast where the
      CPU has native bf16 (the rule the demo's trainer and vLLM follow: ``policy.hf.cpu_bf16``), float32 elsewhere;
    * no gradient checkpointing (TRL's default is on; the reference trainer keeps its activations).
    """
    if j.batch_records % j.group_size:
        raise ValueError(f"batch_records {j.batch_records} is not a multiple of group_size {j.group_size}")
    return dict(
        output_dir=output_dir, use_cpu=True, bf16=j.bf16, seed=j.seed,
        model_init_kwargs={"dtype": "float32"},
        num_generations=j.group_size, per_device_train_batch_size=j.batch_records,
        gradient_accumulation_steps=1, steps_per_generation=1,
        num_iterations=j.epochs, max_steps=j.steps * j.epochs,
        max_completion_length=j.max_tokens, temperature=j.temperature, top_p=1.0, top_k=0,
        repetition_penalty=1.0,
        beta=0.0, epsilon=j.clip, epsilon_high=j.clip, loss_type=j.loss_type, scale_rewards="group",
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
    from producers.environments.loader import environment_from_spec
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


# -- measuring a side -------------------------------------------------------------------------------------------

class TreeRss:
    """The memory of a process and all its descendants while it runs, sampled every ``every_s`` in a thread: the
    peak of their summed RSS (a page shared by several processes counts in each, as RSS does), the peak of their
    summed PSS (such a page counted once in all: vLLM's engine core forked from a server that imported the same
    modules shares most of its pages with it), and the largest single process, with its command line."""

    def __init__(self, pid: int, every_s: float = 0.5) -> None:
        self.pid, self.every_s = pid, every_s
        self.peak_sum = self.peak_one = self.peak_pss = 0
        self.peak_one_cmd = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, daemon=True)

    def __enter__(self) -> TreeRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _sample_until_stopped(self) -> None:
        while True:
            rss = tree_rss(self.pid)
            self.peak_sum = max(self.peak_sum, sum(rss.values()))
            self.peak_pss = max(self.peak_pss, sum(pss(pid) for pid in rss))
            pid, one = max(rss.items(), key=lambda kv: kv[1], default=(0, 0))
            if one > self.peak_one:
                self.peak_one, self.peak_one_cmd = one, _cmdline(pid)
            if self._stop.wait(self.every_s):
                return

    def figures(self) -> dict[str, Any]:
        return {"peak_rss_mb": round(self.peak_sum / 2**20), "peak_pss_mb": round(self.peak_pss / 2**20),
                "peak_rss_process_mb": round(self.peak_one / 2**20),
                "peak_rss_process": self.peak_one_cmd}


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
    except OSError:
        return "?"


def _last_json(out: str) -> dict | None:
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def measure(cmd: list[str], timeout: float, env: dict[str, str], what: str) -> dict:
    """Run ``cmd`` in the project to its end: the JSON line it ends with, plus its wall time, the load averages
    around it and its process tree's memory (``TreeRss``). Raises, with its output's tail, if it fails."""
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p, \
            TreeRss(p.pid) as memory:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            raise
    wall = time.perf_counter() - t0
    s = _last_json(out)
    if p.returncode != 0 or s is None:
        raise RuntimeError(f"{what} exited {p.returncode}:\n{out[-3000:]}\n{err[-3000:]}")
    return {"json": s, "wall_s": round(wall, 1), "load_before": [round(x, 2) for x in load0],
            "load_after": [round(x, 2) for x in os.getloadavg()], **memory.figures()}


def _timings(d: dict) -> dict:
    """``d`` with what both sides derive alike: the loop less evaluation, the mean train step, tokens/s."""
    d["train_s"] = round(d["loop_s"] - d["eval_s"], 1) if None not in (d.get("loop_s"), d.get("eval_s")) else None
    d["step_s_mean"] = round(statistics.mean(d["step_s"]), 2) if d.get("step_s") else None
    d["tokens_per_s"] = round(d["train_completion_tokens"] / d["wall_s"], 1)
    return d


# -- the two sides ---------------------------------------------------------------------------------------------

def run_rollout_log(j: Job, timeout: float, log=print) -> dict:
    cmd = [sys.executable, "-m", "rollout.cli", "demo", "--plan", j.plan, "--groups", str(j.groups),
           "--lr", repr(j.lr), "--epochs", str(j.epochs), "--eval-interval", str(j.eval_interval), "--no-progress",
           "--timeout", str(timeout)]
    from streams.config import KafkaSettings, ensure_broker

    bootstrap = ensure_broker(KafkaSettings.from_env())  # up before the clock starts: Kafka is not the job's
    log(f"peers: Kafka at {bootstrap}; " + " ".join(cmd[1:]))
    m = measure(cmd, timeout + 600, {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": bootstrap}, "rollout demo")
    s = m.pop("json")
    trained_tokens = sum(int(t.get("tokens", 0)) for t in s["trainer_metrics_by_revision"].values())
    arena = s.get("arena") or {}
    return _timings({
        "eval_accuracy": {int(k): v for k, v in s["eval_accuracy_by_revision"].items()},
        "eval_questions": {int(k): v for k, v in s["eval_questions_by_revision"].items()},
        "train_reward": {int(k): v for k, v in s["mean_reward_by_revision"].items()},
        "steps": s["revisions"], "loop_s": s.get("arena_s"), "eval_s": arena.get("eval_s"),
        "train_completion_tokens": trained_tokens,
        "all_completion_tokens": arena.get("completion_tokens"),  # evaluation answers included
        "step_s": s.get("step_s"), "run": s.get("run"), "failed_rollouts": s.get("failed_rollouts"),
        "first_rollout_s": s.get("first_rollout_s"), "eval_s_each": arena.get("eval_s_each"), **m,
    })


def trl_environment(allocator: str = "glibc") -> dict[str, str]:
    """TRL's process environment, offline. ``allocator``: "glibc" (TRL as it ships) or "tcmalloc", preloaded as our
    trainer's process runs on it (``consumers.trainer.allocator``), to compare the two trainers like for like."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if allocator == "tcmalloc":
        from consumers.trainer import allocator as malloc

        preloaded = malloc.preload(env.get("LD_PRELOAD"))
        if preloaded is None:
            raise SystemExit("peers: --trl-allocator tcmalloc, but no tcmalloc library here (bash .ci/setup "
                             "installs Debian's libtcmalloc-minimal4)")
        env["LD_PRELOAD"] = preloaded
    return env


def run_trl(j: Job, timeout: float, log=print, allocator: str = "glibc") -> dict:
    py = ensure_trl_venv(log=log)
    cmd = [str(py), str(ROOT / "benchmarks" / "_trl_grpo.py"), "--job", json.dumps(asdict(j))]
    env = trl_environment(allocator)
    log(f"peers: .venv-peers/bin/python benchmarks/_trl_grpo.py --job ... (on {allocator}'s malloc)")
    m = measure(cmd, timeout, env, "TRL")
    s = m.pop("json")
    s["eval_accuracy"] = {int(k): v for k, v in s["eval_accuracy"].items()}
    s["train_reward"] = {int(k): v for k, v in s["train_reward"].items()}
    return _timings({**s, **m})


SIDES: dict[str, Callable[..., dict]] = {"trl": run_trl, "rollout-log": run_rollout_log}


# -- the report ------------------------------------------------------------------------------------------------

# the figures summarised over runs: JSON name -> (table row, how to read it from one run's figures)
FIGURES: dict[str, tuple[str, Callable[[dict], Any]]] = {
    "wall_s": ("wall time, whole run (s)", lambda d: d["wall_s"]),
    "loop_s": ("wall time, the loop (s)", lambda d: d.get("loop_s")),
    "eval_s": ("evaluation (s)", lambda d: d.get("eval_s")),
    "first_rollout_s": ("the first training rollout, from the command's start (s; TRL: its first reward call)",
                        lambda d: d.get("first_rollout_s")),
    "train_s": ("the loop less evaluation (s)", lambda d: d.get("train_s")),
    "step_s_mean": ("train step, mean (s; TRL: generation + optimizer, rollout-log: optimizer)",
                    lambda d: d.get("step_s_mean")),
    "peak_rss_mb": ("peak RSS, all processes summed (MB)", lambda d: d.get("peak_rss_mb")),
    "peak_pss_mb": ("peak PSS, all processes summed (MB; shared pages counted once)", lambda d: d.get("peak_pss_mb")),
    "peak_rss_process_mb": ("peak RSS, largest process (MB)", lambda d: d.get("peak_rss_process_mb")),
    "train_completion_tokens": ("completion tokens generated for training", lambda d: d["train_completion_tokens"]),
    "tokens_per_s": ("generated tokens/s (training tokens / whole wall)", lambda d: d["tokens_per_s"]),
    "load_before": ("load average (1 min) before", lambda d: d["load_before"][0]),
    "load_after": ("load average (1 min) after", lambda d: d["load_after"][0]),
}


def spread(values: list[float]) -> dict[str, float] | None:
    """min / median / max of one figure over the runs (None without any)."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)} if values else None


def summarize(j: Job, runs: list[dict]) -> dict | None:
    """Each figure's ``spread`` over one side's runs, eval accuracy at each evaluated step included."""
    if not runs:
        return None
    out: dict[str, Any] = {k: spread([v for d in runs if (v := read(d)) is not None]) for k, (_, read) in
                           FIGURES.items()}
    out["eval_accuracy"] = {k: spread([d["eval_accuracy"][k] for d in runs if k in d["eval_accuracy"]])
                            for k in j.eval_steps}
    return out


def _cell(sp: dict | None, fmt: str = "{}") -> str:
    if sp is None:
        return "—"
    if sp["min"] == sp["max"]:
        return fmt.format(sp["median"])
    return f"{fmt.format(sp['median'])} ({fmt.format(sp['min'])}–{fmt.format(sp['max'])})"


def table(j: Job, ours: dict | None, trl: dict | None) -> str:
    """Markdown from the two sides' ``summarize``: the median, with (min–max) where the runs differ."""
    acc = lambda d, k: _cell(d["eval_accuracy"].get(k), "{:.1%}") if d else "—"  # noqa: E731
    rows = ["| step | rollout-log eval accuracy | TRL eval accuracy |", "|---:|---:|---:|"]
    rows += [f"| {k} | {acc(ours, k)} | {acc(trl, k)} |" for k in j.eval_steps]
    rows += ["", "| | rollout-log | TRL |", "|---|---:|---:|"]
    rows += [f"| {label} | {_cell(ours and ours[k])} | {_cell(trl and trl[k])} |" for k, (label, _) in FIGURES.items()]
    return "\n".join(rows)


def chart(j: Job, ours: dict | None, trl: dict | None) -> str:
    def series(d: dict | None) -> str:
        return ", ".join(f"{100 * d['eval_accuracy'][k]['median']:.1f}" if d and d["eval_accuracy"].get(k) else "0"
                         for k in j.eval_steps)

    return "\n".join([
        "```mermaid", "xychart-beta",
        '    title "Held-out eval accuracy (%, median) by optimizer step (first line: rollout-log, second: TRL)"',
        f"    x-axis \"step\" [{', '.join(str(k) for k in j.eval_steps)}]",
        '    y-axis "eval accuracy (%)" 0 --> 100',
        f"    line [{series(ours)}]", f"    line [{series(trl)}]", "```"])


def verdict(j: Job, ours: dict | None, trl: dict | None, questions: int | None = None) -> dict:
    """On the medians, issue 34's targets: rollout-log's final eval accuracy at most one of the ``questions``
    held-out questions below TRL's (counted in questions: the accuracies are rounded fractions), in at most TRL's
    wall time, with at most 1.5x its peak memory (all processes)."""
    if not ours or not trl:
        return {}
    last = j.steps
    a, b = ((d["eval_accuracy"].get(last) or {}).get("median") for d in (ours, trl))
    n = questions or 1
    return {"final_step": last, "rollout_log_final": a, "trl_final": b, "questions": questions,
            "accuracy_met": a is not None and b is not None and round(a * n) >= round(b * n) - (1 if questions else 0),
            "wall_met": ours["wall_s"]["median"] <= trl["wall_s"]["median"],
            "memory_met": ours["peak_rss_mb"]["median"] <= 1.5 * trl["peak_rss_mb"]["median"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks peers", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="2 steps (a smoke run of both sides)")
    p.add_argument("--steps", type=int, help="optimizer steps (revisions) on each side (default: the demo's 24)")
    p.add_argument("--eval-interval", type=int, metavar="N",
                   help="both sides answer the held-out set every N steps from step 0, and at the last step "
                        "(default: the demo plan's [orchestrator.eval] interval, 8)")
    p.add_argument("--runs", type=int, default=1, metavar="N",
                   help="run both sides N times, alternating which goes first; min / median / max of each figure")
    p.add_argument("--only", choices=list(SIDES), help="run one side only")
    p.add_argument("--seed", type=int, default=0,
                   help="TRL's seed for the first run (its data order and sampling; default 0); run k uses seed + k, "
                        "so TRL's spread is over seeds. "
                        "rollout-log's arena draws its questions with seed 0, but vLLM on a CPU samples unseeded "
                        "(rollout arena --help, --gpu-vllm), so its runs differ")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds each side may take (default 3600)")
    p.add_argument("--trl-allocator", choices=["glibc", "tcmalloc"], default="glibc",
                   help="the malloc TRL runs on: glibc (default: TRL as it ships) or tcmalloc, which rollout-log's "
                        "trainer runs on (consumers/trainer/allocator.py), to compare the trainers like for like")
    args = p.parse_args(argv)
    from policy.hf import cpu_kind

    if args.runs < 1 or (args.eval_interval is not None and args.eval_interval < 1):
        p.error("--runs and --eval-interval must be >= 1")
    j = replace(job(2 if args.quick and not args.steps else args.steps, args.eval_interval), seed=args.seed)
    described = {**asdict(j), "eval_steps": j.eval_steps}
    print(f"peers: job {json.dumps(described)}", flush=True)
    t0 = time.perf_counter()
    sides = [s for s in SIDES if args.only in (None, s)]
    runs: dict[str, list[dict]] = {s: [] for s in SIDES}
    keep = ROOT / ".state" / "peers"  # each side's figures as soon as a run ends: a later one may still fail
    keep.mkdir(parents=True, exist_ok=True)
    print(f"peers: cpu {cpu_kind()}", flush=True)
    for k in range(args.runs):
        for side in sides if k % 2 == 0 else sides[::-1]:
            # TRL is seeded: each run its own seed (--seed, --seed + 1, ...), so its spread is over seeds
            trl = side == "trl"
            runs[side].append(SIDES[side](replace(j, seed=j.seed + k) if trl else j, args.timeout,
                                          **({"allocator": args.trl_allocator} if trl else {})))
            (keep / f"{side}.json").write_text(json.dumps(runs[side]))
    ours, trl = summarize(j, runs["rollout-log"]), summarize(j, runs["trl"])
    print(table(j, ours, trl), flush=True)
    print(chart(j, ours, trl), flush=True)
    out = {"job": described, "cpu": cpu_kind(), "runs": args.runs, "rollout_log": runs["rollout-log"], "trl": runs["trl"],
           "summary": {"rollout_log": ours, "trl": trl}, "verdict": verdict(j, ours, trl, next((r.get("eval_questions") for r in runs["trl"]), None)), "quick": args.quick,
           "wall_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(out))
    return 0
