"""Run a benchmark: ``python -m benchmarks <name> [--quick] [args...]``.

Each benchmark is a module ``benchmarks/<name>.py`` defining ``main(argv) -> int | None``; it
ends by printing one JSON line with its figures. ``python -m benchmarks --help`` lists them.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def available() -> dict[str, str]:
    """Benchmark name -> first line of its docstring (read without importing the module)."""
    out = {}
    for info in pkgutil.iter_modules([str(HERE)]):
        if info.name.startswith("_"):
            continue
        path = HERE / f"{info.name}.py"
        doc = ""
        if path.exists():
            try:
                doc = (ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or "").strip().split("\n")[0]
            except SyntaxError:
                doc = "(does not parse)"
        out[info.name] = doc
    return dict(sorted(out.items()))


def usage() -> str:
    lines = ["usage: python -m benchmarks <name> [--quick] [args...]", "", "available benchmarks:"]
    benches = available()
    width = max((len(n) for n in benches), default=0)
    lines += [f"  {name:<{width}}  {doc}" for name, doc in benches.items()] or ["  (none)"]
    lines += ["", "Each ends by printing one JSON line; `python -m benchmarks <name> --help` for its options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help", "list"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in available():
        print(f"unknown benchmark {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"benchmarks.{name}")
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
