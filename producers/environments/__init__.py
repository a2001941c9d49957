"""Environments: datasets, episode protocols (single- and multi-turn, tools, self-play, sub-episodes), verifiers'
environments loaded by id, and the runnable examples. Imports ``producers.inference`` (an episode calls a model
through its client), never ``producers.arena``."""
