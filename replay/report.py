"""`rollout report`: one self-contained HTML page (inline SVG, no scripts, no downloads) of a replayed run.

Reward curves by policy revision and role (training rollouts), the trainer's batch reward over
batches, staleness histograms (overall and per batch), pass rates per environment, held-out
evaluation accuracy by revision, the trainer-inference logprob mismatch per training step, token
counts and the audit verdict.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import html
import math
import re
from collections.abc import Sequence
from datetime import UTC, datetime

import duckdb

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"]
W, H = 640, 300
M = {"l": 56, "r": 150, "t": 34, "b": 44}


def _esc(x: object) -> str:
    return html.escape(str(x), quote=True)


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Round tick values from at or below ``lo`` to at or above ``hi``."""
    if not math.isfinite(lo) or not math.isfinite(hi):
        return [0.0, 1.0]
    if hi == lo:
        lo, hi = (lo - 1, hi + 1) if lo != 0 else (0.0, 1.0)
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw), default=raw)
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [round(k * step, 10) for k in range(first, last + 1)]


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def _frame(title: str, xlabel: str, ylabel: str, xt: list[tuple[float, str]], yt: list[float],
           sx, sy) -> list[str]:
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
             f'font-family="system-ui, sans-serif" font-size="11">',
             f'<text x="{M["l"]}" y="18" font-size="14" font-weight="600">{_esc(title)}</text>']
    x0, x1, y0, y1 = M["l"], W - M["r"], H - M["b"], M["t"]
    for v in yt:
        y = sy(v)
        parts.append(f'<line x1="{x0}" x2="{x1}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e5e5e5"/>')
        parts.append(f'<text x="{x0 - 6}" y="{y + 4:.1f}" text-anchor="end" fill="#555">{_fmt(v)}</text>')
    for v, label in xt:
        x = sx(v)
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y0}" y2="{y0 + 4}" stroke="#555"/>')
        parts.append(f'<text x="{x:.1f}" y="{y0 + 16}" text-anchor="middle" fill="#555">{_esc(label)}</text>')
    parts.append(f'<line x1="{x0}" x2="{x1}" y1="{y0}" y2="{y0}" stroke="#555"/>')
    parts.append(f'<line x1="{x0}" x2="{x0}" y1="{y0}" y2="{y1}" stroke="#555"/>')
    parts.append(f'<text x="{(x0 + x1) / 2}" y="{H - 8}" text-anchor="middle" fill="#333">{_esc(xlabel)}</text>')
    parts.append(f'<text transform="translate(14 {(y0 + y1) / 2}) rotate(-90)" text-anchor="middle" '
                 f'fill="#333">{_esc(ylabel)}</text>')
    return parts


def _legend(names: Sequence[str]) -> list[str]:
    out = []
    for i, name in enumerate(names):
        y = M["t"] + 6 + i * 16
        out.append(f'<rect x="{W - M["r"] + 12}" y="{y - 8}" width="10" height="10" fill="{PALETTE[i % len(PALETTE)]}"/>')
        out.append(f'<text x="{W - M["r"] + 27}" y="{y + 1}">{_esc(name)}</text>')
    return out


def _empty(title: str, why: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="80" font-family="system-ui, sans-serif">'
            f'<text x="10" y="20" font-size="14" font-weight="600">{_esc(title)}</text>'
            f'<text x="10" y="50" fill="#777">{_esc(why)}</text></svg>')


def line_chart(title: str, series: dict[str, list[tuple[float, float]]], xlabel: str, ylabel: str,
               xlabels: dict[float, str] | None = None) -> str:
    pts = [p for s in series.values() for p in s if p[1] is not None and math.isfinite(p[1])]
    if not pts:
        return _empty(title, "no data")
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    xlo, xhi = min(xs), max(xs)
    if xlo == xhi:
        xlo, xhi = xlo - 1, xhi + 1
    yt = _ticks(min(ys + [0.0]), max(ys))
    ylo, yhi = min(yt), max(yt)
    sx = lambda v: M["l"] + 10 + (v - xlo) / (xhi - xlo) * (W - M["l"] - M["r"] - 20)  # noqa: E731
    sy = lambda v: H - M["b"] - (v - ylo) / ((yhi - ylo) or 1) * (H - M["t"] - M["b"])  # noqa: E731
    distinct = sorted(set(xs))
    step = max(1, len(distinct) // 12)
    xt = [(v, (xlabels or {}).get(v, _fmt(v))) for v in distinct[::step]]
    parts = _frame(title, xlabel, ylabel, xt, yt, sx, sy)
    for i, (name, s) in enumerate(series.items()):
        color = PALETTE[i % len(PALETTE)]
        s = sorted((x, y) for x, y in s if y is not None and math.isfinite(y))
        if len(s) > 1:
            d = " ".join(f"{'M' if j == 0 else 'L'}{sx(x):.1f},{sy(y):.1f}" for j, (x, y) in enumerate(s))
            parts.append(f'<path d="{d}" fill="none" stroke="{color}" stroke-width="2"/>')
        for x, y in s:
            parts.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{color}">'
                         f'<title>{_esc(name)}: {(xlabels or {}).get(x, _fmt(x))} → {_fmt(y)}</title></circle>')
    parts += _legend(list(series))
    parts.append("</svg>")
    return "\n".join(parts)


def bar_chart(title: str, labels: Sequence[str], stacks: dict[str, Sequence[float]], xlabel: str, ylabel: str) -> str:
    """Bars at each label; several stacks are drawn on top of each other (a stacked histogram)."""
    if not labels:
        return _empty(title, "no data")
    totals = [sum(s[i] for s in stacks.values()) for i in range(len(labels))]
    yt = _ticks(0.0, max(totals) or 1.0)
    yhi = max(yt) or 1.0
    n = len(labels)
    band = (W - M["l"] - M["r"]) / n
    sx = lambda i: M["l"] + band * (i + 0.5)  # noqa: E731
    sy = lambda v: H - M["b"] - v / yhi * (H - M["t"] - M["b"])  # noqa: E731
    step = max(1, n // 16)
    parts = _frame(title, xlabel, ylabel, [(i, labels[i]) for i in range(0, n, step)], yt, sx, sy)
    bw = max(1.0, band * 0.8)
    base = [0.0] * n
    for k, (name, values) in enumerate(stacks.items()):
        color = PALETTE[k % len(PALETTE)]
        for i, v in enumerate(values):
            if not v:
                continue
            top, bottom = sy(base[i] + v), sy(base[i])
            parts.append(f'<rect x="{sx(i) - bw / 2:.1f}" y="{top:.1f}" width="{bw:.1f}" height="{bottom - top:.1f}" '
                         f'fill="{color}"><title>{_esc(labels[i])} {_esc(name)}: {_fmt(v)}</title></rect>')
            base[i] += v
    if len(stacks) > 1:
        parts += _legend(list(stacks))
    parts.append("</svg>")
    return "\n".join(parts)


def _table(con: duckdb.DuckDBPyConnection, sql: str, limit: int = 50) -> str:
    from replay.query import cell, fetch

    columns, _, rows = fetch(con.sql(sql), limit)
    head = "".join(f"<th>{_esc(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{_esc(cell(v))}</td>" for v in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _revision_section(con: duckdb.DuckDBPyConnection, view: str, keys: tuple[str, str], columns: dict[str, str],
                      title: str, xlabel: str, ylabel: str, absent: str) -> str:
    """A per-revision view as a line chart (one series per column and family) and a table; ``absent`` when empty."""
    fam, rev = keys
    rows = con.execute(f"SELECT {fam}, {rev}, {', '.join(columns)} FROM {view} ORDER BY ALL").fetchall()
    if not rows:
        return f'<p class="dim">{_esc(absent)}</p>'
    series: dict[str, list[tuple[float, float]]] = {}
    for family, revision, *values in rows:
        for label, v in zip(columns.values(), values):
            series.setdefault(f"{label} ({family})", []).append((revision, v))
    return (f'<div class="card">{line_chart(title, series, xlabel, ylabel)}</div>'
            + _table(con, f"SELECT * FROM {view}", 500))


CSS = """body{font-family:system-ui,sans-serif;margin:24px auto;max-width:1320px;color:#222}
h1{font-size:22px}h2{font-size:16px;margin-top:28px}.grid{display:flex;flex-wrap:wrap;gap:16px}
.card{border:1px solid #ddd;border-radius:6px;padding:8px;background:#fff}
table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}
th{background:#f4f4f4}.ok{color:#1a7f37;font-weight:600}.bad{color:#cf222e;font-weight:600}.dim{color:#777}"""


def build_report(con: duckdb.DuckDBPyConnection, *, audit_summary: str | None = None, audit_ok: bool | None = None) -> str:
    run = con.execute("SELECT value FROM _replay_meta WHERE key='run_id'").fetchone()
    run_id = run[0] if run else "?"
    charts: list[str] = []

    # reward by revision and role (steps attributed to the revision that produced them)
    series: dict[str, list[tuple[float, float]]] = {}
    for fam, rev, role, trainable, mean in con.execute(
            "SELECT policy_family, policy_revision, role, trainable, mean_reward FROM v_reward_by_revision "
            "WHERE policy_revision IS NOT NULL ORDER BY ALL").fetchall():
        series.setdefault(f"{role} ({fam})" + ("" if trainable else " fixed"), []).append((rev, mean))
    charts.append(line_chart("Mean reward by policy revision and role", series, "policy revision (of the step's tokens)",
                             "mean reward"))
    series = {}
    for fam, rev, role, trainable, mean in con.execute(
            "SELECT policy_family, policy_revision, role, trainable, mean_reward FROM v_reward_by_admission_revision "
            "WHERE policy_revision IS NOT NULL ORDER BY ALL").fetchall():
        series.setdefault(f"{role}" + ("" if trainable else " (fixed)"), []).append((rev, mean))
    charts.append(line_chart("Mean reward by learner revision at admission", series, "learner revision", "mean reward"))

    # the trainer's view: reward per batch, in log order
    rows = con.execute("SELECT row_number() OVER (ORDER BY _partition, _offset) - 1, target_revision, reward_mean, "
                       "advantage_mean FROM trainer_batches ORDER BY _partition, _offset").fetchall()
    labels = {float(i): f"#{i} r{t}" for i, t, _, _ in rows}
    charts.append(line_chart("Trainer batches: mean reward and advantage", {
        "reward": [(float(i), m) for i, _, m, _ in rows], "advantage": [(float(i), a) for i, _, _, a in rows]},
        "batch (in log order, target revision)", "mean", xlabels=labels))

    # staleness: overall histogram and per batch
    hist = con.execute("SELECT staleness, count(*) FROM v_batch_staleness GROUP BY 1 ORDER BY 1").fetchall()
    charts.append(bar_chart("Staleness of batched records (target − source revision)", [str(s) for s, _ in hist],
                            {"records": [n for _, n in hist]}, "staleness (revisions behind)", "records"))
    per = con.execute("SELECT batch_offset, target_revision, staleness, records FROM v_staleness_distribution").fetchall()
    batches = sorted({(b, t) for b, t, _, _ in per})
    lags = sorted({s for _, _, s, _ in per})
    idx = {b: i for i, (b, _) in enumerate(batches)}
    stacks = {f"lag {lag}": [0.0] * len(batches) for lag in lags}
    for b, _, s, n in per:
        stacks[f"lag {s}"][idx[b]] = n
    charts.append(bar_chart("Staleness per batch", [f"r{t}" for _, t in batches], stacks,
                            "batch (target revision)", "records"))

    envs = con.execute("SELECT environment, pass_rate, rollouts FROM v_env_pass_rates").fetchall()
    charts.append(bar_chart("Pass rate per environment", [e for e, _, _ in envs], {"pass rate": [p or 0 for _, p, _ in envs]},
                            "environment", "pass rate"))

    evaluation = _revision_section(
        con, "v_eval_accuracy_by_revision", ("policy_family", "policy_revision"),
        {"accuracy": "accuracy", "mean_reward": "mean reward"}, "Held-out evaluation by policy revision",
        "policy revision", "accuracy / mean reward", "no evaluation rollouts in this run")
    mismatch = _revision_section(
        con, "v_logprob_mismatch", ("family", "revision"), {"mismatch_mean": "mean |Δ|", "mismatch_max": "max |Δ|"},
        "Trainer–inference logprob mismatch", "revision trained (on its parent’s tokens)", "|Δ logprob|",
        "no logprob mismatch reported by the trainer in this run")

    verdict = ""
    if audit_summary is not None:
        cls = "ok" if audit_ok else "bad"
        verdict = f'<h2>Audit</h2><p class="{cls}">{_esc(audit_summary)}</p>'
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>rollout-log run {_esc(run_id)}</title>
<style>{CSS}</style></head><body>
<h1>Run {_esc(run_id)}</h1><p class="dim">replayed from the log; report generated {now}</p>
{verdict}
<h2>Rewards and staleness</h2><div class="grid">{"".join(f'<div class="card">{c}</div>' for c in charts)}</div>
<h2>Held-out evaluation accuracy by revision</h2>{evaluation}
<h2>Trainer–inference logprob mismatch</h2>{mismatch}
<h2>Revision chain</h2><p>Each revision, the parent it was trained from, the batch (one optimizer step) it names,
and where that batch's tokens came from (the audit walks this chain from the latest revision back to r0).</p>
{_table(con, "SELECT family, revision, parent_revision, batch_id, batch_digest = logged_batch_digest AS digest_ok, "
             "batch_target_revision, records, rollouts, steps, generated_by FROM v_revision_chain "
             "ORDER BY family, revision DESC", 10_000)}
<h2>Counts</h2>{_table(con, "SELECT * FROM v_counts")}
<h2>Reward by revision and role (training rollouts)</h2>{_table(con, "SELECT * FROM v_reward_by_revision")}
<h2>Staleness per batch</h2>{_table(con, "SELECT batch_id, target_revision, max_off_policy_steps, records, min_staleness, "
                                      "mean_staleness, max_staleness, out_of_bound FROM v_staleness_summary", 200)}
<h2>Pass rates per environment</h2>{_table(con, "SELECT * FROM v_env_pass_rates")}
<h2>Token counts</h2>{_table(con, "SELECT * FROM v_token_counts", 100)}
</body></html>"""


def write_report(db: str, out: str, *, with_audit: bool = True) -> str:
    from replay.tables import open_read_only

    con = open_read_only(db)
    try:
        summary = ok = None
        if with_audit:
            from replay.audit import audit

            rep = audit(con)
            summary, ok = rep.summary(), rep.ok
        page = build_report(con, audit_summary=summary, audit_ok=ok)
        charts = re.findall(r"<svg.*?</svg>", page, re.S)
    finally:
        con.close()
    if out.endswith(".png"):
        _png(page, out, charts)
    else:
        with open(out, "w", encoding="utf-8") as f:
            f.write(page)
    return out


def _png(page: str, out: str, charts: list[str]) -> None:
    """The whole page through a headless Chromium when one is on PATH; otherwise the charts alone,
    drawn by librsvg + cairo (system libraries, through ctypes) in a two-column grid."""
    import os
    import shutil
    import subprocess
    import tempfile

    browser = next((b for b in ("chromium", "chromium-browser", "google-chrome", "chrome") if shutil.which(b)), None)
    if browser is not None:
        with tempfile.NamedTemporaryFile("w", suffix=".html", delete=False, encoding="utf-8") as f:
            f.write(page)
        try:
            subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                            f"--screenshot={os.path.abspath(out)}", "--window-size=1360,2400", f"file://{f.name}"],
                           check=True, capture_output=True, timeout=120)
        finally:
            os.unlink(f.name)
        return
    svg_png(charts, out)


def svg_png(charts: list[str], out: str, columns: int = 2) -> None:
    def lib(*names: str) -> ctypes.CDLL:
        for name in names:
            try:
                return ctypes.CDLL(name)
            except OSError:
                continue
        raise RuntimeError("PNG output needs a headless Chromium or librsvg + cairo; write --out report.html instead")

    rsvg = lib("librsvg-2.so.2", ctypes.util.find_library("rsvg-2") or "librsvg-2.so")
    cairo = lib("libcairo.so.2", ctypes.util.find_library("cairo") or "libcairo.so")
    vp, dbl = ctypes.c_void_p, ctypes.c_double
    rsvg.rsvg_handle_new_from_data.restype = vp
    rsvg.rsvg_handle_new_from_data.argtypes = [ctypes.c_char_p, ctypes.c_size_t, vp]
    rsvg.rsvg_handle_render_cairo.argtypes = [vp, vp]
    cairo.cairo_image_surface_create.restype = vp
    cairo.cairo_image_surface_create.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
    cairo.cairo_create.restype = vp
    cairo.cairo_create.argtypes = [vp]
    for fn, args in (("cairo_set_source_rgb", [vp, dbl, dbl, dbl]), ("cairo_paint", [vp]),
                     ("cairo_translate", [vp, dbl, dbl]), ("cairo_destroy", [vp]), ("cairo_surface_destroy", [vp])):
        getattr(cairo, fn).argtypes = args
    cairo.cairo_surface_write_to_png.argtypes = [vp, ctypes.c_char_p]
    cell_w, cell_h = W + 10, H + 20
    rows = max(1, math.ceil(len(charts) / columns))
    surface = cairo.cairo_image_surface_create(0, cell_w * columns, cell_h * rows)  # CAIRO_FORMAT_ARGB32
    cr = cairo.cairo_create(surface)
    cairo.cairo_set_source_rgb(cr, 1.0, 1.0, 1.0)
    cairo.cairo_paint(cr)
    for i, svg in enumerate(charts):
        data = svg.encode()
        handle = rsvg.rsvg_handle_new_from_data(data, len(data), None)
        if not handle:
            raise RuntimeError(f"librsvg could not read chart {i}")
        x, y = (i % columns) * cell_w, (i // columns) * cell_h
        cairo.cairo_translate(cr, x, y)
        rsvg.rsvg_handle_render_cairo(handle, cr)
        cairo.cairo_translate(cr, -x, -y)
    status = cairo.cairo_surface_write_to_png(surface, out.encode())
    cairo.cairo_destroy(cr)
    cairo.cairo_surface_destroy(surface)
    if status != 0:
        raise RuntimeError(f"writing {out} failed (cairo status {status})")
