"""The growth benchmark's own arithmetic and its memory guard (``benchmarks/growth.py``); its figures are in
benchmarks/RESULTS.md, not asserted here."""

from __future__ import annotations

import pytest

from benchmarks import growth


def test_the_135m_shape_counts_the_parameters_of_the_model_it_builds():
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(growth._config("135m"), dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == growth.parameters("135m")
    # SmolLM2-360M's published size, and a ~1B shape
    assert 360e6 < growth.parameters("360m") < 365e6 and 1.0e9 < growth.parameters("1b") < 1.1e9


def test_rows_share_a_prompt_within_a_group_and_fill_the_tokens_asked():
    prompts, completions, group = growth._rows(4096)
    assert (len(prompts), group) == (8, 8) and prompts.shape[1] + completions.shape[1] == 512
    assert (prompts == prompts[0]).all()
    prompts, _, group = growth._rows(16384)
    assert group == 8 and len(prompts) == 32 and (prompts[8] != prompts[0]).any() and (prompts[8] == prompts[15]).all()


def test_slopes_are_least_squares_per_line_and_failed_points_are_left_out():
    rows = [{"model": "135m", "params": 135e6, "dtype": "float32", "side": "ours", "tokens": t, "step_s": s,
             "peak_mb": m} for t, s, m in [(1000, 2.0, 100), (2000, 4.0, 100), (4000, 8.0, 100)]]
    rows.append({"model": "135m", "params": 135e6, "dtype": "float32", "side": "ours", "tokens": 8000,
                 "error": "over the limit: RSS reached 18.0 GB", "peak_mb": 18000})
    rows.append({"model": "360m", "params": 360e6, "dtype": "float32", "side": "ours", "tokens": 1000, "step_s": 6.5,
                 "peak_mb": 300})
    fits = growth.slopes(rows)
    line = next(f for f in fits if f.get("model") == "135m")
    assert line["points"] == 3 and line["s_per_1k_tokens"] == pytest.approx(2.0) and line["mb_per_1k_tokens"] == 0
    size = next(f for f in fits if f.get("tokens") == 1000)
    assert size["points"] == 2 and size["s_per_100m_params"] == pytest.approx(4.5 / 2.25)
    table = growth.table(rows)
    assert "over the limit: RSS reached 18.0 GB" in table and "| 360m | float32 | 1,000 | 6.5 |" in table


def test_a_point_past_the_memory_limit_is_killed_and_says_so():
    """The guard that keeps a point from taking the machine: a 1 MB limit kills the child as it starts."""
    r = growth._child("135m", 1024, "float32", "ours", limit_mb=1.0, timeout_s=120)
    assert r["error"].startswith("over the limit: RSS reached") and "step_s" not in r
