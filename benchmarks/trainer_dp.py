"""The reference trainer on 1 rank and on N (FSDP2, gloo on this CPU): the same batches, weights compared, step time, memory.

    python -m benchmarks trainer_dp [--quick] [--ranks 2] [--records 16] [--steps 3]

Both sides run the same program under torchrun (``--nproc-per-node 1``: the single-process trainer, no
group; ``N``: ``consumers.trainer.distributed``), on the packaged SmolLM2-135M-Instruct and a batch of its own
sampled-token logprobs (so the importance ratios start at 1, as on-policy). Figures: each side's seconds per
step (step + publish: the checkpoint and training state written), its peak resident memory per rank, and
the distance between the two sides' float32 weights after the last step, relative to how far the steps
moved them (``drift``; 0 would be bit-equal). The single trainer's own rounding floor is measured beside it:
one rank again, the same batches with their rows in reverse order (``floor``): the same sums in another
order, which under bf16 autocast and Adam's per-weight normalisation is not small.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rank_program(argv: list[str]) -> int:
    """What each rank runs (``--rank``): open the trainer on the checkpoint, train and publish each batch."""
    p = argparse.ArgumentParser()
    p.add_argument("--rank", action="store_true")
    p.add_argument("--batches", required=True)
    p.add_argument("--ref", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--lr", type=float, default=1e-3)
    a = p.parse_args(argv)
    import torch.distributed as dist

    from consumers.trainer import distributed
    from consumers.trainer.step import open_trainer
    from consumers.trainer.tensors import to_tensors
    from schemas import codec
    from schemas.events import TrainerBatch
    from schemas.policy import CheckpointRef

    group = distributed.launch() if distributed.world_size() > 1 else None
    batches = [codec.decode(b, TrainerBatch) for b in _read_frames(Path(a.batches))]
    ref = CheckpointRef.model_validate_json(a.ref)
    trainer = open_trainer(ref=ref, revision=batches[0].target.revision, family=batches[0].family,
                                       checkpoint_dir=a.out, lr=a.lr, group=group)
    step_s, revs = [], []
    for b in batches:
        t0 = time.perf_counter()
        trainer.step(to_tensors(b), b)
        rev = trainer.publish(run_id="bench", batch=b)
        step_s.append(time.perf_counter() - t0)
        if rev is not None:
            revs.append(rev.model_dump(mode="json"))
    rss = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024]
    if group is not None:
        every: list = [None] * group.world
        dist.all_gather_object(every, rss[0])
        rss = every
    if group is None or group.leader:
        Path(a.out, "result.json").write_text(json.dumps({"step_s": step_s, "peak_rss_mb": rss, "revisions": revs,
                                                          "state": str(trainer.training_state_path(
                                                              CheckpointRef(**revs[-1]["checkpoint"])))}))
    if group is not None:
        distributed.leave(group)
    return 0


def _write_frames(path: Path, frames: list[bytes]) -> None:
    with open(path, "wb") as f:
        for fr in frames:
            f.write(len(fr).to_bytes(8, "little") + fr)


def _read_frames(path: Path) -> list[bytes]:
    data, out, i = path.read_bytes(), [], 0
    while i < len(data):
        n = int.from_bytes(data[i:i + 8], "little")
        out.append(data[i + 8:i + 8 + n])
        i += 8 + n
    return out


def run_group(ranks: int, batches: list, ref, out: Path, *, lr: float = 1e-3, timeout_s: float = 900) -> dict:
    """Train ``batches`` from checkpoint ``ref`` on ``ranks`` processes under torchrun; the leader's result:
    ``step_s``, ``peak_rss_mb`` per rank, the ``revisions`` published and the last training ``state`` file."""
    from schemas import codec

    out.mkdir(parents=True, exist_ok=True)
    frames = out / "batches.bin"
    _write_frames(frames, [codec.encode(b) for b in batches])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           "-m", "benchmarks.trainer_dp", "--rank", "--batches", str(frames), "--ref", ref.model_dump_json(),
           "--out", str(out), "--lr", str(lr)]
    # the machine's cores shared out: one process uses them all, N processes a share each
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // ranks))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": threads}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"torchrun with {ranks} ranks exited {done.returncode}:\n{done.stderr[-4000:]}")
    return json.loads((out / "result.json").read_text())


def drift(a: dict, b: dict, start: dict) -> float:
    """|a - b| / |a - start| over every weight: how far two trainings ended apart, relative to how far they went."""

    num = sum(float((a[k].float() - b[k].float()).pow(2).sum()) for k in a) ** 0.5
    den = sum(float((a[k].float() - start[k].float()).pow(2).sum()) for k in a) ** 0.5
    return num / max(den, 1e-30) if den else float(num > 0)


def weights(state: str) -> dict:
    """The float32 weights of a training state (``consumers.trainer.distributed.save_sharded``'s folder)."""
    from consumers.trainer.distributed import read_sharded

    return read_sharded(Path(state))["model"]


def smollm_batches(records: int, steps: int, prompt_len: int, completion_len: int) -> tuple[list, object]:
    """``steps`` batches of ``records`` rows each from the packaged model (its own logprobs: ratio 1 at start)."""
    import numpy as np
    import torch

    from consumers import testing
    from policy.hf import FAMILY, load_model, prepare_model, token_logprobs
    from schemas.batch import assemble_batch

    prepared = prepare_model()
    model = load_model(prepared.checkpoint)
    rng = np.random.default_rng(0)
    batches = []
    for s in range(steps):
        recs = []
        for i in range(records):
            prompt = rng.integers(3, 40000, prompt_len).astype(np.int32)
            completion = rng.integers(3, 40000, completion_len).astype(np.int32)
            ids = torch.from_numpy(np.concatenate([prompt, completion]).astype(np.int64)).unsqueeze(0)
            with torch.no_grad():
                lp = token_logprobs(model, ids, torch.ones_like(ids))[0, prompt_len - 1:].numpy().astype(np.float32)
            r = testing.training_record(s * records + i, family=FAMILY, revision_=s, reward=float(i % 2))
            recs.append(r.model_copy(update={"prompt_token_ids": prompt, "completion_token_ids": completion,
                                             "completion_logprobs": lp,
                                             "loss_mask": np.ones(completion_len, np.uint8)}))
        target = testing.revision(s, family=FAMILY).model_copy(update={"checkpoint": prepared.checkpoint})
        batches.append(assemble_batch(recs, target, 1, run_id="bench", producer="bench"))
    return batches, prepared.checkpoint


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--rank" in argv:
        return _rank_program(argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks trainer_dp", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="8 records of 16+32 tokens, 2 steps")
    p.add_argument("--ranks", type=int, default=2, help="data-parallel ranks to compare with one (default 2)")
    p.add_argument("--records", type=int, default=16, help="records per batch (default 16)")
    p.add_argument("--steps", type=int, default=3, help="batches trained on each side (default 3)")
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--completion-tokens", type=int, default=64)
    args = p.parse_args(argv)
    if args.quick:
        args.records, args.steps, args.prompt_tokens, args.completion_tokens = 8, 2, 16, 32
    t0 = time.perf_counter()
    batches, ref = smollm_batches(args.records, args.steps, args.prompt_tokens, args.completion_tokens)
    with tempfile.TemporaryDirectory(prefix="bench-dp-") as tmp:
        one = run_group(1, batches, ref, Path(tmp, "one"))
        many = run_group(args.ranks, batches, ref, Path(tmp, "many"))
        reordered = run_group(1, [b.model_copy(update={"records": b.records[::-1]}) for b in batches], ref,
                              Path(tmp, "reordered"))
        from policy.hf import load_model

        start = load_model(ref).state_dict()
        d = drift(weights(one["state"]), weights(many["state"]), start)
        floor = drift(weights(one["state"]), weights(reordered["state"]), start)
    out = {"benchmark": "trainer_dp", "model": "SmolLM2-135M-Instruct", "ranks": args.ranks,
           "records": args.records, "tokens_per_record": args.prompt_tokens + args.completion_tokens,
           "steps": args.steps, "drift": round(d, 5), "floor": round(floor, 5),
           "one_rank_step_s": [round(x, 2) for x in one["step_s"]],
           f"{args.ranks}_rank_step_s": [round(x, 2) for x in many["step_s"]],
           "one_rank_peak_rss_mb": [round(x) for x in one["peak_rss_mb"]],
           f"{args.ranks}_rank_peak_rss_mb": [round(x) for x in many["peak_rss_mb"]],
           "quick": args.quick, "wall_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
