"""`rollout report` on a 10,000-batch run: readable axes, bounded size; and a pass rate that counts the
environment's passes, not rewards above zero.

Axis labels are read from Vega's scenegraph of each chart (what vl-convert renders into the PNG): the
labels Vega keeps visible after its overlap removal, with their positions. Their widths are not in the
scenegraph, so each label's box is estimated from its font size (0.65 em per character: DejaVu Sans,
the widest common sans-serif, has 0.636 em digits); the tests check those boxes do not overlap.
"""

from __future__ import annotations

import re

import duckdb
import pytest
import vl_convert

from replay.ingest import load_events
from replay.report import MAX_POINTS, build_report, figures, write_report
from replay.synthetic import generate_run
from test_replay_unit import flat, load, placed

BATCHES = 10_000
EM = 0.65  # estimated label width per character, in font sizes


@pytest.fixture(scope="module")
def big_db(tmp_path_factory):
    """A synthetic run of 10,000 rounds: 10,000 trainer batches and 10,001 revisions (one arithmetic group each)."""
    run = generate_run("big-run-00001", rounds=BATCHES, groups=1, group_size=2, prompt_tokens=4, completion_tokens=4,
                       eval_questions=2, environments=("arithmetic",))
    db = str(tmp_path_factory.mktemp("big") / "run.duckdb")
    con = duckdb.connect(db)
    load_events(con, run.run_id, placed(flat(run)))
    assert con.execute("SELECT count(*) FROM trainer_batches").fetchall() == [(BATCHES,)]
    con.close()
    return db


def axis_labels(spec: dict) -> list[tuple[str, list[dict]]]:
    """(orient, visible label items) for every axis in Vega's scenegraph of ``spec``."""
    found: list[tuple[str, list[dict]]] = []

    def walk(node, orient=None):
        if isinstance(node, list):
            for n in node:
                walk(n, orient)
        elif isinstance(node, dict):
            if node.get("role") == "axis":
                for item in node["items"]:
                    walk(item, item.get("orient"))
                return
            if node.get("role") == "axis-label":
                found.append((orient, [i for i in node["items"] if i.get("opacity", 1) > 0]))
            for v in node.values():
                walk(v, orient)

    walk(vl_convert.vegalite_to_scenegraph(spec)["scenegraph"])
    return found


def box(label: dict) -> tuple[float, float, float, float]:
    """(x0, y0, x1, y1) of an unrotated label, its width estimated from the font size."""
    w, h = EM * label["fontSize"] * len(label["text"]), label["fontSize"]
    x0 = label["x"] - {"left": 0, "center": w / 2, "right": w}[label.get("align", "center")]
    y0 = label["y"] - {"top": 0, "middle": h / 2, "bottom": h, "alphabetic": h}[label.get("baseline", "alphabetic")]
    return x0, y0, x0 + w, y0 + h


def overlaps(a, b) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def test_10000_batches_render_with_readable_axes(big_db, tmp_path):
    con = duckdb.connect(big_db, read_only=True)
    figs = figures(con)
    assert all(f.chart is not None for f in figs), [(f.name, f.note) for f in figs if f.chart is None]
    for f in figs:
        spec = f.chart.to_dict()
        for d in [spec.get("data")] + [layer.get("data") for layer in spec.get("layer", [])]:
            if d:  # binned: at most MAX_POINTS x values per series, whatever the run's length
                per_series: dict = {}
                for row in d["values"]:
                    key = (row.get("series"), row.get("staleness"))
                    per_series[key] = per_series.get(key, 0) + 1
                assert max(per_series.values()) <= MAX_POINTS, f.name
        axes = axis_labels(spec)
        assert {o for o, _ in axes} == {"bottom", "left"}, f.name
        for orient, labels in axes:
            assert 1 <= len(labels) <= 15, (f.name, orient, [x["text"] for x in labels])
            assert all(x.get("angle", 0) == 0 for x in labels)
            boxes = [box(x) for x in labels]
            clash = [(labels[i]["text"], labels[j]["text"]) for i in range(len(boxes)) for j in range(i + 1, len(boxes))
                     if overlaps(boxes[i], boxes[j])]
            assert not clash, (f.name, orient, clash)
        if f.name in ("trainer_batches", "staleness_per_batch", "reward_by_revision"):
            bottom = next(labels for o, labels in axes if o == "bottom")
            values = [int(x["text"].replace(",", "")) for x in bottom]
            assert values == sorted(values) and values[0] <= 0 and values[-1] >= 9_000, (f.name, values)
    con.close()

    png = tmp_path / "report.png"
    write_report(big_db, str(png), with_audit=False)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20]), int.from_bytes(data[20:24])
    assert 1000 < width < 2000 and 1000 < height < 2500, (width, height)  # the size of a small run's report

    html = tmp_path / "report.html"
    write_report(big_db, str(html), with_audit=False)
    page = html.read_text()
    assert len(page) < 8_000_000 and not re.search(r"""(src|href)=["']?https?:""", page)


def _shaped(score, exact: bool):
    """A rubric's verdict like arithmetic's shaped reward: 1 (exact) + 0.5 (numeric) + 0.5 * closeness, so
    every answer's reward is above zero and only the exact_answer function says whether it passed."""
    reward = (1.0 if exact else 0.0) + 0.5 + (0.5 if exact else 0.1)
    return score.model_copy(update={"verifier": "rubric", "rewards": {"solver": reward},
                                    "metrics": {"solver/reward/exact_answer": float(exact)}})


def test_pass_rate_counts_environment_passes_not_rewards_above_zero():
    run = generate_run("pass-run-0001", rounds=10, groups=3, group_size=5)
    items, n_arith, n_exact = [], 0, 0
    for key, e in flat(run):
        if key == "scores" and e.environment == "arithmetic@1":
            exact = n_arith % 10 == 0  # one answer in ten is right
            n_arith, n_exact = n_arith + 1, n_exact + exact
            e = _shaped(e, exact)
        items.append((key, e))
    con = load(items, run.run_id)
    rows = {r[0]: r[1:] for r in con.execute(
        "SELECT environment, pass_rate, passes, answers, pass_rule, mean_reward FROM v_env_pass_rates").fetchall()}
    rate, passes, answers, rule, mean = rows["arithmetic@1"]
    assert (passes, answers) == (n_exact, n_arith) and rate == pytest.approx(n_exact / n_arith) == 0.1
    assert rule == "exact-answer metric = 1" and mean > 0.5  # every reward is above zero: the old rate read 1.0
    # proposer_solver: the solvers' exact_match rewards, not the proposer's Monte Carlo reward
    solver = [e for k, e in flat(run) if k == "scores" and e.environment == "proposer_solver@1" and "solver" in e.rewards]
    assert rows["proposer_solver@1"][1:4] == (sum(e.rewards["solver"] == 1 for e in solver), len(solver),
                                               "exact_match reward = 1")
    # a zero-sum judge gives no pass/fail: no rate, and the chart says so instead of drawing one
    assert rows["debate@1"][0] is None and rows["debate@1"][2] == 0
    page = build_report(con)
    assert "no pass/fail verdict from the verifier of debate@1 (zero_sum_judge)" in page
    assert "a failed episode is no pass" in page


def test_a_failed_episode_is_no_pass():
    run = generate_run("fail-run-0001", rounds=2, groups=1, group_size=4, environments=("arithmetic",))
    items = []
    for key, e in flat(run):
        if key == "scores":  # every answer right, but the first episode failed (the verifier's "failed" verdict)
            failed = not any(k == "scores" for k, _ in items)
            e = e.model_copy(update={"rewards": {"solver": 0.0 if failed else 1.0},
                                     "verifier": "failed" if failed else "exact_match",
                                     "status": "failed" if failed else e.status})
        items.append((key, e))
    con = load(items, run.run_id)
    assert con.execute("SELECT passes, answers, failed_rate FROM v_env_pass_rates").fetchall() == [(7, 8, 1 / 8)]


def test_report_html_in_chromium_draws_every_chart_zooms_and_shows_tooltips(big_db, tmp_path):
    """The 10,000-batch report in Debian's headless Chromium (installed by .ci/setup), offline (file://): every
    chart is drawn, hovering a point shows its values, the mouse wheel zooms the batch axis. Screenshot kept at
    tests/artifacts/report-chromium.png."""
    import time
    from pathlib import Path

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.actions.wheel_input import ScrollOrigin
    from selenium.webdriver.common.by import By

    page = tmp_path / "report.html"
    write_report(big_db, str(page), with_audit=False)
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1400,2200"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
    try:
        driver.get(page.as_uri())
        deadline = time.monotonic() + 60
        while len(driver.execute_script("return Object.keys(window.views || {})")) < 8:
            assert time.monotonic() < deadline, "the charts were not drawn within 60 s"
            time.sleep(0.2)
        for name in ("reward_by_revision", "trainer_batches", "staleness_per_batch", "pass_rates", "eval_accuracy"):
            assert driver.find_elements(By.CSS_SELECTOR, f"#{name} svg.marks g.mark-group"), name
        chart = driver.find_element(By.CSS_SELECTOR, "#trainer_batches svg.marks")
        driver.execute_script("arguments[0].scrollIntoView()", chart)
        points = driver.find_elements(By.CSS_SELECTOR, "#trainer_batches g.mark-symbol.role-mark path")
        assert 2 <= len(points) <= 2 * MAX_POINTS  # two series, binned
        ActionChains(driver).move_to_element(points[len(points) // 4]).perform()
        time.sleep(0.3)
        tip = driver.execute_script("const t = document.getElementById('vg-tooltip-element');"
                                    "return t && t.classList.contains('visible') ? t.innerText : ''")
        assert "batch (in log order)" in tip and "min" in tip and "max" in tip, tip
        before = driver.execute_script("return views.trainer_batches.scale('x').domain()")
        ActionChains(driver).scroll_from_origin(ScrollOrigin.from_element(chart, 0, 0), 0, -400).perform()
        time.sleep(0.5)
        after = driver.execute_script("return views.trainer_batches.scale('x').domain()")
        assert before[0] <= 0 and before[1] >= BATCHES - 1 and after[1] - after[0] < 0.8 * (before[1] - before[0])
        artifacts = Path(__file__).resolve().parent / "artifacts"
        artifacts.mkdir(exist_ok=True)
        driver.execute_script("window.scrollTo(0, 0)")
        driver.save_screenshot(str(artifacts / "report-chromium.png"))
    finally:
        driver.quit()


def test_an_empty_run_says_what_is_not_drawn(tmp_path):
    from replay.report import grid
    from replay.tables import ensure_schema

    db = str(tmp_path / "empty.duckdb")
    con = duckdb.connect(db)
    ensure_schema(con)
    figs = figures(con)
    assert all(f.chart is None and f.note for f in figs)
    assert "not drawn: no trainer batches in this run" in grid(figs, "Run").to_dict()["title"]["subtitle"]
    assert "no evaluation rollouts in this run" in build_report(con)
    con.close()
    write_report(db, str(tmp_path / "r.png"), with_audit=False)
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_of_an_org_slash_name_family_reports_under_its_own_name(tmp_path):
    """A family named as Hugging Face names models (``org/name``): the tables, views, audit and report take it as
    a value (nothing is named after it), so the page and the PNG show it whole, with a clean audit."""
    from replay.audit import audit

    fam = "HuggingFaceTB/SmolLM2-135M-Instruct"
    run = generate_run("hf-run-00001", rounds=3, groups=2, group_size=2, prompt_tokens=4, completion_tokens=4,
                       eval_questions=2, environments=("arithmetic",), family=fam)
    assert {r.family for r in run.events("policy-revisions")} == {fam}
    db = str(tmp_path / "run.duckdb")
    con = duckdb.connect(db)
    load_events(con, run.run_id, placed(flat(run)))
    assert con.execute("SELECT DISTINCT family FROM policy_revisions").fetchall() == [(fam,)]
    assert con.execute("SELECT DISTINCT policy_family FROM v_eval_accuracy_by_revision").fetchall() == [(fam,)]
    assert con.execute("SELECT family, count(*) FROM v_logprob_mismatch GROUP BY ALL").fetchall() == [(fam, 3)]
    rep = audit(con)
    assert rep.ok, rep.findings
    assert rep.checked["batch_digests"] == 3
    series = {f.name: {v["series"] for v in f.chart.to_dict()["data"]["values"]}
              for f in figures(con) if f.name in ("reward_by_revision", "eval_accuracy", "logprob_mismatch")}
    assert series == {"reward_by_revision": {f"solver ({fam})"},
                      "eval_accuracy": {f"accuracy ({fam})", f"mean reward ({fam})"},
                      "logprob_mismatch": {f"mean |Δ| ({fam})", f"max |Δ| ({fam})"}}
    con.close()
    html = tmp_path / "report.html"
    write_report(db, str(html))
    page = html.read_text(encoding="utf-8")
    assert "audit OK" in page and f"mean |Δ| ({fam})" in page
    assert re.search(rf"<td>{re.escape(fam)}</td>", page)  # the revision chain table names the family whole
    write_report(db, str(tmp_path / "report.png"), with_audit=False)
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
