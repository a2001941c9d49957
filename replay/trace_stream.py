"""prime-rl's trace stream: the episodes of a run as its file monitor writes them, read in stream order with the
trace annotations folded on, for ``replay.trace_import.import_file`` (``rollout import-traces RUN_DIR``).

The layout (prime-rl ``monitors/file/traces``: ``__init__.py``, ``chunks.py``, ``update.py``, ``monitor.py``)::

    <run>/monitors/file/traces/stream/00000.jsonl.zst        sealed chunk: zstd in independent (seekable) frames
    <run>/monitors/file/traces/stream/00001.jsonl            the live chunk, plain text
    <run>/monitors/file/traces/stream.index.jsonl            one summary row per episode, with its chunk and offset
    <run>/monitors/file/traces/annotations/<producer>/       one chunked stream of trace updates per producer
    <run>/monitors/file/traces/annotations/<producer>.index.jsonl

* The stream holds one ``verifiers.v1.Episode`` record per line (``Episode.to_record``), every episode exactly once
  in arrival order, train and eval alike. Chunks are numbered ``{n:05d}``; a line never spans chunks; the writer
  rolls to a new chunk at ``monitors.file.chunk_bytes`` and seals the full one as ``.jsonl.zst`` (the plain file
  is removed only once its twin is complete, so a chunk is read plain when the plain file is there, else sealed).
* The index row of an episode: ``line`` (1-based, continuing across relaunches), ``chunk``, ``offset`` (bytes into
  the chunk's plain text) and summary columns (``id``, ``kind``, ``trace_ids``, ``reward``, ...). The writer
  flushes the stream before the index, so the index may lag the stream by the episodes just written, never lead.
  It is derived: without it the chunks are read in number order (as prime-rl's ``chunks.read_records`` does),
  with a note. A row naming a record the stream does not hold is reported and skipped.
* An annotation (``update.py``, ``version`` 1): ``{"version", "trace_id", "info": {...}, "branches": [{"index",
  <stream>: [...]}]}``. The orchestrator (``orch``) writes cohort membership and credit (``info.effective``,
  ``info.ship = {step, time}``, ``info.advantage``, per-branch ``advantages``), the trainer (``trainer``) its
  recomputed ``trainer_logprobs``/``entropies``/``is_masked``. They are folded onto the trace records the way
  prime-rl's reader (its dashboard: ``annotation_index`` + ``trace_updates`` + ``fold_trace_updates``) does: the
  producers in name order, each one's records in write order, each ``info`` deep-merged into the trace's own
  (newest wins), each per-token stream (full length over the branch's tokens, nulls for unknown positions)
  projected onto the nodes of its branch, compacted over each node's sampled mask; a node takes a stream only
  when it covers all the node's tokens with no null at a sampled position (``is_masked`` keeps nulls).
* The live chunk's last line may be torn (the process died mid-append): it is skipped with a reason, as is any
  line that is not a JSON record; the read goes on.
"""

from __future__ import annotations

import io
import json
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

TRACES_SUBDIR = Path("monitors") / "file" / "traces"  # under a run's output dir
STREAM = "stream"
ANNOTATIONS = "annotations"
UPDATE_VERSION = 1  # prime-rl monitors/file/traces/update.py UPDATE_VERSION
STREAM_FIELDS = ("advantages", "trainer_logprobs", "entropies", "is_masked")  # per-token streams an update carries
CHUNK = re.compile(r"(\d+)\.jsonl(\.zst)?")


def index_path(stream: Path) -> Path:
    """A stream's index sits beside it, named for it: ``stream`` -> ``stream.index.jsonl``."""
    return stream.with_name(stream.name.removesuffix(".jsonl") + ".index.jsonl")


def _has_chunks(directory: Path) -> bool:
    return directory.is_dir() and any(CHUNK.fullmatch(p.name) for p in directory.iterdir())


def locate(path: str | Path) -> Path | None:
    """The ``monitors/file/traces`` directory of a trace stream, given the run's output dir, that directory or its
    ``stream`` directory; None when ``path`` is none of those (a traces.jsonl, or a dir holding one)."""
    p = Path(path)
    if not p.is_dir():
        return None
    for traces in (p / TRACES_SUBDIR, p, *([p.parent] if p.name == STREAM else [])):
        if _has_chunks(traces / STREAM) or index_path(traces / STREAM).is_file():
            return traces
    return None


def chunk_files(directory: Path) -> list[tuple[int, Path]]:
    """(number, file) of every chunk in number order: the plain file while there is one, else the sealed twin."""
    found: dict[int, Path] = {}
    for p in directory.iterdir() if directory.is_dir() else ():
        m = CHUNK.fullmatch(p.name)
        if m and (int(m.group(1)) not in found or not m.group(2)):  # partial seals (.zst.tmp) never match
            found[int(m.group(1))] = p
    return sorted(found.items())


def _zstd():
    try:
        import zstandard
    except ImportError:  # a dependency (pyproject.toml); said plainly where an older environment lacks it
        raise ValueError("a sealed chunk (.jsonl.zst) needs the zstandard package: pip install zstandard") from None
    return zstandard


def _read_errors() -> tuple[type[Exception], ...]:
    try:
        import zstandard
    except ImportError:
        return (OSError,)
    return (OSError, zstandard.ZstdError)


def _open(path: Path) -> BinaryIO:
    if path.suffix != ".zst":
        return path.open("rb")
    zstandard = _zstd()
    raw = path.open("rb")
    # a sealed chunk is a run of independent frames plus a skippable seek-table frame: read across all of them
    return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True,
                                                                        closefd=True))


SEEKABLE_MAGIC = 0x8F92EAB1  # zstd's seekable format: the seek table's footer ends with it


def sealed_size(path: Path) -> int | None:
    """The plain size a sealed chunk's seek table records (the sum of its frames' decompressed sizes), or None when
    it has no seek table (the writer's ``SeekableZstdFile`` writes one on close, before the chunk is renamed in)."""
    with path.open("rb") as f:
        end = f.seek(0, io.SEEK_END)
        if end < 17:
            return None
        f.seek(end - 9)
        frames, descriptor, magic = struct.unpack("<IBI", f.read(9))
        entry = 12 if descriptor & 0x80 else 8  # with a checksum per frame, or without
        if magic != SEEKABLE_MAGIC or end < 17 + frames * entry:
            return None
        f.seek(end - 9 - frames * entry)
        table = f.read(frames * entry)
    return sum(struct.unpack_from("<I", table, i * entry + 4)[0] for i in range(frames))


def read_lines(directory: Path, label: str, skipped: list[str]) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """(chunk, offset, record) of every record of a chunked stream, in order. A torn last line, or a line that is
    not a JSON object, is skipped with its reason in ``skipped``."""
    for number, path in chunk_files(directory):
        offset = 0
        expected = sealed_size(path) if path.suffix == ".zst" else None
        try:
            with _open(path) as f:
                for line in f:
                    at, offset = offset, offset + len(line)
                    where = f"{label} chunk {number:05d} offset {at}"
                    if not line.endswith(b"\n"):
                        skipped.append(f"{where}: a torn last line ({len(line)} bytes without a newline: the writer "
                                       "stopped mid-append), skipped")
                        continue
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except ValueError as e:
                        skipped.append(f"{where}: not a JSON record ({e}), skipped")
                        continue
                    if not isinstance(record, dict):
                        skipped.append(f"{where}: not a JSON object, skipped")
                        continue
                    yield number, at, record
        except _read_errors() as e:  # a sealed chunk that does not decompress (to its end)
            skipped.append(f"{label} chunk {path.name}: unreadable after offset {offset} ({type(e).__name__}: {e})")
            continue
        if path.suffix == ".zst" and offset != expected:  # zstd stops quietly at a cut frame: the seek table says
            skipped.append(f"{label} chunk {path.name}: cut short, " + (
                f"{offset} of the {expected} bytes its seek table records decompressed" if expected is not None else
                f"no seek table (a sealed chunk ends with one); {offset} bytes decompressed") + "; the rest is lost")


def _index_rows(path: Path, skipped: list[str]) -> list[dict[str, Any]]:
    rows = []
    with path.open("rb") as f:
        for no, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                skipped.append(f"{path.name} line {no}: a torn last line, skipped")
                continue
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                skipped.append(f"{path.name} line {no}: not JSON ({e}), skipped")
    return rows


# ---------------------------------------------------------------------------------------------- folding

def branch_paths(nodes: list[dict[str, Any]]) -> list[list[int]]:
    """Node indexes root to leaf, one list per branch; branches are numbered by their leaf's index order."""
    n = len(nodes)
    parents = {p for node in nodes if isinstance(p := node.get("parent"), int) and 0 <= p < n}
    out = []
    for leaf in (i for i in range(n) if i not in parents):
        path: list[int] = []
        i: Any = leaf
        while isinstance(i, int) and 0 <= i < n and i not in path:
            path.append(i)
            i = nodes[i].get("parent")
        out.append(path[::-1])
    return out


def merge_info(old: Any, new: Any) -> Any:
    """``new`` over ``old``, recursively through dicts: the later value of a key wins."""
    if isinstance(old, dict) and isinstance(new, dict):
        return {**old, **{k: merge_info(old.get(k), v) for k, v in new.items()}}
    return new


def fold_updates(trace: dict[str, Any], updates: list[dict[str, Any]]) -> None:
    """Apply a trace's updates onto its record, in order (the later wins)."""
    nodes = trace.get("nodes") or []
    paths = branch_paths(nodes)
    for update in updates:
        if update.get("info"):
            trace["info"] = merge_info(trace.get("info") or {}, update["info"])
        for branch in update.get("branches") or []:
            b = branch.get("index")
            if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < len(paths):
                continue
            for name in STREAM_FIELDS:
                values = branch.get(name)
                if not values or not isinstance(values, list):
                    continue
                pos = 0
                for i in paths[b]:
                    node = nodes[i]
                    width = len(node.get("token_ids") or [])
                    span, pos = values[pos:pos + width], pos + width
                    if len(span) < width:  # the stream stops short of this node: it and the rest keep theirs
                        break
                    sampled = [v for v, m in zip(span, node.get("mask") or []) if m]
                    if not sampled or (name == "is_masked" and all(v is None for v in sampled)):
                        continue
                    if name != "is_masked" and any(v is None for v in sampled):
                        continue
                    node[name] = sampled


# ---------------------------------------------------------------------------------------------- the reader

@dataclass
class TraceStream:
    """The trace stream under ``traces`` (a ``monitors/file/traces`` directory, see ``locate``)."""

    traces: Path
    skipped: list[str] = field(default_factory=list)  # what was not read, and why
    notes: list[str] = field(default_factory=list)  # how it was read, where that is worth saying

    @property
    def stream(self) -> Path:
        return self.traces / STREAM

    def annotations(self) -> dict[str, list[dict[str, Any]]]:
        """trace id -> its updates, in fold order: producers by name, each one's records in write order."""
        by_trace: dict[str, list[dict[str, Any]]] = {}
        root = self.traces / ANNOTATIONS
        for producer in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else ():
            for chunk, offset, update in read_lines(producer, f"annotations/{producer.name}", self.skipped):
                where = f"annotations/{producer.name} chunk {chunk:05d} offset {offset}"
                if update.get("version", UPDATE_VERSION) != UPDATE_VERSION:
                    self.skipped.append(f"{where}: update version {update.get('version')!r} (this reader folds "
                                        f"version {UPDATE_VERSION}), skipped")
                elif not isinstance(update.get("trace_id"), str):
                    self.skipped.append(f"{where}: an update naming no trace, skipped")
                else:
                    by_trace.setdefault(update["trace_id"], []).append(update)
        return by_trace

    def records(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """(where, episode record) in stream order, as written (nothing folded)."""
        chunks = chunk_files(self.stream)
        index = index_path(self.stream)
        if not chunks:
            raise ValueError(f"{self.stream}: a trace stream without chunks (no NNNNN.jsonl or NNNNN.jsonl.zst)")
        rows: dict[tuple[int, int], dict[str, Any]] = {}
        indexed = index.is_file()
        if indexed:
            for row in _index_rows(index, self.skipped):
                try:
                    rows[(int(row.get("chunk") or 0), int(row["offset"]))] = row
                except (AttributeError, KeyError, TypeError, ValueError):
                    self.skipped.append(f"{index.name}: a row without a chunk and offset ({str(row)[:80]}), "
                                        "skipped")
        else:
            self.notes.append(f"no {index.name}: the chunks were read in number order without it (the index is "
                              "derived from the stream)")
        unindexed = 0
        for chunk, offset, record in read_lines(self.stream, STREAM, self.skipped):
            row = rows.pop((chunk, offset), None)
            if row is not None:
                where = f"episode {row.get('line')} (chunk {chunk:05d} offset {offset})"
                if row.get("id") is not None and row.get("id") != record.get("id"):
                    self.notes.append(f"{where}: the index names episode {row.get('id')!r}, the stream holds "
                                      f"{record.get('id')!r}; the stream's record is read")
            else:
                where = f"chunk {chunk:05d} offset {offset}"
                unindexed += indexed
            yield where, record
        if unindexed:
            self.notes.append(f"{unindexed} episode(s) had no index row (the writer flushes the stream before its "
                              "index, so the newest may lag); read from the stream")
        for (chunk, offset), row in sorted(rows.items()):
            self.skipped.append(f"{index.name} line {row.get('line')}: names episode {row.get('id')!r} at chunk "
                                f"{chunk:05d} offset {offset}, where the stream holds no record; skipped")

    def episodes(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """(where, episode record) in stream order, with every trace's annotations folded on."""
        updates = self.annotations()
        seen: set[str] = set()
        for where, record in self.records():
            for trace in record.get("traces") or []:
                tid = trace.get("id")
                if isinstance(tid, str) and tid in updates:
                    fold_updates(trace, updates[tid])
                    seen.add(tid)
            yield where, record
        if orphans := sorted(set(updates) - seen):
            self.notes.append(f"{len(orphans)} annotated trace(s) are not in the stream (e.g. {orphans[0]!r}); "
                              "their updates were not applied")
