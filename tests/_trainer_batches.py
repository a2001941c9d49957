"""What the trainer tests share: a batch of records, a record whose behaviour logprobs are a model's own, an input
record as aiokafka hands it to the trainer task."""

from __future__ import annotations

import json

import numpy as np
import torch

from consumers import testing
from policy.model import token_logprobs
from schemas.batch import assemble_batch
from schemas.events import TrainingRecord
from schemas.policy import PolicyRef

HF_FAMILY = "org/tiny-byte-lm"


def batch_of(records, rev=None):
    return assemble_batch(records, rev or testing.revision(0), 1, run_id="run", producer="t")


def record(i, model, prompt, completion, adv, rev=0):
    with torch.no_grad():
        lp = token_logprobs(model, prompt, completion).numpy().astype(np.float32)
    n = len(completion)
    return TrainingRecord(run_id="run", producer="t", record_id=f"r{i:04d}", rollout_id=f"ro{i}", step_ids=["s"],
                          member_id="solver", group_id="g", environment="arith@1",
                          policy=PolicyRef(family="tiny", revision=rev), prompt_token_ids=np.array(prompt, np.int32),
                          completion_token_ids=np.array(completion, np.int32), completion_logprobs=lp,
                          loss_mask=np.ones(n, np.uint8), reward=float(adv > 0), advantage=adv, credit="grpo")



class BatchRec:
    topic, partition, headers = "tb", 0, []

    def __init__(self, offset, value, key=HF_FAMILY.encode()):
        self.offset, self.value, self.key = offset, value, key


def json_roundtrip(state):
    return json.loads(json.dumps(state))
