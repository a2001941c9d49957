"""The Kafka errors a command prints in one line, without a traceback (``rollout.cli``). Below everything else in
``streams``, so the settings, the local broker and the clients all raise the same ones; ``streams.errors`` explains
what aiokafka raises as one of these."""

from __future__ import annotations


class KafkaError(Exception):
    """A Kafka-side problem worth one clear line to the user (the CLI prints it without a traceback)."""


class KafkaUnreachable(KafkaError):
    pass


class KafkaAccessError(KafkaError):
    """Credentials, certificates or permissions are wrong: waiting and retrying will not fix it."""
