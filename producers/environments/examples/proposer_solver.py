"""Proposer/solver (``proposer-solver@1.0.0``): hierarchical self-play.

The proposer writes one problem ``Q: <question> A: <integer answer>``; ``num_solvers`` solver
sub-episodes (single-turn, member ``solver``) attempt the question. Each solver is a Rollout of its own
(``parent_rollout_id`` = the proposer's rollout; the proposer lists them in ``child_rollout_ids``; all
share the proposer's ``root_group_id``), scored ``exact_match`` against the proposed answer.

The proposer's artifacts: ``scoring = {"kind": "monte_carlo", "params": {"proposer": "proposer",
"child_member": "solver", "target_pass_rate": 0.5, "reward": "1 - 2*abs(pass_rate - target_pass_rate)",
"proposal_valid": bool, "invalid_reward": -1.0, "num_children": N}}`` and ``proposal``
(``{"question", "answer", "valid", "raw"}``). An unparseable proposal gets ``invalid_reward``; with
``on_invalid="seed"`` (default) the solvers still run, on the seed problem from the dataset, so the
loop keeps producing solver data while the proposer learns the format.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from producers.environments.dataset import Example
from producers.environments.types import Environment
from producers.environments.episodes import Episode, EpisodeState, SingleTurnEpisode, system, user
from producers.environments.examples.arithmetic import make_dataset
from schemas.scoring import ScoringSpec

VERSION = "1.0.0"
PROPOSAL = re.compile(r"Q:\s*(?P<q>.+?)\s*A:\s*(?P<a>-?\d+)", re.S)
PROPOSER_PROMPT = ("Invent one arithmetic problem that a student solves about half of the time. "
                   "Format: Q: <question> A: <integer answer>\nExample of the format: {example}")


def parse_proposal(text: str | None) -> tuple[str, str] | None:
    m = PROPOSAL.search(text or "")
    return (m.group("q").strip(), m.group("a")) if m and m.group("q").strip() else None


class ProposerEpisode(Episode):
    episode_type: ClassVar[str] = "proposer_solver"
    members = ("proposer",)

    def __init__(self, num_solvers: int = 4, on_invalid: str = "seed", target_pass_rate: float = 0.5) -> None:
        if on_invalid not in ("seed", "skip"):
            raise ValueError("on_invalid is 'seed' or 'skip'")
        self.num_solvers, self.on_invalid, self.target_pass_rate = num_solvers, on_invalid, target_pass_rate
        self.solver = SingleTurnEpisode(system_prompt="Solve the problem. Reply with the number only.",
                                        member="solver")

    async def rollout(self, ctx, state: EpisodeState) -> None:
        seed = state.example
        state.messages = [system("You are the proposer."),
                          user(PROPOSER_PROMPT.format(example=f"Q: {seed.prompt} A: {seed.answer}"))]
        comp = await ctx.call_model("proposer", state.messages)
        state.messages.append(comp.message.model_copy(update={"name": "proposer"}))
        state.turn = 1
        parsed = parse_proposal(comp.message.content)
        state.data["proposal"] = {"question": parsed[0] if parsed else None, "answer": parsed[1] if parsed else None,
                                  "valid": parsed is not None, "raw": comp.message.content}
        if parsed is None and self.on_invalid == "skip":
            state.stop_reason = "invalid_proposal"
            return
        question, answer = parsed if parsed else (str(seed.prompt), seed.answer)
        problem = Example(id=f"{state.rollout_id}-problem", prompt=question, answer=answer,
                          info={"proposed_by": state.rollout_id, "proposal_valid": parsed is not None})
        await ctx.spawn(self.solver, [problem] * self.num_solvers, scoring=solver_scoring)
        state.stop_reason = "solvers_done"

    def finalize(self, state: EpisodeState) -> dict[str, Any]:
        art = super().finalize(state)
        art["proposal"] = state.data.get("proposal")
        art["num_children"] = len(state.children)
        return art


def solver_scoring(example: Example, state=None) -> ScoringSpec:
    return ScoringSpec(kind="exact_match", answer=example.answer, params={"member": "solver", "extract": "last_integer"})


def load_environment(num_solvers: int = 4, on_invalid: str = "seed", num_seeds: int = 100,
                     target_pass_rate: float = 0.5) -> Environment:
    episode = ProposerEpisode(num_solvers, on_invalid, target_pass_rate)

    def scoring(example: Example, state: EpisodeState | None) -> ScoringSpec:
        proposal = (state.data.get("proposal") if state else None) or {}
        return ScoringSpec(kind="monte_carlo", params={
            "proposer": "proposer", "child_member": "solver", "target_pass_rate": target_pass_rate,
            "reward": "1 - 2*abs(pass_rate - target_pass_rate)", "proposal_valid": bool(proposal.get("valid")),
            "invalid_reward": -1.0, "num_children": len(state.children) if state else 0})

    return Environment(name="proposer-solver", version=VERSION, dataset=make_dataset(num_seeds, seed=7),
                       episode=episode, scoring=scoring, description="proposer/solver, Monte Carlo scored")
