"""Before/after: run a benchmark alternately on an older revision and on this checkout, in the same minutes.

    python -m benchmarks compare REV BENCHMARK [--runs N] [--keys K,...] [-- benchmark args...]

On a shared machine a figure from yesterday says little about today's change: this exports REV with
``git archive`` into a temporary directory, then runs ``python -m benchmarks BENCHMARK`` there and here in
turn (REV first), N times each, each in its own process with this checkout's Python environment and the
same Kafka (ROLLOUT_BOOTSTRAP_SERVERS, else the local broker, started here first). Prints every run's
JSON line as it comes, then one JSON line: per side, the runs' figures named by --keys (default: the
benchmark's ratios against its raw baseline), best and median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent

DEFAULT_KEYS = {
    "replay": ["replay_vs_raw", "replay_vs_raw_cpu", "replay.seconds", "raw_consume.seconds"],
    "pipeline": ["raw_over_services", "raw_over_services_steady", "services_p50_ms", "services_p99_ms",
                 "services_rollouts_per_s", "raw_rollouts_per_s"],
}


def _get(d: dict, dotted: str):
    """``a.b.0.c``: keys of nested objects, a number indexing a list (``shapes.0.over_floor``)."""
    for part in dotted.split("."):
        if isinstance(d, list) and part.isdigit():
            d = d[int(part)] if int(part) < len(d) else None
        else:
            d = d.get(part) if isinstance(d, dict) else None
    return d


def _export(rev: str, into: str) -> None:
    archive = subprocess.run(["git", "-C", str(HERE), "archive", rev], check=True, capture_output=True).stdout
    with tempfile.TemporaryFile() as f:
        f.write(archive)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(into, filter="data")


def _run(cwd: Path, bench: str, args: list[str], env: dict[str, str]) -> dict | None:
    proc = subprocess.run([sys.executable, "-m", "benchmarks", bench, *args], cwd=cwd, env=env,
                          capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        print(f"{cwd}: exit {proc.returncode}\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks compare", description=__doc__.split("\n")[0])
    ap.add_argument("rev", help="the older git revision (commit, tag, branch)")
    ap.add_argument("benchmark", help="a benchmark name (python -m benchmarks --help)")
    ap.add_argument("--runs", type=int, default=2, help="runs of each side, alternated (default 2)")
    ap.add_argument("--keys", help="comma-separated figures to summarise (dotted for nested), e.g. replay_vs_raw")
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    argv, bench_args = argv[:cut], argv[cut + 1:]  # after --: arguments for the benchmark
    a = ap.parse_args(argv)
    keys = a.keys.split(",") if a.keys else DEFAULT_KEYS.get(a.benchmark, [])
    env = dict(os.environ)
    if not env.get("ROLLOUT_BOOTSTRAP_SERVERS"):  # one broker for both sides, started from this checkout
        from streams.config import KafkaSettings, ensure_broker

        env["ROLLOUT_BOOTSTRAP_SERVERS"] = ensure_broker(KafkaSettings.from_env())
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="bench-before-") as before:
        _export(a.rev, before)
        for i in range(a.runs):
            for side, cwd in (("before", Path(before)), ("after", HERE)):
                out = _run(cwd, a.benchmark, bench_args, env)
                if out is None:
                    return 1
                runs[side].append(out)
                print(json.dumps({"side": side, "run": i + 1, "load_avg_1m": round(os.getloadavg()[0], 1),
                                  **{k: _get(out, k) for k in keys}}), flush=True)
    summary: dict = {"benchmark": "compare", "of": a.benchmark, "before": a.rev, "runs": a.runs, "args": bench_args}
    for side, outs in runs.items():
        for k in keys:
            vals = [v for v in (_get(o, k) for o in outs) if isinstance(v, (int, float))]
            if vals:
                summary[f"{side}.{k}"] = {"min": min(vals), "median": statistics.median(vals), "max": max(vals)}
    print(json.dumps(summary))
    return 0
