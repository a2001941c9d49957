"""On-policy distillation (prime-rl's opd): a trained revision of an earlier demo as the teacher, revision 0 the student.

    python -m benchmarks distill --teacher RUN_OR_CHECKPOINT [--steps N] [--eval-interval N] [--lr LR]

The teacher is a checkpoint folder, or a `rollout demo` run (its ID under .state/demo/, or that folder): the run's
last checkpoint. It is served by its own vLLM (``rollout serve vllm``'s server, port 8001) under its checkpoint's
name, which carries the checkpoint's digest, so every ``RolloutReferenced`` on the log names the revision that
scored its tokens. The student is ``rollout demo --plan examples/plans/arithmetic-smollm2-opd.toml``: the demo's
task, the packaged model at revision 0, trained by the reverse KL to the teacher (``ref_kl``) on its own samples, no
reward in the loss. The student answers the demo's 48 held-out questions greedily every ``--eval-interval``
revisions; the teacher's accuracy on the same questions is what the demo that trained it reported
(``--teacher-accuracy``, printed beside the curve).

Ends with the student's curve beside the teacher's and one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "examples" / "plans" / "arithmetic-smollm2-opd.toml"
TEACHER_PORT = 8001  # the example plan's teacher base_url


def teacher_checkpoint(given: str) -> Path:
    """A checkpoint folder as given, else the newest whole-model checkpoint of a demo run (its folder, or its ID)."""
    from policy.hf import WEIGHTS
    from rollout.demo import RUNS_DIR

    path = Path(given) if Path(given).exists() else RUNS_DIR / given
    if (path / WEIGHTS).is_file():
        return path
    # names sort by revision (<family>-r<revision, 6 digits>-<digest>); a LoRA adapter's folder holds no WEIGHTS
    found = sorted(p for p in (path / "checkpoints").glob("*-r*") if (p / WEIGHTS).is_file())
    if not found:
        raise SystemExit(f"distill: no checkpoint at {given} (nor a demo run of that ID under {RUNS_DIR})")
    return found[-1]


def plan_for(teacher_name: str, folder: Path) -> Path:
    """The example plan with its teacher named as served here."""
    text = PLAN.read_text()
    named = text.replace('name = "teacher"', f'name = "{teacher_name}"')
    if named == text:
        raise SystemExit(f"distill: {PLAN} no longer names its teacher 'teacher': update this benchmark")
    out = folder / PLAN.name
    out.write_text(named)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks distill", description=__doc__.split("\n")[0])
    p.add_argument("--teacher", required=True, metavar="RUN_OR_CHECKPOINT",
                   help="a checkpoint folder, or a demo run (ID or folder under .state/demo): its newest checkpoint")
    p.add_argument("--teacher-accuracy", type=float, metavar="FRACTION",
                   help="the teacher's held-out accuracy, printed beside the student's curve (the demo run that "
                        "trained it reports it)")
    p.add_argument("--steps", type=int, default=16, help="the student's optimizer steps (default 16)")
    p.add_argument("--eval-interval", type=int, default=4, metavar="N", help="held-out every N revisions (default 4)")
    p.add_argument("--lr", type=float, default=None, help="the student's learning rate (default: the demo's)")
    p.add_argument("--timeout", type=float, default=3600.0)
    args = p.parse_args(argv)

    from benchmarks.peers import measure
    from producers.inference.vllm_server import VllmServer
    from streams.config import KafkaSettings, ensure_broker

    ckpt = teacher_checkpoint(args.teacher)
    name = ckpt.name
    with tempfile.TemporaryDirectory(prefix="distill-") as tmp:
        plan = plan_for(name, Path(tmp))
        cmd = [sys.executable, "-m", "rollout.cli", "demo", "--plan", str(plan), "--groups", str(args.steps * 4),
               "--eval-interval", str(args.eval_interval), "--no-progress", "--timeout", str(args.timeout),
               *(["--lr", repr(args.lr)] if args.lr else [])]

        async def serve_and_run() -> dict:
            server = VllmServer(ckpt, port=TEACHER_PORT, served_model_name=name, log_path=Path(tmp) / "teacher.log")
            print(f"distill: teacher {ckpt} served as {name!r} at {server.base_url}", flush=True)
            await server.start()
            try:
                bootstrap = ensure_broker(KafkaSettings.from_env())
                print("distill: " + " ".join(cmd[1:]), flush=True)
                return await asyncio.to_thread(measure, cmd, args.timeout + 600,
                                               {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": bootstrap},
                                               "rollout demo (student)")
            finally:
                await server.stop()

        m = asyncio.run(serve_and_run())
    s = m.pop("json")
    curve = {int(k): v for k, v in s["eval_accuracy_by_revision"].items()}
    questions = {int(k): v for k, v in s["eval_questions_by_revision"].items()}
    print("| revision | student held-out accuracy |\n|---:|---:|")
    for rev in sorted(curve):
        print(f"| {rev} | {curve[rev]:.1%} ({round(curve[rev] * questions[rev])} of {questions[rev]}) |")
    if args.teacher_accuracy is not None:
        print(f"| teacher ({name}) | {args.teacher_accuracy:.1%} |")
    metrics = s.get("trainer_metrics_by_revision", {})
    print(json.dumps({"teacher": str(ckpt), "teacher_served_as": name, "teacher_accuracy": args.teacher_accuracy,
                      "student_accuracy": curve, "questions": questions, "run": s.get("run"),
                      "ref_kl": {k: v.get("ref_kl") for k, v in metrics.items()},
                      "train_reward": s.get("mean_reward_by_revision"), "revisions": s.get("revisions"), **m}))
    return 0
