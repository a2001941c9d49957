"""Inference: the OpenAI-compatible client, the server pool, vLLM's start and stop, revision swaps into a running
server, the local policy server and the small ASGI servers beside them. Imports no other room of ``producers``."""
