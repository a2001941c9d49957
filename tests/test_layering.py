"""The folders are the architecture (docs/CONVENTIONS.md): every import of the project's own code, at any depth of
a module (inside functions and ``TYPE_CHECKING`` blocks too), points the way the rooms allow. A move that adds an
arrow the wrong way fails here, with the file, the line and the rule."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("schemas", "streams", "policy", "producers", "consumers", "replay", "rollout", "benchmarks")

# room -> the rooms it may import (its own always). The most specific room of a module wins.
ALLOWED: dict[str, set[str]] = {
    "schemas": set(),
    "streams": {"schemas"},
    "policy": {"schemas"},
    "producers.inference": {"schemas", "streams", "policy", "producers.metrics"},
    "producers.environments": {"schemas", "streams", "policy", "producers.inference"},
    "producers.arena": {"schemas", "streams", "policy", "producers.environments", "producers.inference",
                        "producers.metrics", "producers.host"},
    "producers.metrics": {"schemas", "streams"},
    "producers.host": set(),  # the machine's memory, read from /proc: a leaf any producing room may read
    "producers": {"schemas", "streams", "policy"},
    "consumers": {"schemas", "streams", "policy", "consumers.trainer", "consumers.trainer.task"},
    # the trainer's room: the step, its state and its distribution know no Kafka; only its task does
    "consumers.trainer": {"schemas", "policy", "consumers.settings"},
    "consumers.trainer.task": {"schemas", "streams", "policy", "consumers", "consumers.trainer"},
    "replay": {"schemas", "streams"},
    "rollout": set(PROJECT),
    "benchmarks": set(PROJECT),
}
COMPOSITION_ROOTS = {"rollout", "benchmarks"}  # the CLI and the benchmarks put the rooms together: any arrow
# libraries a room must not import: the contracts know nothing of Kafka or torch
FORBIDDEN_LIBS = {"schemas": {"aiokafka", "torch", "faststream"}}


def room(module: str) -> str | None:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in ALLOWED:
            return ".".join(parts[:n])
    return None


def _allowed(src: str, dst: str) -> bool:
    """A module may import its own room and the rooms ALLOWED names (with what lies below them that is no room of
    its own): a room inside another (the trainer's task in the trainer) is named where it is allowed."""
    if src in COMPOSITION_ROOTS:
        return True
    inner = room(dst)
    return dst == src or inner == src or any(
        dst == a or dst.startswith(a + ".") and not inner.startswith(a + ".") for a in ALLOWED[src])


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):  # the project imports absolutely: a relative one is named as such
            name = "." * node.level + (node.module or "")
            out += [(node.lineno, f"{name}.{a.name}") for a in node.names]
    return out


def _modules():
    for top in PROJECT:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            yield path, ".".join(parts)


def test_every_import_points_the_way_the_rooms_allow():
    wrong = []
    for path, module in _modules():
        src = room(module)
        assert src, f"{module}: in no room of ALLOWED"
        for line, target in _imports(path):
            top = target.split(".")[0]
            if not top:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: a relative import ({target}): name the module whole")
            if top in FORBIDDEN_LIBS.get(src, ()):
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {src} imports {target} (no {top} in {src})")
            if top not in PROJECT:
                continue
            dst = room(target)
            if dst and not _allowed(src, target):
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {src} imports {target} ({dst})")
    assert not wrong, "imports across the rooms the wrong way:\n" + "\n".join(wrong)


def test_the_rule_sees_a_wrong_arrow(tmp_path):
    """The check itself: an environment importing the arena, an inference module importing an environment, a
    consumer importing a producer, the trainer's step importing its task and the contracts importing torch are each
    caught."""
    cases = {"consumers.trainer.step": "from consumers.trainer.task import TrainerTask\n",
             "producers.environments.x": "from producers.arena.arena import Arena\n",
             "producers.inference.x": "import producers.environments.episodes\n",
             "consumers.x": "def f():\n    from producers.inference.client import InferenceClient\n",
             "schemas.x": "import torch\n"}
    for module, src in cases.items():
        p = tmp_path / "m.py"
        p.write_text(src)
        (line, target), = _imports(p)
        dst, top = room(target), target.split(".")[0]
        assert top in FORBIDDEN_LIBS.get(room(module), ()) or not _allowed(room(module), target), (module, target)


def test_every_name_a_benchmark_imports_from_the_project_exists():
    """A benchmark imports the project inside its functions, so nothing else runs those imports: a name renamed in
    its room broke one unseen (``replay.runs._assign`` became ``assign_all``; ``benchmarks replay`` failed)."""
    import importlib

    missing = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                    and node.module.split(".")[0] in PROJECT:
                module = importlib.import_module(node.module)
                for alias in node.names:
                    if not hasattr(module, alias.name) and \
                            importlib.util.find_spec(f"{node.module}.{alias.name}") is None:
                        missing.append(f"{path.name}:{node.lineno}: {node.module}.{alias.name}")
    assert not missing, missing


def test_a_runs_first_steps_and_a_vllm_arenas_swaps_import_no_torch():
    """Finding the packaged model (before vLLM is spawned) and naming and hashing a checkpoint (a vLLM arena's swap)
    need no torch: its import (about a second on 2 cores) sat twice on the path to a run's first rollout."""
    import subprocess
    import sys

    code = ("import sys; from policy.hf import FAMILY; from policy.served import served_model; "
            "from policy.checkpoint import checkpoint_path, file_sha256; import producers.inference.weights, "
            "producers.arena.arena, rollout.arena_cmd; file_sha256(checkpoint_path(served_model(FAMILY).checkpoint())); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr
