"""The private parts of aiokafka this code relies on, checked once when a processor or emitter starts.

Exactly-once here reaches into aiokafka 0.14 where its public API stops: the group fence replaces the sender's
``_do_txn_offset_commit`` (``streams.group_fencing``), commits again through the transaction manager's and
sender's hooks (``streams.commits``), reads the group's offsets through the consumer's coordinator
(``streams.group_offsets``). No aiokafka release promises to keep these. Some would not even fail when gone:
replacing ``_do_txn_offset_commit`` on a sender that no longer calls it turns the fence off without an error.
So each name is checked where aiokafka defines it, and a mismatch stops the service with the list, before it
commits anything. After an aiokafka upgrade, also run ``tests/test_group_fencing.py``: it shows the fence
refusing a stale generation on a real broker. ``stop_consumer`` works around one public method's bug instead.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from functools import cache

log = logging.getLogger("rollout.eos")

TESTED_VERSION = "0.14.0"  # the fencing tests passed against this release (pyproject.toml pins it)


class AiokafkaInternalsChanged(RuntimeError):
    """aiokafka no longer has a private part the exactly-once code depends on."""


def missing() -> list[str]:
    """What of the private API this code uses the installed aiokafka lacks (empty: all there)."""
    from aiokafka.consumer.group_coordinator import GroupCoordinator
    from aiokafka.producer.producer import AIOKafkaProducer
    from aiokafka.producer.sender import Sender, TxnOffsetCommitHandler
    from aiokafka.producer.transaction_manager import TransactionManager

    gone = [f"{cls.__name__}.{name}" for cls, names in (
        (Sender, ("_do_txn_offset_commit", "_do_add_offsets_to_txn", "_find_coordinator",
                  "_maybe_do_transactional_request")),
        (TransactionManager, ("maybe_add_partition_to_txn", "add_offsets_to_txn", "consumer_group_to_add",
                              "consumer_group_added", "error_transaction", "wait_for_pid")),
        (TxnOffsetCommitHandler, ("create_request", "handle_response", "do")),
        (GroupCoordinator, ("_send_req", "ensure_coordinator_known", "coordinator_dead", "request_rejoin")),
    ) for name in names if not hasattr(cls, name)]
    # set in __init__: read from the source, since building one needs a running client
    for cls, attrs in ((TransactionManager, ("_transaction_waiter", "_txn_partitions")),
                       (GroupCoordinator, ("self.generation", "self.member_id")),
                       (AIOKafkaProducer, ("self._txn_manager", "self._sender", "self.client"))):
        source = inspect.getsource(cls.__init__)
        gone += [f"{cls.__name__}().{a.removeprefix('self.')}" for a in attrs if a not in source]
    # the fence is the sender calling the method group_fencing replaces, by that name, on itself
    if hasattr(Sender, "_maybe_do_transactional_request") and \
            "self._do_txn_offset_commit(" not in inspect.getsource(Sender._maybe_do_transactional_request):
        gone.append("Sender._maybe_do_transactional_request calling self._do_txn_offset_commit")
    return gone


@cache
def check() -> None:
    """Raise ``AiokafkaInternalsChanged`` naming what is missing; warn on an untested release."""
    import aiokafka

    gone = missing()
    if gone:
        raise AiokafkaInternalsChanged(
            f"aiokafka {aiokafka.__version__} lacks what rollout-log's exactly-once code uses: {', '.join(gone)}. "
            f"Install aiokafka=={TESTED_VERSION} (pyproject.toml pins it), or port streams/group_fencing.py, "
            "streams/commits.py and streams/group_offsets.py to this release and run tests/test_group_fencing.py")
    if aiokafka.__version__ != TESTED_VERSION:
        log.warning("aiokafka %s: the exactly-once code was tested with %s; run tests/test_group_fencing.py",
                    aiokafka.__version__, TESTED_VERSION)


async def stop_consumer(consumer) -> None:
    """``consumer.stop()``, also when the broker is gone: aiokafka 0.14's ``Fetcher.close()`` awaits the fetch
    requests it has just cancelled without suppressing their cancellation, so a stop while fetches wait to retry an
    unreachable broker raised ``CancelledError`` into a service's shutdown (a traceback and exit 1 after SIGTERM,
    ``tests/test_stop_without_broker.py``). A cancellation of the caller itself still propagates."""
    try:
        await consumer.stop()
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():
            raise
        log.warning("a Kafka consumer stopped with its fetches to an unreachable broker cancelled")
