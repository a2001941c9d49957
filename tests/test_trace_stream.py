"""prime-rl's trace stream (replay/trace_stream.py) imported as a run (`rollout import-traces RUN_DIR`).

The fixture tests/fixtures/prime-rl-trace-stream/ is written by tests/fixtures/make_prime_rl_trace_stream.py the
way prime-rl's file monitor writes a run: verifiers' own Episode records in chunks 00000 (sealed, zstd, several
frames), 00001 (sealed) and 00002 (live, plain), stream.index.jsonl, and the `orch` and `trainer` annotation streams.
"""

from __future__ import annotations

import json
import shutil
import struct
import uuid
from pathlib import Path

import duckdb
import pytest
import zstandard

import verifiers.v1 as vf  # the `test` extra pins verifiers==0.4.0

from replay.audit import run_audit
from replay.ingest import Replayer
from replay.trace_stream import TraceStream, fold_updates, locate, read_lines
from replay.trace_import import import_file, produce_imported, summary
from rollout.cli import main
from tests.test_replay import log  # noqa: F401 - fixture

FIXTURE = Path(__file__).parent / "fixtures" / "prime-rl-trace-stream"
TRACES = FIXTURE / "monitors" / "file" / "traces"
ARRIVALS = ["g1-0", "g1-1", "g2-0", "ev-0", "g2-1"]


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """A copy of the fixture run to damage."""
    return Path(shutil.copytree(FIXTURE, tmp_path / "run"))


def traces_of(run: Path) -> Path:
    return run / "monitors" / "file" / "traces"


def folded(run: Path = FIXTURE) -> tuple[TraceStream, dict[str, dict]]:
    stream = TraceStream(locate(run))
    return stream, {ep["id"]: ep for _, ep in stream.episodes()}


def content(imp) -> list:
    return [[(k, e.model_dump(mode="json", exclude={"event_id", "created_at", "causation_id"})) for k, e in ep]
            for ep in imp.episodes]


def test_the_fixture_is_the_writers_layout():
    chunks = sorted(p.name for p in (TRACES / "stream").iterdir())
    assert chunks == ["00000.jsonl.zst", "00001.jsonl.zst", "00002.jsonl"]  # two sealed, the live one plain
    sealed = (TRACES / "stream" / "00000.jsonl.zst").read_bytes()
    frames, descriptor, magic = struct.unpack("<IBI", sealed[-9:])  # zstd's seekable format: the seek table footer
    assert magic == 0x8F92EAB1 and descriptor == 0 and frames > 1
    rows = [json.loads(line) for line in (TRACES / "stream.index.jsonl").read_text().splitlines()]
    assert [(r["line"], r["id"], r["chunk"], r["kind"]) for r in rows] == [
        (1, "g1-0", 0, "train"), (2, "g1-1", 0, "train"), (3, "g2-0", 1, "train"), (4, "ev-0", 2, "eval"),
        (5, "g2-1", 2, "train")]
    assert {p.name for p in (TRACES / "annotations").iterdir()} == {"orch", "orch.index.jsonl", "trainer",
                                                                    "trainer.index.jsonl"}
    assert sum(p.stat().st_size for p in FIXTURE.rglob("*") if p.is_file()) < 16_000
    for _, record in folded()[1].items():  # verifiers' own record model reads every episode, folded or not
        episode = vf.WireEpisode.model_validate(record)
        assert episode.traces[0].num_turns >= 1


def test_locate_takes_the_run_dir_its_traces_dir_or_the_stream_dir(tmp_path):
    for path in (FIXTURE, TRACES, TRACES / "stream"):
        assert locate(path) == TRACES, path
    (tmp_path / "traces.jsonl").write_text("")
    assert locate(tmp_path) is None and locate(tmp_path / "traces.jsonl") is None  # a traces.jsonl run


def test_records_come_in_stream_order_across_sealed_and_live_chunks():
    stream = TraceStream(TRACES)
    read = list(stream.records())
    assert [ep["id"] for _, ep in read] == ARRIVALS
    rows = [json.loads(line) for line in (TRACES / "stream.index.jsonl").read_text().splitlines()]
    assert [where for where, _ in read] == [f"episode {r['line']} (chunk {r['chunk']:05d} offset {r['offset']})"
                                            for r in rows]
    assert [where for where, _ in read][:3] == ["episode 1 (chunk 00000 offset 0)",
                                                f"episode 2 (chunk 00000 offset {rows[1]['offset']})",
                                                "episode 3 (chunk 00001 offset 0)"]
    assert not stream.skipped and not stream.notes
    # a sealed chunk decompresses to exactly the text the index's offsets point into
    assert [(c, o) for c, o, _ in read_lines(TRACES / "stream", "stream", [])] == [(r["chunk"], r["offset"])
                                                                                   for r in rows]


def test_a_chunk_is_read_plain_while_its_plain_file_is_there(run_dir):
    """Sealing writes the .zst twin before it removes the plain file: a reader between the two reads the plain."""
    stream = traces_of(run_dir) / "stream"
    first = next(r for _, _, r in read_lines(stream, "stream", []))
    (stream / "00000.jsonl").write_text(json.dumps({**first, "id": "plain-copy"}) + "\n")
    (stream / "00001.jsonl.zst.tmp").write_bytes(b"partial seal")  # a seal in progress is not a chunk
    assert [r["id"] for _, _, r in read_lines(stream, "stream", [])] == ["plain-copy", "g2-0", "ev-0", "g2-1"]


def test_annotations_fold_on_and_the_later_value_wins():
    raw = {ep["id"]: ep for _, ep in TraceStream(TRACES).records()}
    assert "advantage" not in raw["g1-0"]["traces"][0]["info"]  # the stream's records stay as they arrived
    _, eps = folded()
    info = eps["g1-0"]["traces"][0]["info"]
    # orch wrote advantage 0.5 (group stamp), then 1.0 with the batch that shipped it: the later one wins
    assert info["advantage"] == 1.0 and eps["g1-1"]["traces"][0]["info"]["advantage"] == -1.0
    assert info["effective"] is True and info["ship"] == {"step": 1, "time": 1_790_000_005.0}
    assert info["trainer"] == {"step": 1, "policy_version": 0}
    assert info["kind"] == "train" and info["arrival"]["step"] == 0  # the arrival stamps are kept, merged into
    node = eps["g1-0"]["traces"][0]["nodes"][1]  # the sampled node: streams compacted over its mask
    assert node["advantages"] == [1.0, 1.0, 1.0]
    assert node["trainer_logprobs"] == pytest.approx([lp - 0.0001 for lp in node["logprobs"]])
    assert "advantages" not in eps["g1-0"]["traces"][0]["nodes"][0]  # the prompt node samples nothing
    g2 = eps["g2-0"]["traces"][0]["info"]
    assert g2["advantage"] == 0.5 and "effective" not in g2  # stamped, not shipped
    assert set(eps["ev-0"]["traces"][0]["info"]) == {"kind", "dispatch", "arrival"}  # no annotation


def test_producers_fold_in_name_order(run_dir):
    """prime-rl's reader folds producer after producer by name, each in write order; not by wall clock."""
    annotations = traces_of(run_dir) / "annotations"
    for producer, advantage in (("aaa", 9.0), ("zzz", 7.0)):
        (annotations / producer).mkdir()
        (annotations / producer / "00000.jsonl").write_text(json.dumps(
            {"version": 1, "trace_id": "g1-0-solver", "info": {"advantage": advantage, "ship": {"step": 2}},
             "branches": []}) + "\n")
    _, eps = folded(run_dir)
    info = eps["g1-0"]["traces"][0]["info"]
    assert info["advantage"] == 7.0  # aaa < orch < trainer < zzz
    assert info["ship"] == {"step": 2, "time": 1_790_000_005.0}  # info is deep-merged: ship.time stays


def test_fold_projects_a_stream_only_onto_nodes_it_covers():
    trace = {"info": {"a": {"x": 1}}, "nodes": [
        {"token_ids": [1, 2], "mask": []},
        {"parent": 0, "token_ids": [3, 4, 5], "mask": [False, True, True]},
        {"parent": 1, "token_ids": [6], "mask": []},
        {"parent": 2, "token_ids": [7, 8], "mask": [True, True]},
        {"parent": 1, "token_ids": [9], "mask": [True]},  # a second branch: leaf 4
    ]}
    fold_updates(trace, [
        {"version": 1, "trace_id": "t", "info": {"a": {"y": 2}}, "branches": [
            # branch 0 = nodes 0,1,2,3 (8 tokens); the stream stops short of node 3
            {"index": 0, "advantages": [None, None, None, 0.5, 0.5, None, 0.5],
             "entropies": [None, None, None, None, 0.1, None, 0.2, 0.3],  # a null at a sampled token of node 1
             "is_masked": [None, None, None, None, None, None, True, False]},
            {"index": 1, "advantages": [None] * 5 + [2.0]},
            {"index": 7, "advantages": [1.0]}]}])  # no such branch
    nodes = trace["nodes"]
    assert trace["info"] == {"a": {"x": 1, "y": 2}}
    assert nodes[1]["advantages"] == [0.5, 0.5] and "advantages" not in nodes[3]
    assert "entropies" not in nodes[1] and nodes[3]["entropies"] == [0.2, 0.3]
    assert "is_masked" not in nodes[1] and nodes[3]["is_masked"] == [True, False]  # all-null: left as it was
    assert nodes[4]["advantages"] == [2.0]


def test_a_torn_last_line_is_skipped_with_its_reason(run_dir, capsys):
    live = traces_of(run_dir) / "stream" / "00002.jsonl"
    size = live.stat().st_size
    torn = b'{"id":"g3-0","env":{"id":"math","na'  # the writer died mid-append
    with live.open("ab") as f:
        f.write(torn)
    imp = import_file(run_dir, "torn")
    assert imp.rollouts == 5 and not imp.notes
    assert imp.skipped == [f"stream chunk 00002 offset {size}: a torn last line ({len(torn)} bytes without a "
                           "newline: the writer stopped mid-append), skipped"]
    assert main(["import-traces", str(run_dir), "--dry-run"]) == 0
    out = capsys.readouterr()
    assert "torn last line" in out.err and "5 rollouts" in out.out and "1 lines skipped" in out.out


@pytest.mark.parametrize("keep", [200, 1000])
def test_a_sealed_chunk_cut_short_is_reported(run_dir, keep):
    """zstd stops quietly where a cut frame ends; the seek table says how much there should have been."""
    sealed = traces_of(run_dir) / "stream" / "00000.jsonl.zst"
    sealed.write_bytes(sealed.read_bytes()[:keep])
    imp = import_file(run_dir, "cut")
    assert [e.rollout_id for ep in imp.episodes for k, e in ep if k == "rollouts"] == ["g2-0", "ev-0", "g2-1"]
    cut = [s for s in imp.skipped if s.startswith("stream chunk 00000.jsonl.zst: cut short, no seek table")]
    assert len(cut) == 1 and cut[0].endswith("; the rest is lost")
    assert [s.split(":")[0] for s in imp.skipped if s.startswith("stream.index.jsonl")] == [
        "stream.index.jsonl line 1", "stream.index.jsonl line 2"]  # the episodes the index knows, not found
    assert imp.notes == ["2 annotated trace(s) are not in the stream (e.g. 'g1-0-solver'); their updates were not "
                         "applied"]


def test_a_sealed_chunk_shorter_than_its_seek_table(run_dir):
    stream = traces_of(run_dir) / "stream"
    text = (stream / "00002.jsonl").read_bytes()
    first = text[:text.index(b"\n") + 1]
    frame = zstandard.ZstdCompressor().compress(first[:100])  # a whole frame, but less than the table says
    table = struct.pack("<II", len(frame), len(first)) + struct.pack("<IBI", 1, 0, 0x8F92EAB1)
    (stream / "00003.jsonl.zst").write_bytes(frame + struct.pack("<II", 0x184D2A5E, len(table)) + table)
    imp = import_file(run_dir, "short")
    assert imp.rollouts == 5
    assert imp.skipped[-1] == (f"stream chunk 00003.jsonl.zst: cut short, 100 of the {len(first)} bytes its seek "
                               "table records decompressed; the rest is lost")
    assert "a torn last line" in imp.skipped[0]


def test_without_the_index_the_chunks_are_read_in_order(run_dir, capsys):
    (traces_of(run_dir) / "stream.index.jsonl").unlink()
    imp = import_file(traces_of(run_dir) / "stream", "noindex")
    assert [e.rollout_id for ep in imp.episodes for k, e in ep if k == "rollouts"] == ARRIVALS
    assert not imp.skipped
    assert imp.notes == ["no stream.index.jsonl: the chunks were read in number order without it (the index is "
                         "derived from the stream)"]
    assert main(["import-traces", str(run_dir), "--dry-run"]) == 0
    assert "note: no stream.index.jsonl" in capsys.readouterr().err


def test_an_index_behind_or_ahead_of_the_stream(run_dir):
    index = traces_of(run_dir) / "stream.index.jsonl"
    rows = index.read_text().splitlines()
    # the writer flushes the stream before the index: the last episode has no row yet
    index.write_text("\n".join(rows[:-1]) + "\n")
    imp = import_file(run_dir, "behind")
    assert imp.rollouts == 5 and not imp.skipped
    assert imp.notes == ["1 episode(s) had no index row (the writer flushes the stream before its index, so the "
                         "newest may lag); read from the stream"]
    # a row naming a record the stream does not hold
    ghost = {**json.loads(rows[-1]), "line": 6, "id": "ghost", "offset": 99999}
    index.write_text("\n".join(rows + [json.dumps(ghost)]) + "\n")
    imp = import_file(run_dir, "ahead")
    assert imp.rollouts == 5 and imp.skipped == [
        "stream.index.jsonl line 6: names episode 'ghost' at chunk 00002 offset 99999, where the stream holds no "
        "record; skipped"]


def test_a_stream_without_chunks_is_one_clear_error(run_dir, capsys):
    for p in (traces_of(run_dir) / "stream").iterdir():
        p.unlink()
    with pytest.raises(ValueError, match="a trace stream without chunks"):
        import_file(run_dir)
    assert main(["import-traces", str(run_dir), "--dry-run"]) == 2
    assert "a trace stream without chunks" in capsys.readouterr().err


def test_the_stream_imports_as_a_run():
    imp = import_file(FIXTURE, "stream")
    assert summary(imp) == "imported run stream: 5 rollouts, 6 steps, 5 scores, 2 policy revisions"
    by_id = {e.rollout_id: ep for ep in imp.episodes for k, e in ep if k == "rollouts"}
    assert list(by_id) == ARRIVALS
    steps = {e.step_id: e for ep in imp.episodes for k, e in ep if k == "steps"}
    first, second = steps["g2-0.solver.2"], steps["g2-0.solver.4"]
    assert (first.prompt_token_ids.tolist(), first.completion_token_ids.tolist()) == ([1, 2, 3, 7, 8, 6], [70, 71, 72])
    assert second.prompt_token_ids.tolist() == [1, 2, 3, 7, 8, 6, 70, 71, 72, 9, 10, 6]
    assert second.completion_logprobs.tolist() == pytest.approx([-0.0625, -0.0312])
    assert [m.role for m in second.prompt] == ["system", "user", "assistant", "tool"]
    assert first.finish_reason == "tool_calls" and first.tool_calls[0].name == "add"
    assert {(s.step_id.split(".")[0], s.policy.revision) for s in steps.values()} == {
        ("g1-0", 0), ("g1-1", 0), ("g2-0", 1), ("ev-0", 1), ("g2-1", 1)}  # run.work.policy
    rollout = next(e for k, e in by_id["g1-0"] if k == "rollouts")
    score = next(e for k, e in by_id["g1-0"] if k == "scores")
    assert rollout.group_id == "g-1" and not rollout.evaluation
    assert rollout.artifacts["verifiers"]["info"]["solver"]["ship"]["step"] == 1
    assert score.rewards == {"solver": 1.0} and score.metrics["advantage"] == 1.0
    assert next(e for k, e in by_id["ev-0"] if k == "rollouts").evaluation  # info.kind "eval"
    # the run dir, its traces dir and the stream dir are the same import
    for path in (TRACES, TRACES / "stream"):
        again = import_file(path, "stream")
        assert content(again) == content(imp)


def test_the_help_names_the_stream_dir(capsys):
    with pytest.raises(SystemExit):
        main(["import-traces", "--help"])
    assert "monitors/file/traces" in capsys.readouterr().out


@pytest.mark.integration
async def test_the_trace_stream_through_the_log(log, tmp_path):  # noqa: F811
    """stream dir -> import -> log -> replay: the rollouts, their steps' tokens and the folded credit."""
    imp = import_file(FIXTURE, f"prs{uuid.uuid4().hex[:8]}")
    assert not imp.skipped and not imp.notes
    await produce_imported(imp, log)
    db = str(tmp_path / "stream.duckdb")
    await Replayer(db, log, run_id=imp.run_id).run()
    con = duckdb.connect(db, read_only=True)
    try:
        rollouts = dict(con.execute("SELECT rollout_id, evaluation FROM rollouts").fetchall())
        steps = con.execute("SELECT rollout_id, step_index, policy_revision, prompt_token_ids, completion_token_ids "
                            "FROM steps ORDER BY rollout_id, step_index").fetchall()
        rewards = dict(con.execute("SELECT rollout_id, reward FROM score_rewards").fetchall())
        metrics = {r: dict(m) for r, m in con.execute("SELECT rollout_id, metrics FROM scores").fetchall()}
        (info,) = con.execute("SELECT artifacts FROM rollouts WHERE rollout_id = 'g1-0'").fetchone()
    finally:
        con.close()
    assert rollouts == {"g1-0": False, "g1-1": False, "g2-0": False, "ev-0": True, "g2-1": False}
    assert len(steps) == 6 and ("g2-0", 1, 1, [1, 2, 3, 7, 8, 6, 70, 71, 72, 9, 10, 6], [80, 81]) in steps
    assert rewards == {"g1-0": 1.0, "g1-1": 0.0, "g2-0": 1.0, "ev-0": 1.0, "g2-1": 0.0}
    # the batch stamp's advantage, folded over the group stamp's
    assert (metrics["g1-0"]["advantage"], metrics["g1-1"]["advantage"], metrics["g2-0"]["advantage"]) == \
        (1.0, -1.0, 0.5)
    assert json.loads(info)["verifiers"]["info"]["solver"]["effective"] is True
    report = run_audit(db)
    assert report.ok, report.summary()
