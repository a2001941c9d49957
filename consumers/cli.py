"""`rollout serve verifier|credit|batcher|trainer` (registered in rollout/serve_cmd.py) and `rollout status`."""

from __future__ import annotations

import argparse

HELP = {
    "verifier": "score Rollouts (with their Steps) -> RolloutScored, exactly-once",
    "credit": "credit assignment: RolloutScored -> TrainingRecords (grpo, reinforce_baseline, ema_per_member, per_step)",
    "batcher": "TrainingRecords -> lineage-stamped TrainerBatches with an off-policy bound",
    "trainer": "reference trainer: TrainerBatches -> clipped policy-gradient step -> PolicyRevision",
}


def register_serve(ssub: argparse._SubParsersAction) -> None:
    from consumers.services import add_options, cmd_serve

    for name, text in HELP.items():
        p = ssub.add_parser(name, help=text)
        add_options(p)
        p.set_defaults(func=cmd_serve, name=name)
