"""Subprocess for test_eos_hanging: ``python -m consumers serve verifier`` (unnamed: it takes a slot) whose first
transaction with scores leaves them hanging, as a broker that loses a committing transaction does
(``_hide_from_coordinator``, on a broker whose ``transaction.partition.verification.enable`` is off). Prints
``HUNG <json: scores partition -> last offset>`` once that commit returned and waits to be SIGKILLed.

    python tests/_hang_a_commit.py       (ROLLOUT_* settings from the environment)
"""

import asyncio
import json
import sys

from consumers.cli import main
from streams import topics
from streams.transactions import TransactionalProcessor
from tests.test_eos_hanging import _hide_from_coordinator

_send_and_commit = TransactionalProcessor._send_and_commit


async def hanging(self, prod, txn):
    scores = topics.SCORES.name
    if not any(o.topic == scores for out in txn.outputs.values() for o in out):
        return await _send_and_commit(self, prod, txn)
    _hide_from_coordinator(prod, {scores})
    await _send_and_commit(self, prod, txn)
    hung = {tp.partition: off for tp, (off, _) in self.commits.unconfirmed.items() if tp.topic == scores}
    print(f"HUNG {json.dumps(hung)}", flush=True)
    await asyncio.Event().wait()


TransactionalProcessor._send_and_commit = hanging
sys.exit(main(["serve", "verifier"]))
