"""How a trainer step's time and peak memory grow with the tokens it trains and the model's size, ours beside TRL's.

    python -m benchmarks growth [--models 135m,360m,1b] [--tokens 1024,2048,4096,8192,16384]
                                [--dtypes float32,bfloat16] [--sides ours,trl,trl_gc] [--max-tflop 40] [--limit-gb 18]

Each point is one optimizer step on one batch, in a fresh process (so its peak is its own), of a random-init Llama
of one of three shapes (``MODELS``: SmolLM2-135M's own config, SmolLM2-360M's, and Llama-3.2-1B's layers with
SmolLM2's 49k vocabulary) on a batch of ``tokens / 512`` records of 512 tokens (a 64-token prompt shared by a group
of up to 8, 448 completion tokens, all trained), the same batch and objective on both sides:

* ``ours``: ``consumers.trainer.ReferenceTrainer.step`` with TRL's objective (``[trainer.loss] type = "trl"``,
  ``dapo``), its micro-batches of ``consumers.settings.MICRO_BATCH_TOKENS`` and a group's prompt run once, as the
  trainer service runs it;
* ``trl``: TRL 1.16's ``GRPOTrainer`` on the same model and rows (``beta`` 0, no gradient checkpointing, as
  ``benchmarks.peers`` configures it), one step of its own inner loop: ``compute_loss`` under its autocast, the
  accelerator's backward, the grad-norm clip and AdamW; generation is left out on both sides;
* ``trl_gc``: the same with TRL's default gradient checkpointing (``GRPOConfig.gradient_checkpointing``, switched
  on as ``Trainer.train`` does): TRL's memory as a user who keeps its defaults gets it.

bf16 is autocast over float32 weights on both sides (``ROLLOUT_CPU_DTYPE`` for ours, ``GRPOConfig.bf16`` for TRL);
``--dtypes`` defaults to float32 and, where the CPU multiplies bf16 natively (``policy.hf.cpu_bf16``), bfloat16.
A warm-up step of two records (AdamW's moments allocated, kernels chosen) comes before the timed one; the peak is
the process's high-water RSS over its whole life (model, optimizer state and the timed step; nothing is shared with
another process, so RSS is its PSS). A point whose nominal FLOPs (6 x parameters x tokens) exceed ``--max-tflop`` is
skipped and says so; a process whose RSS passes ``--limit-gb`` is killed (a 24 GB machine's user is not) and the
point reads "over the limit" with the RSS it had reached: which side fails first at a shape.

Prints one line per point as it ends, then a table and each line's slope (least squares: seconds and MB per 1k
tokens; seconds per 100M parameters at each token count measured on every model) on stderr; ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from consumers.trainer import allocator

ROOT = Path(__file__).resolve().parents[1]
# the shapes' overrides of the packaged SmolLM2-135M config (head_dim 64, tied embeddings, 49,152 tokens)
MODELS = {
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3),
    "360m": dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
                 num_key_value_heads=5),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8),
}
VOCAB, HEAD_DIM = 49152, 64
PROMPT, COMPLETION = 64, 448  # every record's tokens
GROUP = 8  # records sharing a prompt, at most


def parameters(model: str) -> int:
    """The shape's parameter count (tied embeddings), without building it."""
    m = MODELS[model]
    h, heads, kv = m["hidden_size"], m["num_attention_heads"], m["num_key_value_heads"]
    layer = h * heads * HEAD_DIM * 2 + 2 * h * kv * HEAD_DIM + 3 * h * m["intermediate_size"] + 2 * h
    return VOCAB * h + m["num_hidden_layers"] * layer + h


def _config(model: str) -> Any:
    from transformers import AutoConfig

    from policy.hf import prepare_model

    config = AutoConfig.from_pretrained(prepare_model().path)
    for k, v in MODELS[model].items():
        setattr(config, k, v)
    return config


def _rows(tokens: int, seed: int = 0) -> tuple[Any, Any, int]:
    """Prompts (records x PROMPT, one per group) and completions (records x COMPLETION), and the group size."""
    import torch

    records = max(1, tokens // (PROMPT + COMPLETION))
    group = min(GROUP, records)
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, VOCAB, (-(-records // group), PROMPT), generator=g).repeat_interleave(group, 0)
    return prompts[:records], torch.randint(3, VOCAB, (records, COMPLETION), generator=g), group


def _ours(model: Any, tmp: str) -> Any:
    """One step of the reference trainer on the rows: returns a function of (prompts, completions, group)."""
    import numpy as np

    from consumers.trainer.models import HFPolicy
    from consumers.trainer.step import ReferenceTrainer
    from consumers.trainer.tensors import to_tensors
    from schemas.batch import assemble_batch
    from schemas.events import TrainingRecord
    from schemas.objectives import TrlLoss
    from schemas.policy import CheckpointRef, PolicyRef, PolicyRevision

    trainer = ReferenceTrainer(model, "bench", 1, tmp, kind=HFPolicy, lr=1e-6, weight_decay=0.0,
                               objective=TrlLoss(loss_type="dapo", max_completion_length=COMPLETION,
                                                 vllm_importance_sampling_correction=False))
    target = PolicyRevision(run_id="bench", producer="bench", family="bench", revision=1,
                            checkpoint=CheckpointRef(uri="file:///unused", digest="0" * 64))
    rng = np.random.default_rng(0)

    def step(prompts: Any, completions: Any, group: int) -> None:
        records = [TrainingRecord(
            run_id="bench", producer="bench", record_id=f"r{i}", rollout_id=f"ro{i}", step_ids=["s"],
            member_id="solver", group_id=f"g{i // group}", environment="bench@1",
            policy=PolicyRef(family="bench", revision=1), prompt_token_ids=p.numpy().astype(np.int32),
            completion_token_ids=c.numpy().astype(np.int32),
            completion_logprobs=-rng.exponential(2.0, COMPLETION).astype(np.float32),
            loss_mask=np.ones(COMPLETION, np.uint8), reward=float(rng.random()), advantage=float(rng.normal()),
            credit="grpo") for i, (p, c) in enumerate(zip(prompts, completions))]
        batch = assemble_batch(records, target, 1, run_id="bench", producer="bench")
        trainer.step(to_tensors(batch), batch)

    return step


def _trl(model: Any, tmp: str, bf16: bool, records: int, group: int, checkpointing: bool) -> Any:
    """One step of TRL's GRPOTrainer inner loop on the rows (its ``training_step`` less generation)."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from policy.hf import prepare_model

    args = GRPOConfig(output_dir=tmp, use_cpu=True, bf16=bf16, per_device_train_batch_size=records,
                      num_generations=group, max_completion_length=COMPLETION, loss_type="dapo", beta=0.0,
                      epsilon=0.2, learning_rate=1e-6, lr_scheduler_type="constant", weight_decay=0.0,
                      max_grad_norm=1.0, optim="adamw_torch", report_to=[], gradient_accumulation_steps=1,
                      steps_per_generation=1, gradient_checkpointing=checkpointing, model_init_kwargs=None)
    trl = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                      train_dataset=Dataset.from_dict({"prompt": ["x"] * records}),
                      processing_class=AutoTokenizer.from_pretrained(prepare_model().path))
    if checkpointing:  # what Trainer.train does first
        trl.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
    trl.current_gradient_accumulation_steps = 1
    trl.create_optimizer()

    def step(prompts: Any, completions: Any, group: int) -> None:
        mask = torch.ones_like(completions)
        inputs = {"prompt_ids": prompts, "prompt_mask": torch.ones_like(prompts), "completion_ids": completions,
                  "completion_mask": mask, "advantages": torch.randn(len(prompts)), "old_per_token_logps": None,
                  "num_items_in_batch": mask.sum()}
        trl.model.train()
        with trl.compute_loss_context_manager():
            loss = trl.compute_loss(trl.model, inputs)
        trl.accelerator.backward(loss)
        torch.nn.utils.clip_grad_norm_(trl.model.parameters(), 1.0)
        trl.optimizer.step()
        trl.optimizer.zero_grad(set_to_none=True)

    return step


def _point(model: str, tokens: int, side: str) -> dict:
    """One point in this process (the dtype from ROLLOUT_CPU_DTYPE, set by the parent)."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.trainer_step import hwm_mb
    from policy.hf import cpu_bf16

    bf16 = cpu_bf16()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    net = AutoModelForCausalLM.from_config(_config(model), dtype=torch.float32)
    prompts, completions, group = _rows(tokens)
    with tempfile.TemporaryDirectory(prefix="bench-growth-") as tmp:
        step = _ours(net, tmp) if side == "ours" else \
            _trl(net, tmp, bf16, len(prompts), group, checkpointing=side == "trl_gc")
        load_s, loaded_mb = time.perf_counter() - t0, hwm_mb()
        step(prompts[:2], completions[:2], min(2, group))  # the warm-up: AdamW's moments, the kernels
        t0 = time.perf_counter()
        step(prompts, completions, group)
        step_s = time.perf_counter() - t0
    n = sum(p.numel() for p in net.parameters())
    return {"model": model, "params": n, "tokens": len(prompts) * (PROMPT + COMPLETION), "records": len(prompts),
            "dtype": "bfloat16" if bf16 else "float32", "side": side, "step_s": round(step_s, 2),
            "peak_mb": round(hwm_mb()), "after_load_mb": round(loaded_mb), "load_s": round(load_s, 1),
            "nominal_tflop": round(6 * n * tokens / 1e12, 2),
            "gflops": round(6 * n * tokens / step_s / 1e9, 1), "threads": torch.get_num_threads(),
            "allocator": allocator.name()}


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _child(model: str, tokens: int, dtype: str, side: str, limit_mb: float, timeout_s: float) -> dict:
    """The point in a fresh process, killed if its RSS passes ``limit_mb`` or it runs past ``timeout_s``."""
    cmd = [sys.executable, "-m", "benchmarks", "growth", "--child", f"{model},{tokens},{side}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ROLLOUT_CPU_DTYPE": dtype}
    base = {"model": model, "params": parameters(model), "tokens": tokens, "dtype": dtype, "side": side}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, text=True)
        peak, t0 = 0.0, time.monotonic()
        while proc.poll() is None:
            peak = max(peak, _rss_mb(proc.pid))
            if peak > limit_mb or time.monotonic() - t0 > timeout_s:
                proc.kill()
                proc.wait()
                why = f"over the limit: RSS reached {peak / 1024:.1f} GB" if peak > limit_mb \
                    else f"ran past {timeout_s:.0f} s"
                return {**base, "error": why, "peak_mb": round(peak)}
            time.sleep(0.1)
        out.seek(0)
        err.seek(0)
        if proc.returncode:
            return {**base, "error": (err.read().strip().splitlines() or ["?"])[-1],
                    "returncode": proc.returncode}
        return json.loads(out.read().strip().splitlines()[-1])


def _slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of y against x."""
    if len(points) < 2:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else None


def slopes(rows: list[dict]) -> list[dict]:
    """Per (model, dtype, side): seconds and MB per 1k tokens; per (tokens, dtype, side) over the models measured:
    seconds per 100M parameters."""
    ok = [r for r in rows if "error" not in r and "skipped" not in r]
    out = []
    for key in sorted({(r["model"], r["dtype"], r["side"]) for r in ok}):
        line = [r for r in ok if (r["model"], r["dtype"], r["side"]) == key]
        s = _slope([(r["tokens"] / 1000, r["step_s"]) for r in line])
        m = _slope([(r["tokens"] / 1000, r["peak_mb"]) for r in line])
        if s is not None:
            out.append({"model": key[0], "dtype": key[1], "side": key[2], "points": len(line),
                        "s_per_1k_tokens": round(s, 3), "mb_per_1k_tokens": round(m, 1)})
    for key in sorted({(r["tokens"], r["dtype"], r["side"]) for r in ok}):
        line = [r for r in ok if (r["tokens"], r["dtype"], r["side"]) == key]
        s = _slope([(r["params"] / 1e8, r["step_s"]) for r in line])
        if s is not None:
            out.append({"tokens": key[0], "dtype": key[1], "side": key[2], "points": len(line),
                        "s_per_100m_params": round(s, 3)})
    return out


def table(rows: list[dict]) -> str:
    """Ours beside TRL's, one line per (model, dtype, tokens)."""
    lines = ["| model | dtype | tokens | ours step s | TRL step s | ours / TRL | ours peak MB | TRL peak MB | "
             "TRL+ckpt step s | TRL+ckpt peak MB |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    by = {(r["model"], r["dtype"], r["tokens"], r["side"]): r for r in rows}

    def cell(r: dict | None, key: str) -> str:
        if r is None:
            return "-"
        if "skipped" in r:
            return "skipped"
        if "error" in r:
            return r["error"]
        return f"{r[key]:,}"

    for m, d, t in sorted({k[:3] for k in by}, key=lambda k: (list(MODELS).index(k[0]), k[1], k[2])):
        ours, trl, gc = (by.get((m, d, t, side)) for side in ("ours", "trl", "trl_gc"))
        ratio = f"{ours['step_s'] / trl['step_s']:.2f}" if ours and trl and "step_s" in ours and "step_s" in trl \
            else "-"
        lines.append(f"| {m} | {d} | {t:,} | {cell(ours, 'step_s')} | {cell(trl, 'step_s')} | {ratio} | "
                     f"{cell(ours, 'peak_mb')} | {cell(trl, 'peak_mb')} | {cell(gc, 'step_s')} | {cell(gc, 'peak_mb')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks growth", description=__doc__.split("\n\n")[0],
                                epilog="Each point runs alone in its own process: run nothing else meanwhile.")
    p.add_argument("--quick", action="store_true", help="the 135m shape at 1,024 and 2,048 tokens, the first dtype")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    p.add_argument("--tokens", default="1024,2048,4096,8192,16384", help="tokens a step, comma-separated")
    p.add_argument("--dtypes", default=None, help="float32,bfloat16 (default: float32, and bfloat16 where the "
                                                  "CPU has native bf16)")
    p.add_argument("--sides", default="ours,trl", help="comma-separated: ours, trl, trl_gc (TRL with its default "
                                                       "gradient checkpointing)")
    p.add_argument("--max-tflop", type=float, default=40.0,
                   help="skip points of more nominal TFLOP than this (6 x parameters x tokens; a 2-core CPU does "
                        "0.1-0.3 TFLOP/s)")
    p.add_argument("--limit-gb", type=float, default=18.0,
                   help="kill a point whose RSS passes this many GB (default 18: room left on a 24 GB machine)")
    p.add_argument("--timeout", type=float, default=1800.0, help="kill a point running longer (seconds)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        model, tokens, side = a.child.split(",")
        if side == "ours":  # on the allocator our trainer's process runs on; TRL's side as it ships (glibc's)
            allocator.reexec()
        print(json.dumps(_point(model, int(tokens), side)), flush=True)
        return 0
    from policy.hf import cpu_bf16

    native = cpu_bf16() if "ROLLOUT_CPU_DTYPE" not in os.environ else None
    dtypes = a.dtypes.split(",") if a.dtypes else ["float32"] + (["bfloat16"] if native else [])
    models, tokens = a.models.split(","), [int(x) for x in a.tokens.split(",")]
    if a.quick:
        models, tokens, dtypes = ["135m"], [1024, 2048], dtypes[:1]
    points = [(m, t, d, s) for m in models for d in dtypes for t in tokens for s in a.sides.split(",")]
    rows, t0 = [], time.monotonic()
    for i, (m, t, d, s) in enumerate(points, 1):
        tflop = 6 * parameters(m) * t / 1e12
        if tflop > a.max_tflop:
            r = {"model": m, "params": parameters(m), "tokens": t, "dtype": d, "side": s,
                 "skipped": f"{tflop:.0f} nominal TFLOP > --max-tflop {a.max_tflop:g}"}
        else:
            r = _child(m, t, d, s, a.limit_gb * 1024, a.timeout)
        rows.append(r)
        what = r.get("skipped") or r.get("error") or f"step {r['step_s']} s, peak {r['peak_mb']:,} MB"
        print(f"[{i}/{len(points)} {time.monotonic() - t0:.0f}s] {m} {d} {s} {t:,} tokens: {what}",
              file=sys.stderr, flush=True)
    fits = slopes(rows)
    print(table(rows), file=sys.stderr)
    for f in fits:
        print(json.dumps(f), file=sys.stderr)
    print(json.dumps({"benchmark": "growth", "quick": a.quick, "cpu_bf16": native, "rows": rows, "slopes": fits,
                      "wall_s": round(time.monotonic() - t0, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
