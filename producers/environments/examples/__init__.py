"""Runnable example environments; each module defines ``load_environment(**args) -> Environment``.

* ``arithmetic``: single-turn, exact-match answers.
* ``debate``: two debaters alternate; the judge (a fixed plan target, run by the verifier) decides; zero-sum.
* ``proposer_solver``: hierarchical; a proposer's problem is solved by N solver sub-episodes; the
  proposer is rewarded for a pass rate near 50% (Monte Carlo).
"""
