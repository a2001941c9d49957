"""The arena: admits groups against the run's ledger, paces them, runs their episodes through the plan's routes and
emits every Step and Rollout in one transaction per episode tree. Imports ``producers.environments`` and
``producers.inference``; nothing below imports it."""
