"""The reference's logprob of every trainable completion token, by prefill (prime-rl's opd teacher scoring).

One request per trainable step: ``POST {base_url}/completions`` with the step's prompt and completion token ids as
the prompt, ``max_tokens`` 1 and ``prompt_logprobs`` 0 (vLLM's OpenAI server: each prompt token's logprob given the
tokens before it, that token's alone), read at the completion's positions. prime-rl scores the same way
(``prefill_logprobs``: ``prompt_logprobs`` on the token ids, through its own /generate route).

A self-distilling reference (prime-rl's opsd: ``Reference.demonstration``) is the live policy with the sample's
demonstration prepended as a leading system message: the message is tokenized by the server's own chat template
(vLLM's ``POST /tokenize`` with ``messages``, no generation prompt, as prime-rl renders its hint block) and its tokens
go before the sample's, which are scored verbatim.

A server that is down, answers 5xx or 429, or does not serve the model is the environment's fault: a request
waits and tries again for ``RETRY_S``, then ``ReferenceUnavailable`` makes the processor wait and try the record
again; nothing is dropped. A server that refuses the tokens themselves (400, 413, 422: too long for its context, an
id outside its vocabulary) is the record's fault: ``ReferenceRefused``, dead-lettered with its answer.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, Sequence

import httpx
import numpy as np

from schemas.objectives import Reference
from streams.partition_task import EnvironmentFault

log = logging.getLogger("rollout.reference")

RETRY_S = 20.0
"""How long one request tries a reference that is down before the record is handed back to the processor (which
waits ``streams.transactions.ENVIRONMENT_RETRY_S`` and tries it again)."""
IN_FLIGHT = 32
"""Prefills one scorer has in flight at most: a fetch's scores queue for them here, not in the server, so none
times out waiting its turn behind thousands (a CPU vLLM answered 32 at once at 0.57 s each)."""
HINTS_KEPT = 256
"""opsd's rendered hint blocks kept, by their text: a group's rollouts share one."""
REFUSED = frozenset({400, 413, 422})
"""HTTP statuses that refuse the request's tokens: the record's fault."""


class ReferenceUnavailable(EnvironmentFault):
    """The reference cannot be reached, or does not serve the model: waited out."""


class ReferenceRefused(ValueError):
    """The reference refused these tokens: the record is dead-lettered with its answer."""


def prefill_body(model: str, token_ids: Sequence[int]) -> dict[str, Any]:
    """The request that scores ``token_ids`` under ``model``: no sampling to speak of (one token), every prompt
    token's own logprob."""
    return {"model": model, "prompt": [int(t) for t in token_ids], "max_tokens": 1, "prompt_logprobs": 0,
            "temperature": 1.0, "top_p": 1.0}


def completion_logprobs(answer: dict[str, Any], token_ids: Sequence[int], start: int) -> np.ndarray:
    """The logprobs of ``token_ids[start:]`` from a prefill answer, each checked to be its token's (vLLM keys each
    position's entries by token id; -9999 stands for -inf)."""
    entries = answer["choices"][0]["prompt_logprobs"]
    if entries is None or len(entries) != len(token_ids):
        raise ReferenceRefused(f"the reference answered {0 if entries is None else len(entries)} prompt logprobs "
                               f"for {len(token_ids)} tokens")
    out = np.empty(len(token_ids) - start, dtype=np.float32)
    for j, i in enumerate(range(start, len(token_ids))):
        entry = (entries[i] or {}).get(str(int(token_ids[i])))
        if entry is None:
            raise ReferenceRefused(f"the reference gave no logprob of token {token_ids[i]} at position {i}")
        out[j] = entry["logprob"]
    return out


class ReferenceScorer:
    """Prefill-scores token ids under a reference, over one HTTP client; names what each reference serves."""

    def __init__(self, client: httpx.AsyncClient, retry_s: float | None = None, in_flight: int = IN_FLIGHT) -> None:
        self.client = client
        self.retry_s = RETRY_S if retry_s is None else retry_s
        self._served: dict[Reference, Reference] = {}
        self._hints: dict[tuple[str, str, str], list[int]] = {}
        self._slots = asyncio.Semaphore(in_flight)

    def _headers(self, ref: Reference) -> dict[str, str]:
        key = os.environ.get(ref.api_key_var) if ref.api_key_var else None
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def _request(self, method: str, ref: Reference, path: str, body: dict[str, Any] | None = None,
                       base: str | None = None) -> Any:
        """The answer's JSON (``path`` under ``base``, default the reference's ``base_url``); a reference that is
        down or failing is tried again until ``retry_s`` after this request's turn came."""
        async with self._slots:
            return await self._tries(method, ref, (base or str(ref.base_url)).rstrip("/") + path, body)

    async def _tries(self, method: str, ref: Reference, url: str, body: dict[str, Any] | None) -> Any:
        deadline, wait, why = time.monotonic() + self.retry_s, 0.25, ""
        while True:
            try:
                r = await self.client.request(method, url, json=body, headers=self._headers(ref))
                if r.status_code in REFUSED:
                    raise ReferenceRefused(f"{ref.model} at {ref.base_url} refused the tokens: HTTP {r.status_code} "
                                           f"{r.text[:500]}")
                if r.status_code < 400:
                    return r.json()
                why = f"HTTP {r.status_code} {r.text[:200]}"
            except httpx.HTTPError as e:
                why = f"{type(e).__name__}: {e}"
            if time.monotonic() + wait > deadline:
                raise ReferenceUnavailable(f"the reference {ref.model} at {ref.base_url} did not answer for "
                                           f"{self.retry_s:g}s: {why}")
            log.warning("reference %s at %s: %s; trying again in %.2fs", ref.model, ref.base_url, why, wait)
            await asyncio.sleep(wait)
            wait = min(wait * 2, 4.0)

    async def served(self, ref: Reference) -> Reference:
        """``ref`` with what its server says it serves (``/models``: vLLM's ``root``, the checkpoint it loaded).
        A server that does not list the model is waited for as one that is down (a teacher still loading, or a
        name to correct): scoring with another model would train toward the wrong reference."""
        if ref not in self._served:
            listed = {m.get("id"): m for m in (await self._request("GET", ref, "/models")).get("data", [])}
            if ref.model not in listed:
                raise ReferenceUnavailable(f"{ref.base_url} does not serve {ref.model!r} (it serves "
                                           f"{', '.join(map(str, listed)) or 'nothing'})")
            root = listed[ref.model].get("root")
            self._served[ref] = ref.model_copy(update={"revision": root if isinstance(root, str) else None})
        return self._served[ref]

    async def hint_ids(self, ref: Reference, demonstration: str) -> list[int]:
        """The token ids of the system message carrying ``demonstration`` (``ref.demonstration``'s template),
        rendered by the server's chat template; the last few asked are kept (a group shares its example's)."""
        assert ref.demonstration is not None and ref.base_url is not None
        hint = ref.demonstration.hint(demonstration)
        key = (ref.base_url, ref.model, hint)
        if key not in self._hints:
            root = ref.base_url.rstrip("/").removesuffix("/v1")
            answer = await self._request("POST", ref, "/tokenize", {
                "model": ref.model, "messages": [{"role": "system", "content": hint}],
                "add_generation_prompt": False}, base=root)
            while len(self._hints) >= HINTS_KEPT:
                self._hints.pop(next(iter(self._hints)))
            self._hints[key] = [int(t) for t in answer["tokens"]]
        return self._hints[key]

    async def score(self, ref: Reference, prompt_ids: Sequence[int], completion_ids: Sequence[int],
                    prefix_ids: Sequence[int] = ()) -> np.ndarray:
        """The reference's logprob of each completion token given ``prefix_ids`` (opsd's hint), the prompt and the
        completion before it."""
        if not len(completion_ids):
            return np.empty(0, dtype=np.float32)
        if not len(prompt_ids):
            raise ReferenceRefused("a completion without a prompt: its first token has no context to be scored in")
        prompt_ids = [*prefix_ids, *prompt_ids]
        ids = [*prompt_ids, *completion_ids]
        return completion_logprobs(await self._request("POST", ref, "/completions", prefill_body(ref.model, ids)),
                                   ids, len(prompt_ids))
