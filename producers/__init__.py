"""The producing side: what generates rollouts and writes them to the log. Three rooms, arrows pointing down:

* ``producers.arena``: admission, pacing, running episodes concurrently and emitting their Steps and Rollouts
  transactionally. May import ``environments`` and ``inference``.
* ``producers.environments``: what an episode is (datasets, episode protocols, tools, verifiers' environments,
  the examples). May import ``inference`` (an episode talks to a model through its client), never the arena.
* ``producers.inference``: model servers and clients (vLLM, the local policy server, the pool, weight swaps,
  child processes). Imports neither of the others.

``producers.metrics`` names the Prometheus figures of all three; ``producers.host`` reads the machine's memory (the
arena's in-flight cap, the benchmarks' peaks). Never imports ``consumers``.
"""
