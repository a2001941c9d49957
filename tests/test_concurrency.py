"""The cap on episodes in flight (``producers.arena.concurrency``) and the recipe's ``[orchestrator.concurrency]``:
the rules fed readings by hand, the moving semaphore on a real event loop, the bounds as prime-rl checks them."""

from __future__ import annotations

import asyncio

import pytest

from producers.arena.concurrency import (CUT, HOLD_TURNOVERS, MEMORY_RESERVE, PER_CORE, PROBE_POLLS, SHRINK_WORTH,
                                         InflightCap, Limiter, Load)
from schemas.plan import Concurrency
from schemas.plan_compiler import PlanError, compile_plan_dict

GB = 1 << 30
ROOMY = dict(available=20 * GB, total=24 * GB)


def finish(cap: InflightCap, n: int, every_s: float, start: float) -> float:
    """``n`` episodes finished ``every_s`` apart after ``start``: the time of the last."""
    for i in range(1, n + 1):
        cap.completed(start + i * every_s)
    return start + n * every_s


def test_a_plan_without_the_table_starts_at_the_arenas_number_and_never_grows_past_it():
    cap = InflightCap.fixed_start(32)
    assert cap.cap == 32
    t = finish(cap, 40, 0.1, 0.0)
    assert cap.observe(Load(**ROOMY, episodes=0, kv_usage=0.1, waiting=0), 32) == 32  # growth bounded by 32
    assert cap.trial is None and t > 0


def test_unset_initial_starts_at_min_inflight_then_at_the_engines_kv_capacity_within_the_bounds():
    cap = InflightCap(Concurrency(min_inflight=2, max_inflight=64))
    assert cap.cap == 2
    assert cap.observe(Load(**ROOMY, kv_sequences=None), 0) == 2
    assert cap.observe(Load(**ROOMY, kv_sequences=120), 2) == 64  # 120 full-length sequences fit; the ceiling is 64
    assert InflightCap(Concurrency(min_inflight=2)).observe(Load(**ROOMY, kv_sequences=120), 0) == 120


def test_a_start_the_recipe_does_not_set_is_held_to_the_cores_until_the_episodes_are_known():
    # episodes that run in the arena: opened to --concurrency after PROBE_POLLS polls with episodes in flight
    held = 2 * PER_CORE
    cap = InflightCap.fixed_start(32, cores=2)
    assert cap.cap == held
    assert cap.observe(Load(**ROOMY, processes=0), 0) == held  # nothing in flight yet: not a probe
    for _ in range(PROBE_POLLS - 1):
        assert cap.observe(Load(**ROOMY, processes=0), held) == held
    assert cap.observe(Load(**ROOMY, processes=0), held) == 32 and cap.episodes == "in the arena"
    # or as soon as one of them finished without a process seen
    early = InflightCap.fixed_start(32, cores=2)
    early.completed(1.0)
    assert early.observe(Load(**ROOMY, processes=0), 1) == 32
    # a recipe's table without initial_inflight: opened to the engine's KV capacity, within its bounds
    table = InflightCap(Concurrency(max_inflight=48), cores=1)
    assert table.observe(Load(**ROOMY, processes=0, kv_sequences=None), PER_CORE) == PER_CORE
    assert table.observe(Load(**ROOMY, processes=0, kv_sequences=None), PER_CORE) == PER_CORE  # the capacity unread
    assert table.observe(Load(**ROOMY, processes=0, kv_sequences=100), PER_CORE) == 48
    # a recipe's initial_inflight is where it starts, whatever the cores
    assert InflightCap(Concurrency(initial_inflight=12), cores=2).cap == 12


def test_episodes_that_run_processes_stay_where_the_cores_hold_them_and_move_only_by_trials():
    cap = InflightCap.fixed_start(32, cores=1)
    n = PER_CORE
    busy = Load(**ROOMY, processes=2 * n, episodes=n * 150 * 2**20, kv_usage=0.1, waiting=0)  # a server, a harness
    assert cap.observe(busy, n) == n and cap.episodes == "processes"
    for _ in range(PROBE_POLLS + 2):
        assert cap.observe(busy, n) == n  # not opened: no finishing rate yet to try a change on
    t = finish(cap, n + 1, 1.0, 0.0)
    grown = cap.observe(busy, n)
    assert grown > n and cap.trial.kind == "grow"
    finish(cap, 2 * grown, 0.5, t)  # finishing twice as fast: kept
    assert cap.observe(busy, grown) == grown and "kept" in cap.reason


def test_memory_under_the_reserve_cuts_as_many_episodes_as_would_give_it_back():
    cap = InflightCap(Concurrency(initial_inflight=28, max_inflight=64))
    # 28 episodes hold 7 GB (256 MB each); the machine has 2 GB free of 24: 1.6 GB under its 15% reserve
    free = 2 * GB
    short = MEMORY_RESERVE * 24 * GB - free
    got = cap.observe(Load(available=free, total=24 * GB, episodes=28 * 256 * 2**20), 28)
    assert got == 28 - -(-short // (256 * 2**20)) and cap.reason == "memory under the reserve"
    # episodes that hold nothing are not what the memory went to: no cut
    idle = InflightCap(Concurrency(initial_inflight=28))
    assert idle.observe(Load(available=free, total=24 * GB, episodes=0), 28) == 28
    # the cost not known yet: a fixed cut
    blind = InflightCap(Concurrency(initial_inflight=20))
    assert blind.observe(Load(available=free, total=24 * GB), 20) == int(20 * CUT)


def test_the_engines_preemptions_and_a_full_kv_cache_cut_at_once():
    cap = InflightCap(Concurrency(initial_inflight=40))
    assert cap.observe(Load(**ROOMY, preemptions=3, kv_usage=0.5), 40) == 40  # the counter's first reading
    assert cap.observe(Load(**ROOMY, preemptions=3, kv_usage=0.5), 40) == 40
    assert cap.observe(Load(**ROOMY, preemptions=5, kv_usage=0.5), 40) == 32
    assert cap.observe(Load(**ROOMY, preemptions=5, kv_usage=0.95), 32) == int(32 * 0.7 / 0.95)
    floor = InflightCap(Concurrency(initial_inflight=4, min_inflight=4))
    floor.observe(Load(**ROOMY, preemptions=0), 4)
    assert floor.observe(Load(**ROOMY, preemptions=9), 4) == 4  # never under min_inflight


def test_growth_is_a_trial_kept_only_if_episodes_finish_faster():
    cap = InflightCap(Concurrency(initial_inflight=8, max_inflight=64))
    free = Load(**ROOMY, episodes=8 << 20, kv_usage=0.2, waiting=0)
    assert cap.observe(free, 8) == 8  # no finishing rate yet
    t = finish(cap, 9, 1.0, 0.0)  # 1 episode/s
    assert cap.observe(free, 8) == 10 and cap.trial.kind == "grow"
    t = finish(cap, 10, 0.5, t)  # the first turnover after the change: not judged yet
    assert cap.observe(free, 10) == 10 and cap.trial is not None
    finish(cap, 10, 0.5, t)  # the second: 2 episodes/s, kept
    assert cap.observe(free, 10) == 10 and cap.trial is None and "kept" in cap.reason
    # growth tried again (shrink held): a rate that does not rise undoes it, and growth is held
    assert cap.observe(free, 10) == 13 and cap.trial.kind == "grow"
    t = finish(cap, 26, 0.5, t)
    assert cap.observe(free, 13) == 10 and "undone" in cap.reason
    assert cap.observe(free, 10) == 10 and cap.held["grow"] >= cap.finished + (HOLD_TURNOVERS - 1) * 10


def test_growth_waits_for_room_in_the_engine_and_the_machine_and_for_the_cap_to_bind():
    def ready() -> InflightCap:
        cap = InflightCap(Concurrency(initial_inflight=8))
        finish(cap, 9, 1.0, 0.0)
        return cap

    assert ready().observe(Load(**ROOMY, kv_usage=0.7, waiting=0), 8) == 8  # the KV cache above 0.6
    assert ready().observe(Load(**ROOMY, kv_usage=0.2, waiting=3), 8) == 8  # requests queued in vLLM
    assert ready().observe(Load(**ROOMY, kv_usage=0.2, waiting=0), 5) == 8  # 5 in flight: the cap is not binding
    cap = ready()
    cap.cost = 2 * GB  # two more would not fit above the reserve
    tight = Load(available=int(MEMORY_RESERVE * 24 * GB) + 3 * GB, total=24 * GB, kv_usage=0.2, waiting=0)
    assert cap.observe(tight, 8) <= 8  # no growth (a shrink may be tried: an episode holds 2 GB)


def test_costly_episodes_are_shrunk_while_the_rate_holds_and_the_shrink_undone_when_it_falls():
    cap = InflightCap(Concurrency(initial_inflight=20, max_inflight=20))
    heavy = Load(**ROOMY, episodes=20 * 256 * 2**20, kv_usage=0.7, waiting=0)  # 256 MB an episode
    t = finish(cap, 21, 0.5, 0.0)
    assert cap.observe(heavy, 20) == 16 and cap.trial.kind == "shrink"
    t = finish(cap, 32, 0.5, t)  # the same rate with fewer in flight: kept
    assert cap.observe(heavy, 16) == 16 and "kept" in cap.reason
    assert cap.observe(heavy, 16) == 12  # and tried again
    t = finish(cap, 24, 1.0, t)  # half the rate: undone, shrinking held
    assert cap.observe(heavy, 12) == 16 and "undone" in cap.reason
    assert cap.observe(heavy, 16) == 16 and cap.trial is None
    light = InflightCap(Concurrency(initial_inflight=20, max_inflight=20))
    finish(light, 21, 0.5, 0.0)
    assert light.observe(Load(**ROOMY, episodes=20 * (SHRINK_WORTH // 2), kv_usage=0.7), 20) == 20


def test_the_limiter_holds_new_acquisitions_under_a_lowered_limit_and_releases_them_when_raised():
    async def main() -> None:
        lim = Limiter(2)
        assert await lim.acquire() and await lim.acquire()
        waiting = asyncio.ensure_future(lim.acquire())
        await asyncio.sleep(0.01)
        assert not waiting.done()
        lim.set_limit(1)
        lim.release()  # 1 held, limit 1: still waits
        await asyncio.sleep(0.01)
        assert not waiting.done() and lim.held == 1
        lim.set_limit(3)
        await asyncio.sleep(0.01)
        assert waiting.done() and lim.held == 2
        # a waiter cancelled after its wake-up passes it on: nothing is held by it, the next gets the slot
        lim.set_limit(2)
        a, b = asyncio.ensure_future(lim.acquire()), asyncio.ensure_future(lim.acquire())
        await asyncio.sleep(0.01)
        lim.release()
        a.cancel()
        await asyncio.sleep(0.01)
        assert a.cancelled() and b.done() and lim.held == 2

    asyncio.run(main())


RECIPE = {"model": {"name": "HuggingFaceTB/SmolLM2-135M-Instruct"},
          "orchestrator": {"batch_size": 16, "train": {"group_size": 4, "env": [{"id": "arithmetic"}]}}}


def _with(table: dict) -> dict:
    return {**RECIPE, "orchestrator": {**RECIPE["orchestrator"], "concurrency": table}}


def test_the_recipes_concurrency_table_compiles_to_the_plan_with_prime_rls_bounds():
    plan = compile_plan_dict(_with({"initial_inflight": 8, "max_inflight": 128}), "r.toml")
    assert plan.concurrency == Concurrency(initial_inflight=8, min_inflight=1, max_inflight=128)
    assert compile_plan_dict(RECIPE, "r.toml").concurrency is None
    assert not [k for k in compile_plan_dict(_with({"max_inflight": 128}), "r.toml").ignored_sections
                if "concurrency" in k]
    for table, said in (({"min_inflight": 9, "max_inflight": 4}, "min_inflight (9) is above max_inflight"),
                        ({"initial_inflight": 2, "min_inflight": 4}, "initial_inflight (2) is outside"),
                        ({"max_inflight": 0}, "must be >= 1"), ({"max_inflight_x": 3}, "unknown key")):
        with pytest.raises(PlanError, match=r"orchestrator\.concurrency.*" + said.replace("(", r"\(").replace(")", r"\)")):
            compile_plan_dict(_with(table), "r.toml")


def test_the_probe_counts_the_processes_episodes_start_and_their_memory_from_proc():
    """The readings the cores' rule takes, from this process's real tree: two children started after the reading at
    rest are two processes of the episodes, and the memory they hold is theirs."""
    import os
    import subprocess
    import sys

    from producers.arena.concurrency import LoadProbe

    async def main() -> None:
        probe = LoadProbe(None, [], set(), os.getpid())
        rest = await probe.take(0)
        assert rest.processes == 0 and rest.episodes < 16 << 20 and rest.total and rest.available
        kids = [subprocess.Popen([sys.executable, "-c", "b = bytearray(64 << 20); import time; time.sleep(30)"])
                for _ in range(2)]
        try:
            await asyncio.sleep(1.5)
            busy = await probe.take(2)
            assert busy.processes == 2, busy
            assert busy.episodes >= 2 * (64 << 20), busy
        finally:
            for k in kids:
                k.kill()
                k.wait()

    asyncio.run(main())
