"""A LoRA revision served by vLLM as its adapter alone vs merged: generation speed, load time, bytes written.

    python -m benchmarks lora_serving [--quick] [--rank R] [--requests N] [--rounds K] [--concurrency C] [--tokens T]

One adapter (rank R, alpha 2R, prime-rl's default target modules, its B drawn as training leaves it) on the
packaged SmolLM2, written both ways by the trainer's writer (``policy.hf.save_checkpoint``, with and without
``base``): the bytes and seconds of each. Then two vLLM servers, up at once with a small KV cache each:

* merged: a plain server (as a merged LoRA run starts it) reloads the merged revision (``VllmWeights``);
* adapter: a server started for a LoRA plan (``VllmServer.for_plan``: ``--enable-lora``) loads revision 0 (the base)
  and the adapter revision as the arena loads them (``VllmWeights.for_plan``: ``/v1/load_lora_adapter`` with
  ``load_inplace``); its waves name the base (revision 0 of a LoRA run) or the adapter. Then the same adapter loaded
  again after unloading it (``load_inplace`` off: vLLM 0.32 keeps the flag on the adapter it stores, and the
  engine re-reads an in-place adapter from its folder whenever it applies it; this says what that costs).

Each wave: N chat requests, C at once, T completion tokens each (``ignore_eos``), temperature 1, timed, and the
serving server's CPU seconds per 1000 tokens (its processes' user + system time). The kinds' waves are alternated K
rounds, so a busy neighbour slows each alike; medians, and each kind against merged. The greedy logprobs of a few
answers under merged and adapter serving are compared (the same weights, two kernels). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._shared import cpu_s
from benchmarks.vllm import _questions, _raw


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def _write(rank: int, out: Path) -> dict:
    """The packaged model's revision 0, and revision 1 as an adapter and merged (timed, sized)."""
    import torch

    from policy import hf, lora
    from schemas.plan import LoraSpec
    from schemas.policy import PolicyRevision

    prepared = hf.prepare_model()
    spec = LoraSpec(rank=rank, alpha=2.0 * rank)
    model = lora.inject(hf.load_model(prepared.checkpoint), spec)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # a few steps of training's size (lr 2e-4 moves B by ~1e-3 a step)
                p.copy_(torch.randn(p.shape, generator=gen) * 2e-3)
    figures: dict = {"rank": rank, "alpha": spec.alpha, "adapter_name": spec.adapter_name}
    revs = {"base": PolicyRevision(run_id="b", producer="b", family=hf.FAMILY, revision=0,
                                   checkpoint=prepared.checkpoint)}
    for kind, base in (("adapter", prepared.checkpoint), ("merged", None)):
        t0 = time.perf_counter()
        ref = hf.save_checkpoint(model, out, hf.FAMILY, 1, base=base)
        figures[f"{kind}_write_s"] = round(time.perf_counter() - t0, 2)
        figures[f"{kind}_bytes"] = _bytes(hf.checkpoint_folder(ref))
        revs[kind] = revs["base"].model_copy(update={"revision": 1, "checkpoint": ref})
    figures["bytes_ratio"] = round(figures["adapter_bytes"] / figures["merged_bytes"], 4)
    return {"write": figures, "revs": revs, "spec": spec}


async def _greedy(url: str, model: str, prompts: list[str]) -> list[list[float]]:
    import httpx

    out = []
    async with httpx.AsyncClient(timeout=300) as http:
        for p in prompts:
            r = await http.post(url + "/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": p}], "temperature": 0, "max_tokens": 8,
                "logprobs": True, "top_logprobs": 0})
            r.raise_for_status()
            out.append([e["logprob"] for e in r.json()["choices"][0]["logprobs"]["content"]])
    return out


def _tree_cpu_s(pid: int) -> float:
    """CPU seconds used so far by process ``pid`` and its descendants (vLLM's API server and engine core)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += cpu_s(p)
        except OSError:
            pass
        todo += children.get(p, [])
    return total


async def _wave(url: str, pid: int, model: str, prompts: list[str], body: dict, concurrency: int) -> dict:
    c0 = _tree_cpu_s(pid)
    wave = await _raw(url, model, prompts, body, concurrency)
    wave["cpu_s_per_1k_tokens"] = round((_tree_cpu_s(pid) - c0) * 1000 / wave["completion_tokens"], 2)
    wave["loadavg"] = round(os.getloadavg()[0], 1)
    print(f"  {model:>22} {wave['tokens_per_s']:7.1f} tokens/s, {wave['seconds']:6.1f} s, "
          f"{wave['cpu_s_per_1k_tokens']:5.1f} CPU s per 1000 tokens, load {wave['loadavg']}", file=sys.stderr)
    return wave


async def _server(plan, path: Path) -> tuple[object, dict]:
    from producers.inference.vllm_server import VllmServer
    from streams.local_broker import free_port

    server = VllmServer.for_plan(plan, path, port=free_port(), max_model_len=512, kv_cache_gb=0.5)
    t0 = time.perf_counter()
    await server.start()
    print(f"vLLM {' '.join(server.command()[-6:])} started in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    return server, {"start_s": round(time.perf_counter() - t0, 1)}


async def run(args) -> dict:
    import statistics

    import httpx

    from policy.hf import FAMILY, checkpoint_folder, prepare_model
    from producers.inference.weights import VllmWeights
    from schemas.plan_compiler import compile_plan

    out: dict = {"cpus": os.cpu_count(), "requests": args.requests, "concurrency": args.concurrency,
                 "max_tokens": args.tokens, "rounds": args.rounds}
    made = await asyncio.to_thread(_write, args.rank, Path(tempfile.mkdtemp(prefix="bench-lora-")))
    out["write"], revs, spec = made["write"], made["revs"], made["spec"]
    print(f"revision 1 written: {out['write']}", file=sys.stderr)
    prompts = _questions(args.requests)
    body = {"temperature": 1.0, "max_tokens": args.tokens, "ignore_eos": True}
    plan = compile_plan("examples/plans/arithmetic-smollm2-lora.toml").model_copy(update={"lora": spec})
    merged_plan = plan.model_copy(update={"lora": spec.model_copy(update={"serving": "merged"})})
    path = prepare_model().path
    servers = []
    try:
        async with httpx.AsyncClient(timeout=600) as http:
            # both up at once (a small KV cache each), their waves alternated: a busy neighbour slows both alike
            plain, out["merged_server"] = await _server(merged_plan, path)
            servers.append(plain)
            lora, out["lora_server"] = await _server(plan, path)
            servers.append(lora)
            loaded = await VllmWeights.for_plan(merged_plan)(plain.base_url).load(http, revs["merged"])
            out["merged_server"]["reload_s"] = round(loaded["reload_s"], 2)
            weights = VllmWeights.for_plan(plan)(lora.base_url)
            await weights.load(http, revs["base"])
            loaded = await weights.load(http, revs["adapter"])
            out["lora_server"]["adapter_load_s"] = round(loaded["reload_s"], 3)
            kinds = {"merged": (plain, FAMILY), "base_on_lora_server": (lora, FAMILY),
                     "adapter_inplace": (lora, spec.adapter_name)}
            for server, model in kinds.values():  # warm-up
                await _raw(server.base_url, model, prompts[:args.concurrency], body, args.concurrency)
            waves: dict[str, list[dict]] = {k: [] for k in [*kinds, "adapter_reloaded_not_inplace"]}
            for r in range(args.rounds):
                for kind, (server, model) in kinds.items():
                    waves[kind].append(await _wave(server.base_url, server.proc.pid, model, prompts, body,
                                                   args.concurrency))
            # the same adapter loaded afresh, not in place: vLLM 0.32 keeps load_inplace on the adapter it stores and
            # re-reads an in-place adapter from its folder whenever it applies it; this says what that costs
            root = lora.base_url.removesuffix("/v1")
            (await http.post(root + "/v1/unload_lora_adapter", json={"lora_name": spec.adapter_name})).raise_for_status()
            (await http.post(root + "/v1/load_lora_adapter", json={
                "lora_name": spec.adapter_name, "lora_path": str(checkpoint_folder(revs["adapter"].checkpoint))})
             ).raise_for_status()
            for r in range(args.rounds):
                waves["merged"].append(await _wave(plain.base_url, plain.proc.pid, FAMILY, prompts, body,
                                                   args.concurrency))
                waves["adapter_reloaded_not_inplace"].append(await _wave(
                    lora.base_url, lora.proc.pid, spec.adapter_name, prompts, body, args.concurrency))
            probe = _questions(4, seed=7)
            a = await _greedy(lora.base_url, spec.adapter_name, probe)
            m = await _greedy(plain.base_url, FAMILY, probe)
    finally:
        for server in servers:
            await server.stop()
    out["greedy_logprob_max_abs_diff"] = round(max(abs(x - y) for xs, ys in zip(a, m) for x, y in zip(xs, ys)), 5)
    out["median"] = {k: {"tokens_per_s": statistics.median(w["tokens_per_s"] for w in v),
                         "wave_s": statistics.median(w["seconds"] for w in v),
                         "cpu_s_per_1k_tokens": statistics.median(w["cpu_s_per_1k_tokens"] for w in v)}
                     for k, v in waves.items()}
    merged = out["median"]["merged"]
    out["vs_merged"] = {k: {"tokens_per_s": round(v["tokens_per_s"] / merged["tokens_per_s"], 3),
                            "cpu_s": round(v["cpu_s_per_1k_tokens"] / merged["cpu_s_per_1k_tokens"], 2)}
                        for k, v in out["median"].items() if k != "merged"}
    out["waves"] = waves
    return out


def main(argv: list[str] | None = None) -> int:
    from benchmarks._shared import report

    p = argparse.ArgumentParser(prog="python -m benchmarks lora_serving", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small waves (~4 min)")
    p.add_argument("--rank", type=int, default=16, help="the adapter's rank (alpha 2 x rank; default 16, the "
                                                        "arithmetic LoRA recipe's)")
    p.add_argument("--requests", type=int, help="requests per wave (default 64, quick 32)")
    p.add_argument("--rounds", type=int, help="waves of each kind, alternated (default 3, quick 1)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--tokens", type=int, default=32, help="completion tokens per request (ignore_eos)")
    args = p.parse_args(argv)
    args.requests = args.requests or (32 if args.quick else 64)
    args.rounds = args.rounds or (1 if args.quick else 3)
    return report(run, args)


if __name__ == "__main__":
    sys.exit(main())
