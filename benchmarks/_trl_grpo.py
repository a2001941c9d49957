"""TRL's side of ``python -m benchmarks peers``: GRPOTrainer on the job it is given; run in ``.venv-peers``.

    .venv-peers/bin/python benchmarks/_trl_grpo.py --job '<benchmarks.peers.Job as JSON>'

The task, held-out set, reward, GRPOConfig and evaluation cadence come from ``benchmarks.peers`` (this project,
on sys.path), so they cannot drift from the rollout-log side. The held-out set is answered greedily (``max_tokens``
of the plan, transformers' ``generate``, under bf16 autocast where the job says so) at the job's ``eval_steps`` (step 0 before the first
optimizer step, step k after revision k's last epoch), the steps the demo's arena evaluates. Ends with one JSON
line: eval accuracy by step, training reward by step, completion tokens, evaluation seconds apart from each
optimizer step's (generation included), timings.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the project on the path, and not this folder (run as a script, it would be sys.path[0]: benchmarks/vllm.py
# would hide the vllm package TRL imports)
sys.path[:] = [str(ROOT)] + [x for x in sys.path if Path(x or ".").resolve() != Path(__file__).resolve().parent]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--job", required=True, help="benchmarks.peers.Job as JSON")
    p.add_argument("--out", help="GRPOConfig.output_dir (default: a temporary folder)")
    a = p.parse_args(argv)
    t_start = time.perf_counter()

    import tempfile

    import psutil
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.peers import Job, exact_reward, grpo_config_kwargs, task
    from consumers.trainer import allocator
    from policy.hf import prepare_model

    j = Job(**json.loads(a.job))
    model_dir = str(prepare_model().path)
    system, train, held_out = task(j.plan)

    def messages(question: str) -> list[dict]:
        return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]

    data = Dataset.from_list([{"prompt": messages(q), "answer": ans} for q, ans in train])
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    eval_ids = [tok.apply_chat_template(messages(q), add_generation_prompt=True, tokenize=True, return_dict=False)
                for q, _ in held_out]
    stats = {"train_tokens": 0, "rewards": {}, "eval": {}, "eval_tokens": 0, "eval_s": 0.0, "step_s": []}

    def reward(prompts, completions, answer, completion_ids=None, trainer_state=None, **kw) -> list[float]:
        """The plan's exact-answer reward; counts the completion tokens generated for training."""
        stats["train_tokens"] += sum(len(c) for c in completion_ids or [])
        stats.setdefault("first_rollout_s", round(time.time() - psutil.Process().create_time(), 1))
        r = [exact_reward(c[-1]["content"] if isinstance(c, list) else c, ans) for c, ans in zip(completions, answer)]
        step = trainer_state.global_step if trainer_state is not None else -1
        stats["rewards"].setdefault(step, []).extend(r)
        return r

    @torch.no_grad()
    def evaluate(model, step: int) -> None:
        t0 = time.perf_counter()
        was = model.training
        model.eval()
        width = max(len(x) for x in eval_ids)
        ids = torch.full((len(eval_ids), width), tok.pad_token_id)
        mask = torch.zeros_like(ids)
        for i, x in enumerate(eval_ids):
            ids[i, width - len(x):] = torch.tensor(x)
            mask[i, width - len(x):] = 1
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=j.bf16):
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=j.max_tokens,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, top_p=None,
                                 top_k=None, temperature=None, use_cache=True)
        right = 0
        for row, (_, ans) in zip(out[:, width:], held_out):
            row = row.tolist()
            row = row[:row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row
            stats["eval_tokens"] += len(row)
            right += exact_reward(tok.decode(row, skip_special_tokens=True), ans)
        stats["eval"][step] = right / len(held_out)
        stats["eval_s"] += time.perf_counter() - t0
        model.train(was)
        print(f"trl: step {step} eval accuracy {stats['eval'][step]:.1%} ({time.perf_counter() - t0:.1f}s)",
              file=sys.stderr, flush=True)

    eval_steps = set(j.eval_steps)

    class Evaluate(TrainerCallback):
        t_step = 0.0

        def on_train_begin(self, args, state, control, model=None, **kw):
            if 0 in eval_steps:
                evaluate(model, 0)

        def on_step_begin(self, args, state, control, **kw):
            self.t_step = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kw):
            stats["step_s"].append(round(time.perf_counter() - self.t_step, 2))
            # a revision's last epoch (what the demo would publish), at one of the steps the demo evaluates
            if state.global_step % j.epochs == 0 and state.global_step // j.epochs in eval_steps:
                evaluate(model, state.global_step // j.epochs)

    with tempfile.TemporaryDirectory(prefix="peers-trl-") as tmp:
        config = GRPOConfig(**grpo_config_kwargs(j, a.out or tmp))
        trainer = GRPOTrainer(model=model_dir, reward_funcs=reward, args=config, train_dataset=data,
                              processing_class=tok, callbacks=[Evaluate()])
        t_loop = time.perf_counter()
        trainer.train()
        loop_s = time.perf_counter() - t_loop
    out = {
        "eval_accuracy": stats["eval"], "eval_questions": len(held_out),
        "train_reward": {k: round(sum(v) / len(v), 4) for k, v in sorted(stats["rewards"].items())},
        "steps": trainer.state.global_step // j.epochs, "loop_s": round(loop_s, 1),
        "eval_s": round(stats["eval_s"], 1), "train_completion_tokens": stats["train_tokens"],
        "all_completion_tokens": stats["train_tokens"] + stats["eval_tokens"], "step_s": stats["step_s"],
        "script_s": round(time.perf_counter() - t_start, 1), "first_rollout_s": stats.get("first_rollout_s"),
        "trl": __import__("trl").__version__,
        "generation": "transformers generate",
        "allocator": allocator.name(),
    }
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
