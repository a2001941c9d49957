"""Fetched record sets, read in bulk: replay's own Fetch requests and the compiled reader (``native/``).

aiokafka's consumer turns every record into a Python ``ConsumerRecord`` before replay sees it; with the frame
decode and the Arrow build, that per-message Python work was most of a replay (benchmarks/RESULTS.md, issue
27). Here replay sends its own Fetch requests (read_committed, through the consumer's client: its connections,
metadata and security settings) and hands each partition's record set, as the broker sent it, to
``rollout_native.RecordSet``, which checks CRCs, drops aborted transactions and control batches, skips other
runs on their header and decodes Step frames straight into Arrow buffers. Everything else comes back as
single records for the Python decoder (``replay.frames``), so refusals and dead letters are unchanged.

Without the compiled module (``pip install ./native``; ``.ci/setup`` builds it) each record set is read by
aiokafka's own ``PartitionRecords``, record by record, as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from typing import Any

import pyarrow as pa

from replay import tables as T

try:
    import rollout_native
except ImportError:  # not built: replay reads record by record
    rollout_native = None

READ_COMMITTED = 1
# The most one of replay's fetch responses brings (a larger first batch still comes whole: KIP-74). Larger than the
# services' (streams.settings.FETCH_MAX_BYTES): a record set here is copied once, not record by record, and each
# response costs aiokafka's Python protocol decode for every partition asked: 16 MB replays ~5% faster than 4 MB
# (benchmarks/RESULTS.md, issue 27).
FETCH_MAX_BYTES = 16 * 1024 * 1024


def native_reader() -> Any:
    """The compiled reader's module, or None when it was not built (``pip install ./native``)."""
    return rollout_native


def step_table(cols: Any) -> pa.Table:
    """The rows ``rollout_native.StepColumns`` holds, as a ``steps`` table (the columns start empty again)."""
    n = len(cols)
    parts = cols.take()
    arrays = []
    for f in T.STEPS.schema:
        validity, nulls, *buffers = parts[f.name]
        bufs = [pa.py_buffer(b) for b in buffers]
        if pa.types.is_list(f.type):
            offsets, values = bufs
            child = pa.Array.from_buffers(f.type.value_type, len(values) * 8 // f.type.value_type.bit_width,
                                          [None, values])
            arrays.append(pa.Array.from_buffers(f.type, n, [None, offsets], children=[child]))
        else:
            valid = None if validity is None else pa.py_buffer(validity)
            arrays.append(pa.Array.from_buffers(f.type, n, [valid, *bufs], null_count=nulls))
    return pa.Table.from_arrays(arrays, schema=T.STEPS.schema)


def python_records(tp: Any, data: bytes, fetch_offset: int, aborted: list[tuple[int, int]] | None) -> Iterator[Any]:
    """The records of a record set, read by aiokafka (read_committed): where the compiled reader is missing, and
    for the batches it leaves to Python (compressed, or an older message format). Yields ConsumerRecords; the
    iterator's ``next_fetch_offset`` is where the next fetch starts."""
    from aiokafka.consumer.fetcher import PartitionRecords
    from aiokafka.record.memory_records import MemoryRecords

    return PartitionRecords(tp, MemoryRecords(data), aborted, fetch_offset, None, None, True, READ_COMMITTED)


class Fetcher:
    """Fetch requests of replay's own, one per partition leader, for the partitions it is given."""

    def __init__(self, consumer: Any, *, max_wait_ms: int, max_bytes: int, partition_max_bytes: int) -> None:
        self.client = consumer._client
        self.max_wait_ms = max_wait_ms
        self.max_bytes = max_bytes
        self.partition_max_bytes = partition_max_bytes

    async def fetch(self, positions: Mapping[Any, int]) -> dict[Any, tuple[bytes, list[tuple[int, int]]]]:
        """{partition: (record set bytes, aborted transactions)} for those with data at their position."""
        from aiokafka import errors as Errors
        from aiokafka.protocol.fetch import FetchRequest

        by_node: dict[int, dict[str, list[tuple[int, int, int]]]] = {}
        for tp, offset in positions.items():
            node = self.client.cluster.leader_for_partition(tp)
            if node is None or node == -1:
                self.client.force_metadata_update()
                continue
            by_node.setdefault(node, {}).setdefault(tp.topic, []).append((tp.partition, offset, self.partition_max_bytes))
        requests = [(node, FetchRequest(self.max_wait_ms, 1, self.max_bytes, READ_COMMITTED, list(topics.items())))
                    for node, topics in by_node.items()]
        responses = await asyncio.gather(*(self.client.send(node, req) for node, req in requests),
                                         return_exceptions=True)
        out = {}
        by_tp = {(tp.topic, tp.partition): tp for tp in positions}
        for response in responses:
            if isinstance(response, Errors.KafkaError):  # a connection lost: metadata again, and the next round retries
                self.client.force_metadata_update()
                continue
            if isinstance(response, BaseException):
                raise response
            for topic, partitions in response.topics:
                for partition, error_code, _highwater, *part_data in partitions:
                    tp = by_tp[(topic, partition)]
                    error = Errors.for_code(error_code)
                    if error is Errors.NoError:
                        # as aiokafka's Fetcher reads them: v11+ [lso, log start, aborted, preferred replica, records],
                        # v5-v10 [lso, log start, aborted, records], v4 [lso, aborted, records]
                        v = response.API_VERSION
                        aborted = part_data[2] if v >= 11 else part_data[-2] if v >= 4 else None
                        if part_data[-1]:
                            out[tp] = (part_data[-1], list(aborted or ()))
                    elif error is Errors.OffsetOutOfRangeError:
                        raise error(f"{tp.topic}:{tp.partition} offset {positions[tp]} is no longer on the log "
                                    "(deleted by retention during the replay)")
                    elif getattr(error, "retriable", False) or getattr(error, "invalid_metadata", False):
                        self.client.force_metadata_update()
                    else:
                        raise error(f"fetching {tp.topic}:{tp.partition}")
        return out



def check_columns() -> None:
    """The compiled reader and ``replay.tables.STEPS`` name the same columns (else the build is stale)."""
    if rollout_native is None:
        return
    got = set(rollout_native.StepColumns().take())
    want = set(T.STEPS.schema.names)
    if got != want:
        raise RuntimeError(f"rollout_native is out of date with replay.tables.STEPS (missing {sorted(want - got)}, "
                           f"extra {sorted(got - want)}): rebuild it with `pip install ./native`")


