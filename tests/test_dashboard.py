"""`rollout dashboard` in a real headless Chromium (Debian's chromium + chromedriver, installed by .ci/setup) against
a running pipeline (verifier, credit, batcher, trainer on a real broker): the page loads, draws its charts, shows the
lag, dead letters and latest rollouts, updates by itself when new revisions land, shows a revision's lineage, and a
screenshot is kept at tests/artifacts/dashboard.png. The fold behind it (replay/live.py) is tested without Kafka.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from consumers import scoring, testing
from consumers.registry import SERVICES
from consumers.runner import System
from consumers.settings import ServiceSettings
from replay.live import LiveRun
from schemas.batch import assemble_batch
from schemas.events import DeadLetter
from streams import topics
from schemas import codec
from schemas.policy import PolicyRevision
from streams import metrics
from tests._processes import stop
from tests.test_eos_pipeline import prefix, read_all  # noqa: F401 - fixture
from tests.test_metrics import free_base, scrape, total

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "tests" / "artifacts"
PLAN = "examples/plans/arithmetic.toml"


# -- the fold, without Kafka ---------------------------------------------------------------------------------
async def test_live_fold_reward_staleness_dead_letters_lineage():
    run = LiveRun(recent=5)
    rev0, rev1 = testing.revision(0), testing.revision(1)
    run.apply(rev0)
    records, scored = [], []
    for g in range(2):
        for steps, ro in testing.arithmetic_group(f"g{g}", 4):
            ro = ro.model_copy(update={"artifacts": {**ro.artifacts, "final_text": steps[0].completion[0].content}})
            run.apply(ro)
            sc = scoring.to_scored(ro, steps, await scoring.score(ro, steps), producer="verifier")
            run.apply(sc)
            scored.append(sc)
            records.append(testing.training_record(len(records), reward=sc.rewards["solver"]).model_copy(
                update={"rollout_id": ro.rollout_id}))
    batch = assemble_batch(records, rev0, 2, run_id="run", producer="batcher")
    run.apply(batch)
    run.apply(rev1.model_copy(update={"parent_revision": 0, "batch_id": batch.batch_id, "metrics": {
        "loss": 0.5, "step_s": 0.2, "mismatch_mean": 0.01, "mismatch_max": 0.1}}))
    right = 0  # held-out answers from r1: accuracy is the share whose answer is the sum
    for steps, ro in testing.arithmetic_group("eval", 4, revision_=1):
        ro = ro.model_copy(update={"evaluation": True})
        run.apply(ro)
        run.apply(scoring.to_scored(ro, steps, await scoring.score(ro, steps), producer="verifier"))
        right += steps[0].completion[0].content == f"The answer is {ro.seed['a'] + ro.seed['b']}"
    run.apply(DeadLetter(run_id="run", producer="batcher", origin_topic="t", origin_partition=0, origin_offset=3,
                         raw=b"x", error_type="StaleRecordError", error_message="3 behind", service="batcher"))
    snap = run.snapshot()
    assert snap["latest_revision"] == 1
    r0 = next(r for r in snap["revisions"] if r["revision"] == 0)
    rewards = [sc.rewards["solver"] for sc in scored]
    assert r0["rollouts"] == 8 and r0["reward_mean"] == pytest.approx(sum(rewards) / 8)
    assert 0 < sum(rewards) < 8  # about half the test rollouts answer right: the mean is not a constant
    r1 = next(r for r in snap["revisions"] if r["revision"] == 1)
    assert (r1["loss"], r1["mismatch_max"], r1["batch_id"]) == (0.5, 0.1, batch.batch_id)
    assert (r1["eval_answers"], r1["eval_accuracy"], r1["rollouts"]) == (4, right / 4, 0)
    assert snap["staleness"] == [{"staleness": 0, "records": 8}]
    assert snap["dead_letters"] == [{"service": "batcher", "reason": "StaleRecordError", "count": 1, "refusal": True}]
    assert len(snap["rollouts"]) == 5 and snap["rollouts"][-1]["reward"] is not None
    assert snap["rollouts"][-1]["text"].startswith("The answer is")
    lin = run.lineage(testing.FAMILY, 1)
    assert lin["chain"] == [1, 0] and lin["batch"]["batch_id"] == batch.batch_id
    assert {r["rollout_id"] for r in lin["rollouts"]} == {r.rollout_id for r in records}
    assert run.lineage(testing.FAMILY, 7) is None


async def test_lineage_of_an_org_slash_name_family_over_http():
    """A family named as Hugging Face names models (``org/name``) holds a slash: the page percent-encodes it, the
    server (real uvicorn, which decodes the path before routing) takes every segment but the last as the family."""
    import uvicorn

    from rollout.dashboard import PAGE, create_app

    fam = "HuggingFaceTB/SmolLM2-135M-Instruct"
    app = create_app({}, prefix="x.")  # no lifespan below: nothing reads Kafka, the fold is fed by hand
    live = app.state.live
    rev0 = testing.revision(0, family=fam)
    records = [testing.training_record(i, family=fam) for i in range(4)]
    batch = assemble_batch(records, rev0, 1, run_id="run", producer="batcher")
    live.apply(rev0)
    live.apply(batch)
    live.apply(testing.revision(1, family=fam).model_copy(update={"batch_id": batch.batch_id}))
    live.apply(testing.revision(0, family="SmolLM2-135M-Instruct"))  # the family's last part alone: another family
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="warning"))
    serving = asyncio.create_task(server.serve())
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
            for _ in range(100):
                if server.started:
                    break
                await asyncio.sleep(0.05)
            for path in ("/api/lineage/HuggingFaceTB%2FSmolLM2-135M-Instruct/1",  # what the page sends
                         "/api/lineage/HuggingFaceTB/SmolLM2-135M-Instruct/1"):
                r = await http.get(path)
                assert r.status_code == 200, (path, r.text)
                got = r.json()
                assert got["chain"] == [1, 0] and got["batch"]["batch_id"] == batch.batch_id
                assert got["batch"]["family"] == fam
            r = await http.get("/api/lineage/SmolLM2-135M-Instruct/1")
            assert r.status_code == 404 and "SmolLM2-135M-Instruct@r1" in r.json()["detail"]
            assert (await http.get("/api/lineage/SmolLM2-135M-Instruct/0")).json()["chain"] == [0]
            r = await http.get("/api/lineage/HuggingFaceTB%2FSmolLM2-135M-Instruct/7")
            assert r.status_code == 404 and f"{fam}@r7" in r.json()["detail"]
    finally:
        server.should_exit = True
        await serving
    assert "/api/lineage/${encodeURIComponent(family)}/${revision}" in PAGE


# -- the page in Chromium, against a running pipeline --------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chromium():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1200"):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)


def wait_for(driver, js: str, timeout_s: float = 90.0):
    """Poll a JS expression in the page until it is truthy; its value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = driver.execute_script(f"return ({js});")
        if got:
            return got
        time.sleep(0.5)
    raise AssertionError(f"page never satisfied {js!r}; body error: "
                         f"{driver.execute_script('return document.body.dataset.error')!r}")


@pytest.mark.integration
async def test_dashboard_in_chromium_follows_a_running_pipeline(kafka_settings, kafka_bootstrap, prefix, tmp_path,  # noqa: F811
                                                               monkeypatch):
    """The arena (tiny local policy server, following revisions) and every service run; the dashboard runs as
    `rollout dashboard`, in its own process; Chromium loads its page. Then the arena stops, and the trainer's
    metrics endpoint agrees with the revisions on the log."""
    from aiokafka import AIOKafkaProducer

    from consumers import settings as service_settings
    from schemas.plan_compiler import compile_plan

    kw = kafka_settings.client_kwargs()
    # the example plan with batches of 16 and groups of 4: revisions land often, so the test sees several
    plan_path = tmp_path / "plan.toml"
    plan_path.write_text((ROOT / PLAN).read_text().replace("batch_size = 64", "batch_size = 16")
                         .replace("group_size = 8", "group_size = 4"))
    plan = compile_plan(str(plan_path))
    assert (plan.batch_size, plan.group_size) == (16, 4)
    cfg = service_settings.build({"checkpoint_dir": str(tmp_path / "ck"), "flush_after_s": 5.0}, plan, credit=True)
    names = [n for n, s in SERVICES.items() if s.needed(cfg)]  # as the demo starts them: no reference here
    assert len(names) == 4
    await topics.create_topics(kw)
    offsets = [metrics.OFFSETS["arena"], metrics.SERVICE_OFFSET + list(SERVICES).index("trainer")]
    base = free_base(offsets)
    monkeypatch.setenv("ROLLOUT_METRICS_PORT", str(base))
    env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": kafka_bootstrap}
    port = free_port()
    procs: dict[str, subprocess.Popen] = {}
    driver = None

    def start(name: str, *argv: str) -> None:
        procs[name] = subprocess.Popen([sys.executable, "-m", "rollout.cli", *argv], cwd=ROOT, env=env,
                                       stdout=(tmp_path / f"{name}.log").open("w"), stderr=subprocess.STDOUT)

    def logs() -> str:
        return "\n".join(f"--- {n}\n{(tmp_path / f'{n}.log').read_text()[-3000:]}" for n in procs)

    try:
        t0 = time.monotonic()
        stage = lambda what: print(f"[{time.monotonic() - t0:5.1f}s] {what}")  # noqa: E731
        async with System(names, cfg, kw) as system:
            stage("services started")
            trainer_endpoint = system.metrics["trainer"]
            assert trainer_endpoint.port == base + offsets[1] and trainer_endpoint._server is not None, \
                "the trainer's metrics endpoint did not bind (see the log for why)"
            start("dashboard", "dashboard", "--port", str(port), "--lag-every", "1")
            start("arena", "arena", str(plan_path), "--groups", "0", "--follow-revisions", "--evaluate", "--no-progress",
                  "--concurrency", "4", "--policy-port", "0")
            prod = AIOKafkaProducer(**kw)  # one undecodable step: a dead letter to show
            await prod.start()
            await prod.send_and_wait(topics.STEPS.name, b"garbage", key=b"k")
            await prod.stop()
            for _ in range(240):
                assert all(p.poll() is None for p in procs.values()), logs()
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/api/state", timeout=2).json()["latest_revision"]:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(1)
            else:
                raise AssertionError(f"no trained revision in 4 minutes\n{logs()}")
            stage("a trained revision on the dashboard's API")
            driver = await asyncio.to_thread(chromium)
            await asyncio.to_thread(driver.get, f"http://127.0.0.1:{port}/")
            first = int(await asyncio.to_thread(wait_for, driver, "Number(document.body.dataset.latestRevision)"))
            assert first >= 1
            stage(f"page shows r{first}")
            # charts drawn by vega-embed (served by the app, no network), tables filled
            await asyncio.to_thread(wait_for, driver, "['by-revision', 'staleness', 'dead-letters'].every("
                                    "c => document.querySelector(`#chart-${c} svg .mark-rect, #chart-${c} svg "
                                    ".mark-line, #chart-${c} svg .mark-symbol`))")
            await asyncio.to_thread(wait_for, driver, "document.querySelectorAll('#lag tbody tr').length === 4")
            rollouts_text = await asyncio.to_thread(wait_for, driver,
                                                    "document.querySelector('#rollouts tbody').innerText")
            assert "arithmetic" in rollouts_text
            dl_text = await asyncio.to_thread(wait_for, driver, "document.querySelector('#dead-letters tbody').innerText")
            assert "verifier" in dl_text and "failure" in dl_text
            stage("charts and tables drawn")
            # newer revisions land and the page shows them without a reload
            later = int(await asyncio.to_thread(
                wait_for, driver, f"Number(document.body.dataset.latestRevision) > {first} && "
                                  "Number(document.body.dataset.latestRevision)", 240))
            assert later > first, logs()
            stage(f"page shows r{later} without a reload")
            # a revision's lineage: click its row -> its batch's records, with their rollouts' text
            await asyncio.to_thread(driver.execute_script,
                                    f"document.querySelector('tr.rev[data-revision=\"{later}\"]').click()")
            lineage = await asyncio.to_thread(wait_for, driver, "document.querySelector('#lineage-records') && "
                                                                "document.querySelector('#lineage').innerText")
            assert f"lineage of {plan.family}@r{later}" in lineage
            api = httpx.get(f"http://127.0.0.1:{port}/api/lineage/{plan.family}/{later}", timeout=5).json()
            assert api["chain"] == list(range(later, -1, -1)) and len(api["rollouts"]) > 0
            assert await asyncio.to_thread(driver.execute_script, "return document.querySelectorAll("
                                           "'#lineage-records tbody tr').length") == len(api["batch"]["records"]) > 0
            # any revision's lineage, asked for by number
            await asyncio.to_thread(driver.execute_script, "document.getElementById('lineage-revision').value = 1; "
                                    "document.querySelector('#lineage-form button').click()")
            await asyncio.to_thread(wait_for, driver, "document.querySelector('#lineage h2').innerText.endsWith('@r1')")
            stage("lineage shown")
            await asyncio.to_thread(driver.execute_script, f"document.querySelector('tr.rev[data-revision=\"{later}\"]')"
                                    ".click()")
            await asyncio.to_thread(wait_for, driver, f"document.querySelector('#lineage h2').innerText.endsWith("
                                                      f"'@r{later}')")
            ARTIFACTS.mkdir(exist_ok=True)
            # the window (1400x1200: larger ones crash this headless renderer), then the lineage scrolled into it
            shots = [ARTIFACTS / "dashboard.png", ARTIFACTS / "dashboard-lineage.png"]
            await asyncio.to_thread(driver.execute_script, "window.scrollTo(0, 0)")
            await asyncio.sleep(1.0)
            await asyncio.to_thread(driver.save_screenshot, str(shots[0]))
            await asyncio.to_thread(driver.execute_script, "document.getElementById('lineage').scrollIntoView()")
            await asyncio.sleep(1.0)
            await asyncio.to_thread(driver.save_screenshot, str(shots[1]))
            assert all(p.stat().st_size > 10_000 for p in shots)
            print(f"dashboard screenshots: {shots[0]} {shots[1]}")

            # the arena stops; once the trainer has trained what is left, its counters match the log
            arena_metrics = scrape(base + offsets[0])
            assert total(arena_metrics, "rollout_arena_rollouts_total", status="all") > 0
            procs["arena"].send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(procs["arena"].wait, 60) == 0
            trained: list = []
            for _ in range(60):
                await asyncio.sleep(2.0)
                revs = [codec.decode(r.value, PolicyRevision) for r in
                        await read_all(kw, topics.POLICY_REVISIONS.name, idle_s=0.5, timeout_s=10)]
                if trained and len(revs) == len(trained) + 1:
                    break
                trained = [r for r in revs if r.batch_id is not None]
            trainer = scrape(base + offsets[1])
            assert total(trainer, "rollout_trainer_step_seconds_count") == len(trained) >= later
            assert total(trainer, "rollout_trainer_revision") == max(r.revision for r in trained)
            assert total(trainer, "rollout_records_out_total", topic=topics.POLICY_REVISIONS.name) == len(trained)
            assert ("rollout_trainer_logprob_mismatch", (("service", "trainer"), ("stat", "max"))) in trainer
    finally:
        if driver is not None:
            await asyncio.to_thread(driver.quit)
        stop(*procs.values())
