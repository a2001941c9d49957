"""Cold start: wall time of every `rollout` sub-command's --help (and a few cheap real runs) in fresh processes.

    python -m benchmarks coldstart [--quick] [--reps N] [--no-modules]

Each command runs N times (7; 3 with --quick) in a fresh interpreter, the commands taking turns (round-robin, so a
change in the machine's load reaches them all alike); the figure is the median wall time, with the median CPU
(user + system of the child) beside it. The baseline is the interpreter itself: ``python -c pass`` (with ``site``:
this virtual environment's ``.pth`` files, the editable install's finder) and ``python -I -S -c pass`` (bare);
``over_baseline_ms`` is a command's median minus ``python -c pass``'s. Each command also reports which heavy
modules it imported (``HEAVY``, read from ``sys.modules`` at exit): a ``--help`` needs none of them.

``rollout ...`` runs ``rollout.cli.main`` from this checkout (the console script's code, with this checkout first
on ``sys.path``, so ``python -m benchmarks compare REV coldstart`` measures REV's tree). With modules on (the
default), ``python -c 'import M'`` is timed too for each module behind the sub-commands (``rollout.cli.SUBCOMMANDS``)
and a few they lead to. Nothing here needs Kafka: the real runs are offline (``plan`` compiles an example
recipe, ``sql`` queries an empty DuckDB file, ``model info`` reads the model folder).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

HEAVY = ("torch", "transformers", "vllm", "pandas", "pyarrow", "duckdb", "numpy", "pydantic", "pydantic_settings",
         "aiokafka", "faststream", "msgspec", "fastapi", "uvicorn", "prometheus_client", "altair", "httpx", "rich",
         "verifiers", "zstandard")

# the console script's code (``rollout = "rollout.cli:main"``), then the heavy modules that got imported, on stderr
_RUN_CLI = "import sys; from rollout.cli import main; sys.exit(main())"
_PROBE = ("import atexit, sys; atexit.register(lambda: sys.stderr.write('\\nHEAVY ' + ','.join(m for m in {heavy!r} "
          "if m in sys.modules) + '\\n'))\n")

EXTRA_HELP = [("serve", "verifier"), ("serve", "policy"), ("kafka", "up"), ("model", "info")]
MODULES_BESIDES = ["rollout.cli", "consumers.cli", "consumers.registry", "consumers.settings", "consumers.runner",
                   "schemas", "schemas.plan", "streams.topics", "replay.ingest"]


def _subcommands() -> list[str]:
    """The top-level sub-commands, as ``rollout --help`` lists them (read in a child: this process stays light)."""
    code = ("import argparse, json; from rollout.cli import build_parser; p = build_parser(); "
            "print(json.dumps([n for a in p._actions if isinstance(a, argparse._SubParsersAction) for n in a.choices]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _commands(tmp: Path) -> dict[str, tuple[list[str], tuple[int, ...]]]:
    """label -> (python arguments, exit codes that count as a normal end)."""
    probe = _PROBE.format(heavy=HEAVY)
    cli = ["-c", probe + _RUN_CLI]
    out: dict[str, tuple[list[str], tuple[int, ...]]] = {
        "python -c pass": (["-c", "pass"], (0,)),
        "python -I -S -c pass": (["-I", "-S", "-c", "pass"], (0,)),
        "rollout --help": ([*cli, "--help"], (0,)),
    }
    for sub in _subcommands():
        out[f"rollout {sub} --help"] = ([*cli, sub, "--help"], (0,))
    for words in EXTRA_HELP:
        out[f"rollout {' '.join(words)} --help"] = ([*cli, *words, "--help"], (0,))
    db = tmp / "empty.duckdb"
    subprocess.run([sys.executable, "-c", f"import duckdb; duckdb.connect({str(db)!r}).close()"], check=True)
    plan = ROOT / "examples" / "plans" / "arithmetic.toml"
    out["rollout plan arithmetic (real)"] = ([*cli, "plan", str(plan)], (0,))
    out["rollout sql SELECT 1 (real)"] = ([*cli, "sql", "--db", str(db), "SELECT 1"], (0,))
    out["rollout model info (real)"] = ([*cli, "model", "info"], (0, 1))  # 1: not prepared on this machine
    return out


def _modules() -> dict[str, tuple[list[str], tuple[int, ...]]]:
    code = "import argparse, json, rollout.cli as c; print(json.dumps(c.SUBCOMMANDS))"
    subs = json.loads(subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                     check=True).stdout.strip().splitlines()[-1])
    probe = _PROBE.format(heavy=HEAVY)
    return {f"import {m}": (["-c", probe + f"import {m}"], (0,)) for m in dict.fromkeys(subs + MODULES_BESIDES)}


def _once(args: list[str]) -> tuple[float, float, int, list[str]]:
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    heavy = next((line[6:].split(",") for line in reversed(proc.stderr.splitlines()) if line.startswith("HEAVY ")), [])
    return wall, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime), proc.returncode, [h for h in heavy if h]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks coldstart", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 repetitions, no module imports (about a minute)")
    ap.add_argument("--reps", type=int, default=None, help="fresh processes per command (default 7, --quick 3)")
    ap.add_argument("--no-modules", action="store_true", help="skip the `python -c 'import M'` timings")
    args = ap.parse_args(argv)
    reps = args.reps or (3 if args.quick else 7)
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="coldstart-") as tmp:
        cmds = _commands(Path(tmp))
        if not (args.quick or args.no_modules):
            cmds.update(_modules())
        for _, (a, _) in cmds.items():  # warm the page cache and __pycache__ once, untimed
            _once(a)
        samples: dict[str, list[tuple[float, float]]] = {k: [] for k in cmds}
        heavy: dict[str, list[str]] = {}
        failed: dict[str, int] = {}
        for _ in range(reps):
            for label, (a, ok) in cmds.items():
                wall, cpu, rc, hv = _once(a)
                samples[label].append((wall, cpu))
                heavy[label] = hv
                if rc not in ok:
                    failed[label] = rc
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in samples.items()}
    base = med["python -c pass"][0]
    rows = {k: {"median_ms": round(w * 1000, 1), "cpu_ms": round(c * 1000, 1),
                "over_baseline_ms": round((w - base) * 1000, 1), "heavy": heavy[k]} for k, (w, c) in med.items()}
    width = max(map(len, rows))
    for k, r in rows.items():
        print(f"{k:<{width}}  {r['median_ms']:7.1f} ms  cpu {r['cpu_ms']:7.1f} ms  +{r['over_baseline_ms']:7.1f}  "
              f"{' '.join(r['heavy'])}", file=sys.stderr)
    cli = {k: v for k, v in rows.items() if k.startswith("rollout ")}
    out = {
        "benchmark": "coldstart", "quick": args.quick, "reps": reps,
        "baseline_ms": {k: rows[k]["median_ms"] for k in ("python -c pass", "python -I -S -c pass")},
        "commands": cli,
        "modules": {k: v for k, v in rows.items() if k.startswith("import ")},
        "help_median_ms_max": max(v["median_ms"] for k, v in cli.items() if k.endswith("--help")),
        "help_with_heavy": sorted(k for k, v in cli.items() if k.endswith("--help")
                                  and set(v["heavy"]) & {"torch", "transformers", "vllm", "pandas"}),
        "failed": failed, "load_avg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
        "machine": f"{os.cpu_count()} cpu, {platform.python_version()}",
    }
    print(json.dumps(out))
    return 0
