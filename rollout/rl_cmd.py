"""`rollout rl RECIPE`: a prime-rl recipe's whole loop here, as prime-rl users run `rl @ recipe.toml`.

    rollout rl @ tests/envs/recipes/rlt-sum-quiz.toml                # HuggingFaceTB/SmolLM2-135M-Instruct
    rollout rl @ my-recipe.toml --model packaged                       # a model that cannot be served here

The loop is `rollout demo`'s (broker, vLLM, verifier, credit, batcher, reference trainer, the arena with
evaluation, the live line and the summary), driven by the recipe: its environments by id (installed verifiers
packages, ``producers.environments.verifiers_loader``), group and batch sizes, algorithm, sampling, evaluation sources and
cadence, ``trainer.optim.lr``, ``seq_len`` and ``max_steps`` (the run stops after that many trained revisions).
A recipe key that changes the run and that nothing here applies stops it before anything starts, naming the
key (``rollout plan RECIPE`` lists them).
"""

from __future__ import annotations

import argparse

from rollout.argtypes import at_least

DEFAULT_LR = 2e-5        # the reference trainer's rate for SmolLM2 when the recipe sets no trainer.optim.lr
DEFAULT_MAX_STEPS = 20   # trained revisions when the recipe sets no max_steps


def register(sub: argparse._SubParsersAction) -> None:
    from rollout.demo import add_loop_flags

    p = sub.add_parser("rl", help="run a prime-rl recipe's whole loop: environments by id, vLLM, services, trainer",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", nargs="+", metavar="[@] RECIPE", help="the recipe TOML (prime-rl's `@` is accepted)")
    add_loop_flags(p)
    p.add_argument("--max-steps", type=at_least(1),
                   help=f"trained revisions before the run stops (default: the recipe's max_steps, else "
                        f"{DEFAULT_MAX_STEPS})")
    p.add_argument("--lr", type=float, help=f"learning rate (default: the recipe's trainer.optim.lr, else {DEFAULT_LR})")
    p.add_argument("--epochs", type=at_least(1), default=1, help="optimizer passes over each batch (default 1)")
    p.add_argument("--vllm-port", type=int, default=0, help="vLLM's port (default: a free one)")
    p.add_argument("--vllm-url", help="use this running vLLM server (started with VLLM_SERVER_DEV_MODE=1) instead")
    p.add_argument("--timeout", type=float, default=3600.0, help="give up on the arena after this many seconds")
    p.add_argument("--no-progress", action="store_true", help="no live progress line")
    p.set_defaults(func=cmd_rl, trains=True)




def cmd_rl(args: argparse.Namespace) -> int:
    import logging
    import sys

    from rollout.demo import run_loop
    from schemas.plan import PlanError
    from schemas.policy import TINY_FAMILY
    from schemas.plan_compiler import compile_plan

    logging.basicConfig(level=logging.ERROR)
    paths = [a for a in args.recipe if a != "@"]
    if len(paths) != 1:
        print("rollout rl: error: name one recipe: rollout rl @ recipe.toml", file=sys.stderr)
        return 2
    args.plan = paths[0]
    try:
        plan = compile_plan(args.plan)
    except PlanError as e:
        print(f"rollout rl: error: {e}", file=sys.stderr)
        return 1
    # prime-rl's max_steps: optimizer steps. The arena admits groups until the trainer has published that revision
    # (whatever the records a rollout yields: two seats, routed members, sub-episodes), and the trainer trains none
    # past it (records generated meanwhile are refused: RunComplete)
    steps = args.max_steps = args.max_steps or plan.max_steps or DEFAULT_MAX_STEPS
    args.groups, args.until_revision = 0, steps
    args.policy = "tiny" if plan.family == TINY_FAMILY else "vllm"
    if args.lr is not None:
        lr, origin = args.lr, "--lr"
    elif "lr" in plan.trainer:  # left to the plan: the services read it from there
        lr, origin = plan.trainer["lr"], "the recipe's trainer.optim.lr"
    else:
        lr = args.lr = DEFAULT_LR
        origin = "rollout rl's default: the recipe sets no trainer.optim.lr"
    print(f"recipe {args.plan}: {steps} trained revisions (max_steps; groups of {plan.group_size}, batches of "
          f"{plan.batch_size} records); lr {lr:g} ({origin})", flush=True)
    return run_loop(args, "rl")
