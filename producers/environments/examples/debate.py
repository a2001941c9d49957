"""Debate (``debate@1.0.0``): two debaters alternate for ``num_rounds`` rounds; a judge decides; zero-sum.

The judge is not a role (never trained) and not part of the episode: it is the plan's fixed target
``judge``, called by the verifier. Artifacts: ``scoring = {"kind": "zero_sum_judge", "judge_target":
"judge", "players": ["debater_a", "debater_b"], "params": {"topic", "judge_prompt", "positions"}}``
and ``transcript`` (``[{role, name, content}]``, name = the debater who spoke). Winner +1, loser -1,
tie 0.
"""

from __future__ import annotations

from producers.environments.dataset import Example
from producers.environments.types import Environment
from producers.environments.episodes import AlternatingRolesEpisode
from schemas.scoring import ScoringSpec

VERSION = "1.0.0"
TOPICS = [
    "Cats make better pets than dogs.",
    "Remote work is better than office work.",
    "Homework should be abolished.",
    "Space exploration is worth its cost.",
    "Cities should ban private cars downtown.",
    "Nuclear power is essential for the climate.",
    "Social media does more harm than good.",
    "Standardized tests should be dropped from admissions.",
]
JUDGE_PROMPT = ("You judge a debate on: {topic}\ndebater_a argued FOR, debater_b AGAINST.\n"
                "Transcript:\n{transcript}\nWho argued better? Answer with exactly one of: debater_a, debater_b, tie.")


def scoring(example: Example, state=None) -> ScoringSpec:
    return ScoringSpec(kind="zero_sum_judge", judge_target="judge", players=["debater_a", "debater_b"],
                       params={"topic": example.info["topic"], "judge_prompt": JUDGE_PROMPT,
                               "positions": {"debater_a": "for", "debater_b": "against"}})


def load_environment(num_rounds: int = 2, topics: list[str] | None = None) -> Environment:
    rows = [Example(id=f"debate-{i}", prompt=f"Debate topic: {t}\ndebater_a argues FOR, debater_b argues AGAINST. "
                    "Keep each turn to one or two sentences.", info={"topic": t})
            for i, t in enumerate(topics or TOPICS)]
    episode = AlternatingRolesEpisode(("debater_a", "debater_b"), max_turns=2 * num_rounds, role_prompts={
        "debater_a": "You are debater_a. Argue FOR the motion.",
        "debater_b": "You are debater_b. Argue AGAINST the motion."})
    return Environment(name="debate", version=VERSION, dataset=rows, episode=episode, scoring=scoring,
                       description="two debaters, judged zero-sum by the fixed judge target")
