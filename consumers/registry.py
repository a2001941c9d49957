"""Every service of the pipeline, in pipeline order (the reference service, between the verifier and credit, last):
the one place a service is declared.

To add a service over existing topics: write its task module (a partition task and a ``wiring``, see
``consumers/tasks/``) and add one ``Service`` here. ``rollout serve``, ``rollout status``, the AsyncAPI
document, the demo and the compose test all read this table.
"""

from __future__ import annotations

from consumers.service import Service
from streams import topics

SERVICES: dict[str, Service] = {s.name: s for s in (
    Service("verifier", "score Rollouts (with their Steps) -> RolloutScored, exactly-once",
            inputs=(topics.STEPS, topics.ROLLOUTS), outputs=(topics.SCORES, topics.DEAD_LETTERS),
            wiring="consumers.tasks.verifier:wiring", options=("step_timeout_s",)),
    Service("credit", "credit assignment: RolloutScored (RolloutReferenced for ref_kl sources) -> TrainingRecords "
                      "with the plan's credit strategy",
            inputs=(topics.SCORES, topics.REFERENCED), outputs=(topics.TRAINING_RECORDS, topics.ADMISSIONS, topics.DEAD_LETTERS),
            wiring="consumers.tasks.credit:wiring", options=("credit", "alpha", "group_timeout_s"),
            runs_algorithm=True),
    Service("batcher", "TrainingRecords -> lineage-stamped TrainerBatches with an off-policy bound",
            inputs=(topics.TRAINING_RECORDS,), outputs=(topics.TRAINER_BATCHES, topics.ADMISSIONS, topics.DEAD_LETTERS),
            wiring="consumers.tasks.batcher:wiring",
            side_inputs=(topics.POLICY_REVISIONS, topics.ADMISSIONS, topics.DEAD_LETTERS),  # the last: DroppedBatches
            options=("family", "max_off_policy_steps", "batch_records", "batch_tokens", "flush_after_s",
                     "group_timeout_s")),
    Service("trainer", "reference trainer: TrainerBatches -> a step of the plan's objective -> PolicyRevision",
            inputs=(topics.TRAINER_BATCHES,), outputs=(topics.POLICY_REVISIONS, topics.DEAD_LETTERS),
            wiring="consumers.trainer.task:wiring", side_inputs=(topics.POLICY_REVISIONS,),
            options=("family", "checkpoint_dir", "keep_checkpoints", "lr", "weight_decay", "served_model", "epochs",
                     "state_every", "micro_batch_tokens", "max_steps", "lora"),
            runs_algorithm=True, max_process_s=3600.0, data_parallel=True),
    # between the verifier and credit in the pipeline; listed last, so the others keep their metrics ports
    Service("reference", "a ref_kl source's scores (prime-rl's opd and opsd) -> RolloutReferenced: the reference's "
                         "logprob of every trainable token, by prefill",
            inputs=(topics.SCORES,), outputs=(topics.REFERENCED, topics.DEAD_LETTERS),
            wiring="consumers.tasks.reference:wiring", options=("policy_url",), max_process_s=300.0,
            runs_when="needs_reference"),
)}
