"""Cold start: a sub-command's --help imports none of the heavy libraries (python -m benchmarks coldstart times it).

Each case runs the console script's code in a fresh interpreter and reads ``sys.modules`` at exit, so a module-level
import added anywhere under ``rollout.cli.SUBCOMMANDS`` that pulls torch (or pandas, through pyarrow) fails here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NEVER = ("torch", "transformers", "vllm", "pandas")
# what `rollout --help` and a listing sub-command's --help got down to (0.6 s -> 0.1 s): none of the models either
NOT_FOR_HELP = (*NEVER, "numpy", "pydantic", "aiokafka", "pyarrow", "duckdb", "prometheus_client", "schemas.events")

CODE = """
import atexit, json, sys
atexit.register(lambda: print("MODULES " + json.dumps(sorted(sys.modules))))
from rollout.cli import main
sys.argv = ["rollout", *{argv!r}]
sys.exit(main())
"""


def imported(argv: list[str]) -> set[str]:
    proc = subprocess.run([sys.executable, "-c", CODE.format(argv=argv)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("MODULES "))
    return set(json.loads(line[len("MODULES "):]))


@pytest.mark.parametrize("argv", [["--help"], ["runs", "--help"], ["replay", "--help"], ["plan", "--help"],
                                  ["kafka", "--help"], ["status", "--help"], ["model", "--help"]])
def test_help_imports_nothing_heavy(argv: list[str]) -> None:
    mods = imported(argv)
    assert not {m for m in NOT_FOR_HELP if m in mods}, f"rollout {' '.join(argv)} imported them"


@pytest.mark.parametrize("argv", [["serve", "--help"], ["serve", "verifier", "--help"], ["serve", "trainer", "--help"],
                                  ["serve", "policy", "--help"]])
def test_service_help_imports_no_model(argv: list[str]) -> None:
    """A service's flags come from the settings model (pydantic) and the registry, never from its wiring."""
    assert not {m for m in NEVER if m in imported(argv)}


def test_serve_fills_its_services_on_use() -> None:
    from rollout.cli import build_parser

    args = build_parser().parse_args(["serve", "batcher", "--batch-records", "8"])
    assert (args.command, args.service, args.batch_records) == ("serve", "batcher", 8)
