"""`rollout report`: a replayed run as Vega-Lite charts (altair), in one offline HTML page or one PNG.

The same chart specs make both. The HTML page embeds them with Vega-Embed, whose JavaScript vl-convert
inlines (the page needs no network): scroll to zoom, drag to pan, hover for values. The PNG is
vl-convert's rendering of the same charts in a grid (no browser). Axis ticks are Vega's own, with its
overlap removal; a series with more x values than ``MAX_POINTS`` is binned in SQL (the mean per bin, with
a min-max band), so 10,000 batches stay readable.

Charts: reward by policy revision and role (training rollouts), reward by learner revision at admission,
the trainer's batch reward and advantage, staleness (overall and per batch), pass rate per environment
(what the verifier calls a pass: see ``v_env_pass_rates``), held-out evaluation accuracy and the
trainer-inference logprob mismatch by revision; tables of counts, the revision chain and the audit verdict.
"""

from __future__ import annotations

import html
import json
import math
import textwrap
from dataclasses import dataclass
from datetime import UTC, datetime

import altair as alt
import duckdb

MAX_POINTS = 200  # x values per series before binning
WIDTH, HEIGHT = 500, 240
_LABELS = {"labelOverlap": True, "labelFlush": True}  # let Vega drop labels that would collide


@dataclass
class Figure:
    """One chart of the report; ``chart`` is None when the run has nothing to draw (``note`` says why)."""

    name: str
    chart: alt.TopLevelMixin | None
    note: str = ""


def _esc(x: object) -> str:
    return html.escape(str(x), quote=True)


def _one(con: duckdb.DuckDBPyConnection, sql: str) -> tuple:
    """The first row (DuckDB keeps a result open until it is fetched to the end, so fetch it all)."""
    rows = con.execute(sql).fetchall()
    return rows[0] if rows else (None,)


def _title(text: str, subtitle: str | list[str] = "") -> alt.TitleParams:
    """Left-aligned; a list subtitle is one line per item."""
    return alt.TitleParams(text, subtitle=subtitle or alt.Undefined, anchor="start")


def binned_series(con: duckdb.DuckDBPyConnection, sql: str, max_points: int = MAX_POINTS) -> tuple[list[dict], int]:
    """Rows ``(series, x, y[, label])`` of ``sql`` (integer x) as at most ``max_points`` bins of x per series:
    ``x`` (bin start), ``x_last``, ``y`` (mean), ``lo``/``hi`` (min/max), ``n``; returns them and the bin width."""
    lo, hi = _one(con, f"SELECT min(x), max(x) FROM ({sql}) WHERE y IS NOT NULL AND isfinite(y)")
    if lo is None:
        return [], 1
    width = max(1, math.ceil((hi - lo + 1) / max_points))
    cur = con.execute(f"""
        SELECT series, {lo} + (x - {lo}) // {width} * {width} AS x, max(x) AS x_last, avg(y) AS y, min(y) AS lo,
               max(y) AS hi, count(*) AS n
        FROM ({sql}) WHERE y IS NOT NULL AND isfinite(y) GROUP BY ALL ORDER BY ALL""")
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()], width


def series_chart(rows: list[dict], width: int, *, name: str, title: str, x: str, y: str, unit: str,
                 subtitle: str = "") -> alt.LayerChart:
    """Lines per series over integer x (``unit``: what one x is, plural), a min-max band when binned, hover
    points; zoom and pan on x."""
    per = f"per bin of {width:,} {unit}" if width > 1 else ""
    base = alt.Chart(alt.Data(values=rows)).encode(
        x=alt.X("x:Q", title=x, axis=alt.Axis(format="~d", tickMinStep=1, **_LABELS)),
        color=alt.Color("series:N", title=None, legend=alt.Legend(orient="bottom", columns=3, labelLimit=260)))
    tip = [alt.Tooltip("series:N"), alt.Tooltip("x:Q", title=x, format="~d"),
           alt.Tooltip("y:Q", title=f"{y} (mean)" if width > 1 else y, format=".4~g")]
    if width > 1:
        tip += [alt.Tooltip("x_last:Q", title="to", format="~d"), alt.Tooltip("lo:Q", title="min", format=".4~g"),
                alt.Tooltip("hi:Q", title="max", format=".4~g"), alt.Tooltip("n:Q", title="values")]
    layers = []
    if width > 1:
        layers.append(base.mark_area(opacity=0.18).encode(y="lo:Q", y2="hi:Q"))
    layers.append(base.mark_line(strokeWidth=1.6).encode(y=alt.Y("y:Q", title=y, axis=alt.Axis(**_LABELS))))
    layers.append(base.mark_circle(size=22 if len(rows) <= 2 * MAX_POINTS else 8).encode(y="y:Q", tooltip=tip))
    sub = [s for s in (subtitle, f"mean {per}, band = min..max" if per else "") if s]
    return alt.layer(*layers).properties(title=_title(title, sub), width=WIDTH, height=HEIGHT).interactive(
        name=f"zoom_{name}", bind_y=False)


def _series_figure(con, name: str, sql: str, title: str, x: str, y: str, absent: str, *, unit: str = "revisions",
                   subtitle: str = "") -> Figure:
    rows, width = binned_series(con, sql)
    if not rows:
        return Figure(name, None, absent)
    return Figure(name, series_chart(rows, width, name=name, title=title, x=x, y=y, unit=unit, subtitle=subtitle))


# trainer batches numbered in log order (one partition: one batcher)
BATCHES = ("SELECT row_number() OVER (ORDER BY _partition, _offset) - 1 AS batch, batch_id, _offset AS batch_offset, "
           "target_revision, reward_mean, advantage_mean FROM trainer_batches")


def _staleness_per_batch(con) -> Figure:
    """Share of each batch's records by staleness, binned over batches in log order (stacked to 100%)."""
    (n,) = _one(con, "SELECT count(*) FROM trainer_batches")
    if not n:
        return Figure("staleness_per_batch", None, "no trainer batches in this run")
    width = max(1, math.ceil(n / MAX_POINTS))
    cur = con.execute(f"""
        WITH b AS ({BATCHES})
        SELECT b.batch // {width} * {width} AS x, b.batch // {width} * {width} + {width} AS x2, s.staleness,
               sum(s.records) AS records, min(b.target_revision) AS rev_lo, max(b.target_revision) AS rev_hi
        FROM v_staleness_distribution s JOIN b ON b.batch_offset = s.batch_offset AND b.batch_id = s.batch_id
        GROUP BY ALL ORDER BY ALL""")
    cols = [d[0] for d in cur.description]
    rows = [dict(zip(cols, r)) for r in cur.fetchall()]
    per = f" (bins of {width:,} batches)" if width > 1 else ""
    chart = alt.Chart(alt.Data(values=rows)).mark_bar().encode(
        x=alt.X("x:Q", bin="binned", title=f"batch (in log order){per}",
                axis=alt.Axis(format="~d", tickMinStep=1, **_LABELS)),
        x2="x2:Q",
        y=alt.Y("records:Q", stack="normalize", title="share of records", axis=alt.Axis(format="%", **_LABELS)),
        color=alt.Color("staleness:O", title="staleness", scale=alt.Scale(scheme="viridis")),
        tooltip=[alt.Tooltip("x:Q", title="from batch", format="~d"), alt.Tooltip("staleness:O"),
                 alt.Tooltip("records:Q"), alt.Tooltip("rev_lo:Q", title="target revision from"),
                 alt.Tooltip("rev_hi:Q", title="to")],
    ).properties(title=_title("Staleness per batch", "target revision − revision that generated each record"),
                 width=WIDTH, height=HEIGHT).interactive(name="zoom_staleness_per_batch", bind_y=False)
    return Figure("staleness_per_batch", chart)


def _staleness(con) -> Figure:
    rows = [{"staleness": s, "records": n} for s, n in con.execute(
        "SELECT staleness, count(*) FROM v_batch_staleness GROUP BY 1 ORDER BY 1").fetchall()]
    if not rows:
        return Figure("staleness", None, "no batched records in this run")
    chart = alt.Chart(alt.Data(values=rows)).mark_bar().encode(
        x=alt.X("staleness:O", title="staleness (revisions behind the batch's target)",
                axis=alt.Axis(labelAngle=0, **_LABELS)),
        y=alt.Y("records:Q", axis=alt.Axis(**_LABELS)),
        tooltip=["staleness:O", "records:Q"],
    ).properties(title=_title("Staleness of batched records"), width=WIDTH, height=HEIGHT)
    return Figure("staleness", chart)


def _pass_rates(con) -> Figure:
    envs = con.execute("SELECT environment, pass_rate, passes, answers, rollouts, pass_rule, verifiers, mean_reward "
                       "FROM v_env_pass_rates").fetchall()
    cols = ["environment", "pass_rate", "passes", "answers", "rollouts", "pass_rule", "verifiers", "mean_reward"]
    rows = [dict(zip(cols, e)) for e in envs if e[1] is not None]
    none = [f"{e[0]} ({e[6]})" for e in envs if e[1] is None]
    sub = ["a pass is what the verifier calls one: its exact-answer metric, or an exact_match reward, is 1",
           "a failed episode is no pass; bar labels: passes / answers (rollout × trainable member)"]
    if none:
        sub.append("no pass/fail verdict from the verifier of " + ", ".join(none) + ": mean reward in the table")
    if not rows:
        return Figure("pass_rates", None, sub[-1] if none else "no training scores in this run")
    base = alt.Chart(alt.Data(values=rows)).encode(
        x=alt.X("environment:N", title=None, axis=alt.Axis(labelAngle=0, labelLimit=180, **_LABELS)))
    bars = base.mark_bar().encode(
        y=alt.Y("pass_rate:Q", title="pass rate", scale=alt.Scale(domain=[0, 1]), axis=alt.Axis(format="%")),
        tooltip=[alt.Tooltip("environment:N"), alt.Tooltip("pass_rate:Q", format=".1%"), "passes:Q", "answers:Q",
                 "rollouts:Q", alt.Tooltip("pass_rule:N", title="counted as a pass"), "verifiers:N",
                 alt.Tooltip("mean_reward:Q", format=".4~g")])
    labels = base.mark_text(dy=-7).encode(y="pass_rate:Q", text=alt.Text("label:N")).transform_calculate(
        label="datum.passes + ' / ' + datum.answers")
    chart = (bars + labels).properties(title=_title("Pass rate per environment (training answers)", sub),
                                       width=WIDTH, height=HEIGHT)
    return Figure("pass_rates", chart)


def figures(con: duckdb.DuckDBPyConnection) -> list[Figure]:
    """The report's charts, in page order."""
    return [
        _series_figure(
            con, "reward_by_revision",
            "SELECT role || ' (' || policy_family || ')' || CASE WHEN trainable THEN '' ELSE ' fixed' END AS series, "
            "policy_revision AS x, mean_reward AS y FROM v_reward_by_revision WHERE policy_revision IS NOT NULL",
            "Mean reward by policy revision and role", "policy revision (of the step's tokens)", "mean reward",
            "no training rewards in this run"),
        _series_figure(
            con, "reward_by_admission_revision",
            "SELECT role || CASE WHEN trainable THEN '' ELSE ' (fixed)' END AS series, policy_revision AS x, "
            "mean_reward AS y FROM v_reward_by_admission_revision WHERE policy_revision IS NOT NULL",
            "Mean reward by learner revision at admission", "learner revision", "mean reward",
            "no admitted rollouts in this run"),
        _series_figure(
            con, "trainer_batches",
            f"SELECT 'reward' AS series, batch AS x, reward_mean AS y FROM ({BATCHES}) UNION ALL "
            f"SELECT 'advantage', batch, advantage_mean FROM ({BATCHES})",
            "Trainer batches: mean reward and advantage", "batch (in log order)", "mean",
            "no trainer batches in this run", unit="batches", subtitle="one batch = one optimizer step"),
        _staleness(con),
        _staleness_per_batch(con),
        _pass_rates(con),
        _series_figure(
            con, "eval_accuracy",
            "SELECT 'accuracy (' || policy_family || ')' AS series, policy_revision AS x, accuracy AS y "
            "FROM v_eval_accuracy_by_revision UNION ALL "
            "SELECT 'mean reward (' || policy_family || ')', policy_revision, mean_reward FROM v_eval_accuracy_by_revision",
            "Held-out evaluation by policy revision", "policy revision", "accuracy / mean reward",
            "no evaluation rollouts in this run", subtitle="accuracy: the verifier's exact-answer verdict, else reward ≥ 1"),
        _series_figure(
            con, "logprob_mismatch",
            "SELECT 'mean |Δ| (' || family || ')' AS series, revision AS x, mismatch_mean AS y FROM v_logprob_mismatch "
            "UNION ALL SELECT 'max |Δ| (' || family || ')', revision, mismatch_max FROM v_logprob_mismatch",
            "Trainer–inference logprob mismatch", "revision trained (on its parent's tokens)", "|Δ logprob|",
            "no logprob mismatch reported by the trainer in this run"),
    ]


def grid(figs: list[Figure], title: str, subtitle: str = "", columns: int = 2) -> alt.VConcatChart:
    """The drawable figures in rows of ``columns``: the PNG's single chart (the others' notes in its subtitle)."""
    charts = [f.chart for f in figs if f.chart is not None]
    lines = textwrap.wrap(subtitle, 180) + [f"not drawn: {f.note}" for f in figs if f.chart is None]
    rows = [alt.hconcat(*charts[i:i + columns], spacing=40).resolve_scale(color="independent")
            for i in range(0, len(charts), columns)]
    return alt.vconcat(*rows, spacing=36).resolve_scale(color="independent").properties(
        title=_title(title, lines)).configure_title(fontSize=15)


def _table(con: duckdb.DuckDBPyConnection, sql: str, limit: int = 50) -> str:
    from replay.query import cell, fetch

    columns, _, rows = fetch(con.sql(sql), limit)
    head = "".join(f"<th>{_esc(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{_esc(cell(v))}</td>" for v in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


CSS = """body{font-family:system-ui,sans-serif;margin:24px auto;max-width:1400px;color:#222}
h1{font-size:22px}h2{font-size:16px;margin-top:28px}.grid{display:flex;flex-wrap:wrap;gap:16px}
.card{border:1px solid #ddd;border-radius:6px;padding:8px;background:#fff}
table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}
th{background:#f4f4f4}.ok{color:#1a7f37;font-weight:600}.bad{color:#cf222e;font-weight:600}.dim{color:#777}"""


def _card(fig: Figure) -> str:
    if fig.chart is None:
        return f'<div class="card dim" id="{fig.name}">{_esc(fig.note)}</div>'
    return f'<div class="card"><div id="{fig.name}"></div></div>'


def build_report(con: duckdb.DuckDBPyConnection, *, audit_summary: str | None = None, audit_ok: bool | None = None,
                 figs: list[Figure] | None = None) -> str:
    """The HTML page: charts embedded with the Vega JavaScript inlined (works offline), then the tables."""
    import vl_convert

    (run_id,) = _one(con, "SELECT value FROM _replay_meta WHERE key='run_id'")
    figs = figures(con) if figs is None else figs
    specs = {f.name: f.chart.to_dict() for f in figs if f.chart is not None}
    embed = ("const specs = " + json.dumps(specs, ensure_ascii=False).replace("</", "<\\/") + ";\n"
             "window.views = {};  // chart name -> Vega view (the browser test reads them)\n"
             "for (const [id, spec] of Object.entries(specs)) "
             "vegaEmbed('#' + id, spec, {actions: {export: true, source: false, compiled: false, editor: false}})"
             ".then(r => { window.views[id] = r.view; });")
    verdict = ""
    if audit_summary is not None:
        verdict = f'<h2>Audit</h2><p class="{"ok" if audit_ok else "bad"}">{_esc(audit_summary)}</p>'
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>rollout-log run {_esc(run_id)}</title>
<style>{CSS}</style><script>{vl_convert.javascript_bundle()}</script></head><body>
<h1>Run {_esc(run_id)}</h1><p class="dim">replayed from the log; report generated {now}. Charts: scroll to zoom,
drag to pan, double-click to reset, hover for values.</p>
{verdict}
<h2>Charts</h2><div class="grid">{"".join(_card(f) for f in figs)}</div>
<script>{embed}</script>
<h2>Revision chain</h2><p>Each revision, the parent it was trained from, the batch (one optimizer step) it names,
and where that batch's tokens came from (the audit walks this chain from the latest revision back to r0).</p>
{_table(con, "SELECT family, revision, parent_revision, batch_id, batch_digest = logged_batch_digest AS digest_ok, "
             "batch_target_revision, records, rollouts, steps, generated_by FROM v_revision_chain "
             "ORDER BY family, revision DESC", 10_000)}
<h2>Counts</h2>{_table(con, "SELECT * FROM v_counts")}
<h2>Pass rates per environment</h2>{_table(con, "SELECT * FROM v_env_pass_rates")}
<h2>Held-out evaluation accuracy by revision</h2>{_table(con, "SELECT * FROM v_eval_accuracy_by_revision", 500)}
<h2>Trainer–inference logprob mismatch</h2>{_table(con, "SELECT * FROM v_logprob_mismatch", 500)}
<h2>Reward by revision and role (training rollouts)</h2>{_table(con, "SELECT * FROM v_reward_by_revision", 500)}
<h2>Staleness per batch</h2>{_table(con, "SELECT batch_id, target_revision, max_off_policy_steps, records, min_staleness, "
                                      "mean_staleness, max_staleness, out_of_bound FROM v_staleness_summary", 200)}
<h2>Token counts</h2>{_table(con, "SELECT * FROM v_token_counts", 100)}
</body></html>"""


def write_report(db: str, out: str, *, with_audit: bool = True) -> str:
    """``out`` ending in .png: the charts as one image; else the HTML page. Both from the same ``figures``."""
    import vl_convert

    from replay.tables import UnusableDatabase, open_read_only

    con = open_read_only(db)
    try:
        summary = ok = None
        if with_audit:
            from replay.audit import audit

            rep = audit(con)
            summary, ok = rep.summary(), rep.ok
        try:
            figs = figures(con)
            if out.endswith(".png"):
                (run_id,) = _one(con, "SELECT value FROM _replay_meta WHERE key='run_id'")
                data = vl_convert.vegalite_to_png(grid(figs, f"Run {run_id}", summary or "").to_dict())
                with open(out, "wb") as f:
                    f.write(data)
                return out
            page = build_report(con, audit_summary=summary, audit_ok=ok, figs=figs)
        except duckdb.BinderException as e:  # a view of an older version (same name, other columns)
            raise UnusableDatabase(f"{db} was replayed by an older version ({e}): run `rollout replay --db {db}` "
                                   "once more to upgrade it") from None
    finally:
        con.close()
    with open(out, "w", encoding="utf-8") as f:
        f.write(page)
    return out
