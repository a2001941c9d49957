"""The judge over HTTP: a ``consumers.scoring.Judge`` that asks a plan's fixed judge target, an OpenAI-compatible
chat endpoint, and returns its reply text (the verifier service's wiring opens one when the plan names targets)."""

from __future__ import annotations

from typing import Any, Mapping

from consumers.scoring import Judge


def http_judge(targets: Mapping[str, Any], *, timeout_s: float = 60.0) -> Judge:
    """A Judge over OpenAI-compatible chat endpoints: ``targets[name]`` has ``model`` and ``base_urls``."""
    import httpx

    client = httpx.AsyncClient(timeout=timeout_s)

    async def judge(target: str, messages: list[dict[str, Any]]) -> str:
        t = targets[target]
        model = getattr(t, "model", None) or t["model"]
        urls = getattr(t, "base_urls", None) or t["base_urls"]
        resp = await client.post(f"{urls[0].rstrip('/')}/chat/completions",
                                 json={"model": model, "messages": messages, "temperature": 0.0})
        resp.raise_for_status()
        return resp.json()["choices"][0]["message"]["content"]

    return judge
