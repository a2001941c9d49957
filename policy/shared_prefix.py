"""A group's prompt run through the model once in a training pass, not once per completion.

GRPO's records come in groups: one prompt, G completions. A padded batch runs the prompt's tokens through the model
G times. Here a group is one packed row, the prompt and then each completion but its last token, with a mask that lets
each completion attend to the prompt and to its own earlier tokens only, and positions that continue from the
prompt's in every completion. So each completion token is predicted from exactly what the padded batch predicts it
from, and the prompt's gradient is the sum over its completions, as there. On the demo's batch (prompts of about 40
tokens, groups of 8 completions of 16) a group is 160 tokens instead of 448.

Rows share when their prompt tokens are equal (a group's records, or any that happen to); a row alone, or a model
whose attention cannot take such a mask (``packable``), runs as a padded row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


def packable(model: Any) -> bool:
    """Attention that takes a 4D mask as given (transformers' SDPA and eager kernels), with no sliding window the
    mask would override."""
    config = model.config
    windowed = getattr(config, "sliding_window", None) or "sliding_attention" in (getattr(config, "layer_types", None)
                                                                                  or ())
    return getattr(config, "_attn_implementation", None) in ("sdpa", "eager") and not windowed


def _inputs(seq_lens: torch.Tensor, i: int, p: int) -> int:
    """A row's completion tokens that are inputs of a packed row: all but its last (which is only predicted)."""
    return int(seq_lens[i]) - p - 1


def _packed_width(rows: list[int], p: int, seq_lens: torch.Tensor) -> int:
    return p + sum(_inputs(seq_lens, i, p) for i in rows)


@dataclass
class Layout:
    """Which rows run padded (``singles``) and which share their prompt (``groups``: rows, each group's prompt
    length)."""

    singles: list[int] = field(default_factory=list)
    groups: list[tuple[list[int], int]] = field(default_factory=list)


def layout(input_ids: torch.Tensor, wanted: torch.Tensor, prompt_lens: torch.Tensor, seq_lens: torch.Tensor,
           max_width: int | None = None) -> Layout:
    """Rows with equal prompt tokens, a completion, and nothing to predict inside the prompt, grouped, each group at
    most ``max_width`` tokens packed (a longer one is cut in several, each with the prompt; attention's memory grows
    with the square of a row's width); the rest single."""
    by_prompt: dict[tuple[int, bytes], list[int]] = {}
    out = Layout()
    for i in range(input_ids.shape[0]):
        p, n = int(prompt_lens[i]), int(seq_lens[i])
        if p < 1 or n <= p or bool(wanted[i, :p - 1].any()) or (max_width is not None and n - 1 > max_width):
            out.singles.append(i)
        else:
            by_prompt.setdefault((p, input_ids[i, :p].numpy().tobytes()), []).append(i)
    for (p, _), rows in by_prompt.items():
        packs: list[list[int]] = [[]]
        width = p
        for i in rows:
            n = _inputs(seq_lens, i, p)
            if max_width is not None and packs[-1] and width + n > max_width:
                packs.append([])
                width = p
            packs[-1].append(i)
            width += n
        for pack in packs:
            if len(pack) > 1:
                out.groups.append((pack, p))
            else:
                out.singles += pack
    out.singles.sort()
    return out


def micro_batches(input_ids: torch.Tensor, wanted: torch.Tensor, prompt_lens: torch.Tensor, seq_lens: torch.Tensor,
                  budget: int) -> list[tuple[list[int], int]]:
    """The rows of each micro-batch and its widest forward row, within ``budget`` tokens (forward rows x the widest):
    a group's members together in one packed row of at most ``budget`` tokens, a row alone as it is."""
    plan = layout(input_ids, wanted, prompt_lens, seq_lens, max_width=budget)
    units = [(_packed_width(rows, p, seq_lens), rows) for rows, p in plan.groups]
    units += [(int(seq_lens[i]) - 1, [i]) for i in plan.singles]
    units.sort(key=lambda u: -u[0])  # widest first: each micro-batch pads to its first unit's width
    out: list[tuple[list[int], int]] = []
    count = 0
    for width, rows in units:
        if out and (count + 1) * out[-1][1] <= budget:
            out[-1][0].extend(rows)
            count += 1
        else:
            out.append((list(rows), width))
            count = 1
    return out


def hidden_at(body: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, wanted: torch.Tensor,
              prompt_lens: torch.Tensor, seq_lens: torch.Tensor, max_width: int | None = None) -> torch.Tensor:
    """The last hidden state that predicts ``input_ids[i, t + 1]``, for every wanted ``(i, t)`` in row-major order:
    what ``body(input_ids[:, :-1], ...).last_hidden_state[wanted]`` gives, from fewer tokens (``layout``)."""
    cpu = lambda x: x.detach().cpu()  # noqa: E731: the layout is bookkeeping, not compute
    plan = layout(cpu(input_ids), cpu(wanted), cpu(prompt_lens), cpu(seq_lens), max_width)
    device = input_ids.device
    source = torch.full(wanted.shape, -1, dtype=torch.long)  # where each (i, t)'s hidden state is, in ``parts``
    parts, base = [], 0
    if plan.singles:
        rows = torch.tensor(plan.singles, device=device)
        width = max(1, int(seq_lens[plan.singles].max()) - 1)
        h = body(input_ids=input_ids[rows, :width], attention_mask=attention_mask[rows, :width],
                 use_cache=False).last_hidden_state
        for a, i in enumerate(plan.singles):
            source[i, :width] = base + a * width + torch.arange(width)
        parts.append(h.reshape(-1, h.shape[-1]))
        base += h.shape[0] * width
    if plan.groups:
        ids, pos, mask, width = _packed(input_ids, plan, seq_lens)
        h = body(input_ids=ids.to(device), attention_mask=_as_attention(mask, body).to(device),
                 position_ids=pos.to(device), use_cache=False).last_hidden_state
        for g, (rows, p) in enumerate(plan.groups):
            at = base + g * width
            offset = p
            for i in rows:
                n = _inputs(seq_lens, i, p)
                source[i, p - 1] = at + p - 1  # the prompt's last position predicts every completion's first token
                source[i, p:p + n] = at + offset + torch.arange(n)
                offset += n
        parts.append(h.reshape(-1, h.shape[-1]))
    picked = source[cpu(wanted)]
    assert bool((picked >= 0).all()), "a wanted position with no hidden state"
    return torch.cat(parts)[picked.to(device)]


def _packed(input_ids: torch.Tensor, plan: Layout, seq_lens: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """One row per group (ids, positions) and its [G, 1, W, W] boolean mask (True: attends); padding attends to
    itself only, so that no row of the mask is empty."""
    width = max(_packed_width(rows, p, seq_lens) for rows, p in plan.groups)
    G = len(plan.groups)
    ids = torch.zeros((G, width), dtype=torch.long)
    pos = torch.zeros((G, width), dtype=torch.long)
    mask = torch.eye(width, dtype=torch.bool).repeat(G, 1, 1)
    src = input_ids.detach().cpu()
    for g, (rows, p) in enumerate(plan.groups):
        ids[g, :p] = src[rows[0], :p]
        pos[g, :p] = torch.arange(p)
        mask[g, :p, :p] = torch.ones((p, p), dtype=torch.bool).tril()
        at = p
        for i in rows:
            n = _inputs(seq_lens, i, p)
            ids[g, at:at + n] = src[i, p:p + n]
            pos[g, at:at + n] = torch.arange(p, p + n)
            mask[g, at:at + n, :p] = True
            mask[g, at:at + n, at:at + n] = torch.ones((n, n), dtype=torch.bool).tril()
            at += n
    return ids, pos, mask.unsqueeze(1), width


def _as_attention(mask: torch.Tensor, body: Any) -> torch.Tensor:
    """SDPA takes the boolean mask; transformers' eager attention adds it to its scores."""
    if body.config._attn_implementation == "sdpa":
        return mask
    return torch.zeros(mask.shape, dtype=torch.float32).masked_fill(~mask, torch.finfo(torch.float32).min)
