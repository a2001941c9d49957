"""A tiny byte-level GRU language model: seeded init, real sampled-token logprobs.

~150k parameters with the default config, so CPU generation runs at thousands of tokens/s.

* ``PolicyModel.from_seed(seed)``: deterministic random init (same seed, same weights).
* ``generate(model, prompt_ids, max_tokens, temperature, seed) -> (completion_ids, logprobs)``:
  ``logprobs[i]`` is ``log p(completion_ids[i])`` under the distribution the token was actually
  sampled from, ``log_softmax(logits / temperature)``. ``temperature == 0`` is greedy decoding; its
  logprobs are then those of the untempered model (``temperature = 1``), as vLLM reports them.
* ``token_logprobs(model, prompt_ids, completion_ids, temperature=1.0)``: the same numbers
  recomputed in one differentiable forward pass (for the trainer's importance ratios and loss).

Generation stops after a stop token (``<|end|>``/``<|eos|>``), which is included in the completion
(with its logprob), or after ``max_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from policy.tokenizer import PAD, STOP_TOKENS, VOCAB_SIZE


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = VOCAB_SIZE
    embed_dim: int = 64
    hidden_dim: int = 160
    num_layers: int = 1

    def to_dict(self) -> dict:
        return asdict(self)


class PolicyModel(nn.Module):
    def __init__(self, config: ModelConfig | None = None) -> None:
        super().__init__()
        self.config = config or ModelConfig()
        c = self.config
        self.embed = nn.Embedding(c.vocab_size, c.embed_dim)
        self.rnn = nn.GRU(c.embed_dim, c.hidden_dim, num_layers=c.num_layers, batch_first=True)
        self.head = nn.Linear(c.hidden_dim, c.vocab_size)

    @classmethod
    def from_seed(cls, seed: int = 0, config: ModelConfig | None = None) -> PolicyModel:
        """Deterministic random initialisation: the global RNG is left untouched."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = cls(config)
        model.eval()
        return model

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, T] -> logits [B, T, V], hidden."""
        out, hidden = self.rnn(self.embed(ids), hidden)
        return self.head(out), hidden


def _log_dist(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits.float() / t, dim=-1)


@torch.no_grad()
def generate_batch(model: PolicyModel, prompts: Sequence[Sequence[int]], max_tokens: int | Sequence[int],
                   temperature: float | Sequence[float] = 1.0, seeds: Sequence[int | None] | None = None,
                   ) -> list[tuple[list[int], list[float]]]:
    """Generate for several prompts at once (one GRU step per token for the whole batch).

    Each row samples from its own ``torch.Generator`` seeded with its seed, so a row's output does
    not depend on what it was batched with (up to float rounding). Returns [(ids, logprobs)] per row.
    """
    n = len(prompts)
    if n == 0:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (encode_chat starts with <|bos|>)")
    max_toks = [int(max_tokens)] * n if isinstance(max_tokens, int) else [int(m) for m in max_tokens]
    temps = [float(temperature)] * n if isinstance(temperature, (int, float)) else [float(t) for t in temperature]
    seeds = list(seeds) if seeds is not None else [None] * n
    gens = []
    for s in seeds:
        g = torch.Generator()
        if s is None:
            g.seed()
        else:
            g.manual_seed(int(s) & 0xFFFF_FFFF_FFFF)
        gens.append(g)
    model.eval()
    lengths = torch.tensor([len(p) for p in prompts])
    padded = torch.full((n, int(lengths.max())), PAD, dtype=torch.long)
    for i, p in enumerate(prompts):
        padded[i, :len(p)] = torch.as_tensor(list(p), dtype=torch.long)
    packed = pack_padded_sequence(model.embed(padded), lengths, batch_first=True, enforce_sorted=False)
    out, hidden = model.rnn(packed)
    out, _ = pad_packed_sequence(out, batch_first=True)
    last = out[torch.arange(n), lengths - 1]  # [B, H]
    logits = model.head(last)
    results: list[tuple[list[int], list[float]]] = [([], []) for _ in range(n)]
    active = [m > 0 for m in max_toks]
    temp_t = torch.tensor([t if t > 0 else 1.0 for t in temps]).unsqueeze(1)
    while any(active):
        logp = torch.log_softmax(logits.float() / temp_t, dim=-1)  # [B, V]
        nxt = torch.zeros(n, dtype=torch.long)
        for i in range(n):
            if not active[i]:
                continue
            if temps[i] > 0:
                tok = int(torch.multinomial(logp[i].exp(), 1, generator=gens[i]))
            else:
                tok = int(torch.argmax(logp[i]))
            results[i][0].append(tok)
            results[i][1].append(float(logp[i, tok]))
            nxt[i] = tok
            if tok in STOP_TOKENS or len(results[i][0]) >= max_toks[i]:
                active[i] = False
        if not any(active):
            break
        step_out, hidden = model.rnn(model.embed(nxt.unsqueeze(1)), hidden)
        logits = model.head(step_out[:, 0])
    return results


def generate(model: PolicyModel, prompt_ids: Sequence[int], max_tokens: int, temperature: float = 1.0,
             seed: int | None = None) -> tuple[list[int], list[float]]:
    return generate_batch(model, [prompt_ids], max_tokens, temperature, [seed])[0]


def token_logprobs(model: PolicyModel, prompt_ids: Sequence[int], completion_ids: Sequence[int],
                   temperature: float = 1.0) -> torch.Tensor:
    """log p(completion_ids[i] | prompt, completion[:i]) as a [len(completion)] float tensor (with grad)."""
    if not completion_ids:
        return torch.zeros(0)
    ids = torch.as_tensor([*prompt_ids, *completion_ids], dtype=torch.long).unsqueeze(0)
    logits, _ = model(ids[:, :-1])
    logp = _log_dist(logits[0, len(prompt_ids) - 1:], temperature)
    target = ids[0, len(prompt_ids):]
    return logp.gather(1, target.unsqueeze(1)).squeeze(1)


def token_logprobs_batch(model: PolicyModel, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                         temperature: float = 1.0) -> list[torch.Tensor]:
    """``token_logprobs`` for many sequences in one padded forward pass."""
    seqs = [[*p, *c] for p, c in zip(prompts, completions, strict=True)]
    n = len(seqs)
    if n == 0:
        return []
    inputs = [s[:-1] for s in seqs]
    lengths = torch.tensor([max(len(s), 1) for s in inputs])
    padded = torch.full((n, int(lengths.max())), PAD, dtype=torch.long)
    for i, s in enumerate(inputs):
        padded[i, :len(s)] = torch.as_tensor(s, dtype=torch.long)
    packed = pack_padded_sequence(model.embed(padded), lengths, batch_first=True, enforce_sorted=False)
    out, _ = model.rnn(packed)
    out, _ = pad_packed_sequence(out, batch_first=True, total_length=int(lengths.max()))
    logp = _log_dist(model.head(out), temperature)
    result = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        if not c:
            result.append(torch.zeros(0))
            continue
        rows = logp[i, len(p) - 1: len(p) - 1 + len(c)]
        result.append(rows.gather(1, torch.as_tensor(list(c), dtype=torch.long).unsqueeze(1)).squeeze(1))
    return result
