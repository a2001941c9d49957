"""`rollout dashboard`: a live web page of a run, following the log as it happens.

    rollout dashboard                        # http://127.0.0.1:8050, topics under ROLLOUT_TOPIC_PREFIX (rollout.)
    rollout dashboard --prefix demo-1a2b3c4d. --port 8050 --run RUN_ID

A FastAPI app served by uvicorn. One background task reads the policy-revisions, rollouts, scores,
trainer-batches and dead-letters topics from the beginning, ``read_committed`` and without a consumer group
(so it never disturbs the services, and sees only committed records), into ``replay.live.LiveRun``; another
reads the services' consumer lag from the broker every few seconds (``consumers.status``). The page polls
``/api/state`` and swaps the values into Vega-Lite charts drawn once (``/api/charts``: specs built with Altair,
rendered by vega-embed served from vl-convert's bundle: no CDN, it works offline).
``/api/lineage/FAMILY/REVISION``: revision -> batch -> records -> rollouts (FAMILY percent-encoded; it may hold
``/``, as in ``org/name``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
from typing import Any

log = logging.getLogger("rollout.dashboard")

FOLLOWED = ("POLICY_REVISIONS", "ROLLOUTS", "SCORES", "TRAINER_BATCHES", "DEAD_LETTERS")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dashboard", help="a live web page of a run (reward, eval accuracy, staleness, lag, "
                                         "dead letters, latest rollouts, lineage), following the log",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8050)
    p.add_argument("--prefix", help="topic prefix of the run (default: ROLLOUT_TOPIC_PREFIX; `rollout runs` lists "
                                    "them, e.g. demo-1a2b3c4d.)")
    p.add_argument("--run", dest="run_id", help="show only this run id (default: every run on the topics)")
    p.add_argument("--lag-every", type=float, default=5.0, help="seconds between consumer-lag reads (default 5)")
    p.set_defaults(func=cmd_dashboard)


def cmd_dashboard(args: argparse.Namespace) -> int:
    import uvicorn

    from streams import settings
    from streams.config import KafkaSettings

    kafka = KafkaSettings.from_env()
    prefix = args.prefix if args.prefix is not None else settings.current().topic_prefix
    app = create_app(kafka.client_kwargs(), prefix=prefix, run_id=args.run_id, lag_every_s=args.lag_every)
    print(f"dashboard: http://{args.host}:{args.port}/ (topics {prefix}*)", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def create_app(client_kwargs: dict[str, Any], *, prefix: str, run_id: str | None = None,
               lag_every_s: float = 5.0) -> Any:
    from fastapi import FastAPI, HTTPException
    from fastapi.responses import HTMLResponse, Response

    from replay.live import LiveRun
    from streams import settings

    state = LiveRun(run_id=run_id)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        with settings.overridden(topic_prefix=prefix):
            tasks = [asyncio.create_task(follow(client_kwargs, state)),
                     asyncio.create_task(follow_lag(client_kwargs, state, lag_every_s))]
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    app = FastAPI(title="rollout-log dashboard", lifespan=lifespan)

    @app.get("/", response_class=HTMLResponse)
    def page() -> str:
        return PAGE.replace("__PREFIX__", prefix)

    @app.get("/static/vega-bundle.js")
    def vega_bundle() -> Response:
        return Response(_vega_bundle(), media_type="application/javascript",
                        headers={"Cache-Control": "max-age=86400"})

    @app.get("/api/state")
    def api_state() -> dict[str, Any]:
        snap = state.snapshot()
        snap["chart_data"] = chart_data(snap)
        snap["prefix"] = prefix
        return snap

    @app.get("/api/charts")
    def api_charts() -> dict[str, Any]:
        return chart_specs()

    # ``:path``: a family named as Hugging Face names models (``org/name``) holds a slash; the page sends it
    # percent-encoded, the server decodes it before routing, and the revision is the last segment
    @app.get("/api/lineage/{family:path}/{revision}")
    def api_lineage(family: str, revision: int) -> dict[str, Any]:
        got = state.lineage(family, revision)
        if got is None:
            raise HTTPException(404, f"no revision {family}@r{revision} on the log (yet)")
        return got

    app.state.live = state
    return app


async def follow(client_kwargs: dict[str, Any], state: Any) -> None:
    """Fold every committed record of the followed topics into ``state``, from the beginning, forever. Topics
    that do not exist yet are picked up when they appear (partitions assigned by hand: no group)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from schemas.errors import EventDecodeError
    from streams import serde, topics

    names = [getattr(topics, t).name for t in FOLLOWED]
    while True:
        consumer = AIOKafkaConsumer(**client_kwargs, group_id=None, isolation_level="read_committed",
                                    enable_auto_commit=False, auto_offset_reset="earliest",
                                    max_partition_fetch_bytes=16 * 1024 * 1024)
        try:
            await consumer.start()
            assigned: set[TopicPartition] = set()
            while True:
                if {tp.topic for tp in assigned} != set(names):
                    assigned = await _assign(consumer, names, assigned)
                if not assigned:
                    await asyncio.sleep(1.0)
                    continue
                for recs in (await consumer.getmany(timeout_ms=500, max_records=500)).values():
                    for r in recs:
                        try:
                            state.apply(serde.from_message(r.value))
                        except EventDecodeError:
                            state.events["undecodable"] += 1
                    await asyncio.sleep(0)  # let the web requests in between large reads
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the broker went away: read again from the start, into a fresh fold
            log.warning("following the log: %s: %s; starting again", type(e).__name__, e)
            state.__init__(run_id=state.run_id, recent=state.recent, keep_rollouts=state.keep_rollouts)
            await asyncio.sleep(2.0)
        finally:
            await consumer.stop()


async def _assign(consumer: Any, names: list[str], assigned: set) -> set:
    """Assign the partitions of the followed topics that exist now (a run that has just started creates them):
    those already read keep their positions, new ones start at the beginning."""
    from aiokafka import TopicPartition

    cluster = await consumer._client.fetch_all_metadata()  # every topic's partitions (aiokafka has no public call)
    parts = {TopicPartition(t, p) for t in names for p in cluster.partitions_for_topic(t) or ()}
    if parts == assigned:
        return assigned
    positions = {tp: await consumer.position(tp) for tp in assigned}
    consumer.assign(sorted(parts))
    for tp, offset in positions.items():
        consumer.seek(tp, offset)
    if parts - assigned:
        await consumer.seek_to_beginning(*(parts - assigned))
    return parts


async def follow_lag(client_kwargs: dict[str, Any], state: Any, every_s: float) -> None:
    """Each service's consumer lag, read from the broker (committed group offsets; no group is joined)."""
    from consumers.status import service_lag

    while True:
        try:
            state.lag = await service_lag(client_kwargs, sample_s=min(1.0, every_s / 2))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - shown as missing, tried again
            log.warning("reading consumer lag: %s", e)
        await asyncio.sleep(every_s)


def chart_data(snap: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The values of each chart's named data set (the page swaps them into the drawn charts)."""
    by_rev = [{"revision": r["revision"], "measure": m, "value": r[k]} for r in snap["revisions"]
              for m, k in (("mean reward (training rollouts)", "reward_mean"),
                           ("eval accuracy (held-out)", "eval_accuracy")) if r[k] is not None]
    return {"by_revision": by_rev, "staleness": snap["staleness"], "dead_letters": snap["dead_letters"]}


@functools.lru_cache(maxsize=1)
def chart_specs() -> dict[str, Any]:
    """Vega-Lite specs (Altair) over named data sets, built once: reward and eval accuracy by revision, staleness,
    dead letters and refusals by reason."""
    import altair as alt

    base = dict(width=560, height=220)
    by_rev = alt.Chart(alt.NamedData(name="by_revision")).mark_line(point=True).encode(
        x=alt.X("revision:Q", title="policy revision", axis=alt.Axis(tickMinStep=1, format="d")),
        y=alt.Y("value:Q", title=None), color=alt.Color("measure:N", legend=alt.Legend(orient="bottom", title=None)),
        tooltip=["revision:Q", "measure:N", alt.Tooltip("value:Q", format=".3f")]).properties(
        title="reward and eval accuracy by revision", **base).interactive()
    stale = alt.Chart(alt.NamedData(name="staleness")).mark_bar().encode(
        x=alt.X("staleness:O", title="target revision - generating revision", axis=alt.Axis(labelAngle=0)),
        y=alt.Y("records:Q", title="records batched"), tooltip=["staleness:O", "records:Q"]).properties(
        title="staleness of batched records", **base)
    dl = alt.Chart(alt.NamedData(name="dead_letters")).mark_bar().encode(
        y=alt.Y("reason:N", title=None), x=alt.X("count:Q", title="dead letters"),
        color=alt.Color("service:N", legend=alt.Legend(orient="bottom")),
        tooltip=["service:N", "reason:N", "count:Q", "refusal:N"]).properties(
        title="dead letters and refusals by reason", width=520, height=160)
    return {"by_revision": by_rev.to_dict(), "staleness": stale.to_dict(), "dead_letters": dl.to_dict()}


@functools.lru_cache(maxsize=1)
def _vega_bundle() -> str:
    import vl_convert

    return vl_convert.javascript_bundle()


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>rollout-log dashboard</title>
<script src="/static/vega-bundle.js"></script>
<style>
 body { font: 14px system-ui, sans-serif; margin: 16px; color: #222; }
 h1 { font-size: 18px; margin: 0 0 4px; } h2 { font-size: 15px; margin: 18px 0 6px; }
 .muted { color: #777; } .grid { display: grid; grid-template-columns: 1fr 1fr; gap: 16px; }
 .chart { width: 100%; } table { border-collapse: collapse; width: 100%; font-size: 13px; }
 td, th { border-bottom: 1px solid #ddd; padding: 3px 6px; text-align: left; vertical-align: top; }
 td.num { text-align: right; font-variant-numeric: tabular-nums; } tr.rev { cursor: pointer; }
 tr.rev:hover { background: #eef; } .text { font-family: monospace; white-space: pre-wrap; max-width: 520px; }
 .bad { color: #b00; }
</style></head><body>
<h1>rollout-log: <span id="prefix">__PREFIX__</span>*</h1>
<div class="muted">run <span id="run">-</span> &middot; latest revision <b id="latest-revision">-</b> &middot;
 <span id="events">no events yet</span> &middot; updated <span id="updated">never</span></div>
<div class="grid">
 <div><div id="chart-by-revision" class="chart"></div></div>
 <div><div id="chart-staleness" class="chart"></div></div>
</div>
<div class="grid">
 <div><h2>consumer lag per service</h2><table id="lag"><thead><tr><th>service</th><th>lag</th><th>committed</th>
  <th>end</th><th>records/s</th></tr></thead><tbody></tbody></table></div>
 <div><div id="chart-dead-letters" class="chart"></div>
  <table id="dead-letters"><thead><tr><th>service</th><th>reason</th><th>kind</th><th>count</th></tr></thead>
  <tbody></tbody></table></div>
</div>
<h2>revisions <span class="muted">(the latest 50; click one for its lineage, or ask for any)</span></h2>
<form id="lineage-form">family <input id="lineage-family" size="14"> revision <input id="lineage-revision"
 type="number" min="0" style="width: 6em"> <button>lineage</button></form>
<table id="revisions"><thead><tr><th>revision</th><th>parent</th><th>batch</th><th>mean reward</th><th>rollouts</th>
 <th>eval accuracy</th><th>loss</th><th>step s</th><th>logprob mismatch mean / max</th></tr></thead><tbody></tbody></table>
<div id="lineage"></div>
<h2>latest rollouts</h2>
<table id="rollouts"><thead><tr><th>rollout</th><th>environment</th><th>revision</th><th>status</th><th>answer</th>
 <th>reward</th><th>text</th></tr></thead><tbody></tbody></table>
<script>
const fmt = (x, d = 3) => x === null || x === undefined ? "" : (typeof x === "number" ? x.toFixed(d) : String(x));
const esc = s => String(s ?? "").replace(/[&<>"]/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]));
function rows(id, items, cells, attrs) {
  document.querySelector(`#${id} tbody`).innerHTML = items.map(it =>
    `<tr ${attrs ? attrs(it) : ""}>` + cells(it).map(c => `<td${typeof c === "number" ? ' class="num"' : ""}>${
      typeof c === "number" ? c : c}</td>`).join("") + "</tr>").join("");
}
const views = {}, shown = {};
let specs = null;
async function update(name, values) {
  // drawn once with its first values (bound zoom/pan scales need data to start from), then values swapped in
  const key = JSON.stringify(values);
  if (shown[name] === key) return;
  shown[name] = key;
  if (!views[name]) {
    const spec = {...specs[name], data: {name, values}};
    views[name] = (await vegaEmbed(`#chart-${name.replace("_", "-")}`, spec, {actions: false, renderer: "svg"})).view;
  } else {
    await views[name].data(name, values).runAsync();
  }
}
async function lineage(family, revision) {
  const r = await fetch(`/api/lineage/${encodeURIComponent(family)}/${revision}`);
  const el = document.getElementById("lineage");
  if (!r.ok) { el.innerHTML = `<p class="bad">${esc((await r.json()).detail)}</p>`; return; }
  const l = await r.json(), b = l.batch;
  el.innerHTML = `<h2>lineage of ${esc(family)}@r${revision}</h2><p>chain: ${l.chain.map(x => "r" + x).join(" &larr; ")}
    </p>` + (b ? `<p>batch <code>${esc(b.batch_id)}</code> (target r${b.target}, ${b.records.length} records,
    ${b.completion_tokens} tokens, mean reward ${fmt(b.reward_mean)}, digest <code>${esc(b.digest.slice(0, 16))}</code>)
    </p><table id="lineage-records"><thead><tr><th>record</th><th>rollout</th><th>from revision</th><th>reward</th>
    <th>advantage</th><th>text</th></tr></thead><tbody>` + b.records.map(x => {
      const ro = l.rollouts.find(o => o.rollout_id === x.rollout_id);
      return `<tr><td>${esc(x.record_id.slice(0, 12))}</td><td>${esc(x.rollout_id.slice(0, 12))}</td>
        <td class="num">${x.source_revision}</td><td class="num">${fmt(x.reward)}</td>
        <td class="num">${fmt(x.advantage)}</td><td class="text">${esc(ro ? ro.text : "")}</td></tr>`;
    }).join("") + "</tbody></table>" : "<p>revision 0: no batch made it</p>");
}
async function refresh() {
  const s = await (await fetch("/api/state")).json();
  document.getElementById("run").textContent = s.runs[0] ?? "-";
  document.getElementById("latest-revision").textContent = s.latest_revision ?? "-";
  document.getElementById("events").textContent = Object.entries(s.events).map(([k, v]) => `${v} ${k}`).join(", ")
    || "no events yet";
  document.getElementById("updated").textContent = s.updated ? new Date(s.updated * 1000).toLocaleTimeString() : "never";
  document.body.dataset.latestRevision = s.latest_revision ?? "";
  const fam = document.getElementById("lineage-family");
  if (!fam.value && s.revisions.length) fam.value = s.revisions[s.revisions.length - 1].family;
  for (const [name, values] of Object.entries(s.chart_data)) if (values.length) await update(name, values);
  rows("lag", s.lag, r => [esc(r.service), r.lag, r.committed, r.end, r.throughput_per_s]);
  rows("dead-letters", s.dead_letters, d => [esc(d.service), esc(d.reason), d.refusal ? "refusal" : "failure", d.count]);
  rows("revisions", s.revisions.slice(-50).reverse(), r => [`r${r.revision}`, r.parent ?? "", esc((r.batch_id ?? "").slice(-12)),
    fmt(r.reward_mean), r.rollouts, fmt(r.eval_accuracy), fmt(r.loss), fmt(r.step_s, 2),
    r.mismatch_mean === null ? "" : `${fmt(r.mismatch_mean, 4)} / ${fmt(r.mismatch_max, 4)}`],
    r => `class="rev" data-family="${esc(r.family)}" data-revision="${r.revision}"`);
  rows("rollouts", s.rollouts, o => [esc(o.rollout_id.slice(0, 12)), esc(o.environment), o.revision ?? "",
    esc(o.status) + (o.evaluation ? " (eval)" : ""), esc(o.answer ?? ""), fmt(o.reward), `<span class="text">${esc(o.text)}</span>`]);
}
document.querySelector("#revisions tbody").addEventListener("click", e => {
  const tr = e.target.closest("tr.rev");
  if (tr) lineage(tr.dataset.family, Number(tr.dataset.revision));
});
document.getElementById("lineage-form").addEventListener("submit", e => {
  e.preventDefault();
  lineage(document.getElementById("lineage-family").value, Number(document.getElementById("lineage-revision").value));
});
async function loop() {
  try { await refresh(); document.body.dataset.error = ""; }
  catch (e) { document.body.dataset.error = String(e); console.error(e); }
  setTimeout(loop, 1500);
}
fetch("/api/charts").then(r => r.json()).then(s => { specs = s; loop(); });
</script></body></html>
"""
