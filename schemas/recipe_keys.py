"""The one table of recipe keys outside the generation plan: which ones leave what a run learns unchanged
(deployment, hardware, logging, the trainer's parallelism), which ones we apply, and which ones change the
run without anything here applying them (those are refused when a run starts: nothing falls back silently).

Paths are as prime-rl writes them in an ``rl`` file; an orchestrator-only file's keys are matched with the
``orchestrator.`` prefix added. A table is judged by its longest listed prefix, leaf by leaf.
"""

from __future__ import annotations

from typing import Any

# Keys and tables that do not change what is sampled, scored or learned here: where and how prime-rl's
# processes run. Shown by ``rollout plan`` as not applicable.
NEUTRAL: dict[str, str] = {
    "deployment": "GPU placement", "inference": "prime-rl's inference server settings", "slurm": "cluster jobs",
    "weight_broadcast": "weight transfer", "ckpt": "checkpoint cadence", "log": "logging", "monitors": "metrics",
    "wandb": "metrics", "env_vars": "process environment", "output_dir": "output folder", "clean": "output folder",
    "resume": "resume from prime-rl's checkpoints", "heartbeat": "monitoring", "run": "launcher",
    "model.compile": "torch.compile",
    "orchestrator.renderer": "prime-rl's chat renderer (vLLM applies the model's chat template here)",
    "orchestrator.tokenizer": "the tokenizer is the served model's", "orchestrator.log": "logging",
    "orchestrator.monitors": "metrics", "orchestrator.ckpt": "checkpoint cadence", "orchestrator.resume": "resume",
    "orchestrator.weight_broadcast": "weight transfer", "orchestrator.rollout_transport": "transport",
    "orchestrator.output_dir": "output folder", "orchestrator.env_server_base_port": "env-server ports",
    "orchestrator.collect_inference_metrics": "metrics", "orchestrator.inference_metrics_roles": "metrics",
    "orchestrator.heartbeat": "monitoring", "orchestrator.client.max_connections": "connection pool size",
    "orchestrator.model.client.max_connections": "connection pool size", "orchestrator.num_train_workers": "trainer topology",
    "orchestrator.pad_to_multiple_of": "trainer packing", "orchestrator.env_vars": "process environment",
    "orchestrator.max_inflight_rollouts": "in-flight limit (the arena's --concurrency)",
    "orchestrator.tasks_per_minute": "rate limit", "orchestrator.dump_trajectory": "debug dumps (the log keeps all)",
    "orchestrator.save_full_rollouts": "debug dumps (the log keeps all)",
    "orchestrator.dump_failed_train_rollouts": "debug dumps (the log keeps all)",
    "orchestrator.dump_failed_train_trajectory": "debug dumps (the log keeps all)",
    "orchestrator.train.num_workers": "env-server workers", "orchestrator.eval.num_workers": "env-server workers",
    "orchestrator.eval.retrigger_on_resume": "resume", "orchestrator.seq_len": "packing length (see seq_len)",
    "trainer.model.impl": "kernel choice", "trainer.model.attn": "attention kernel", "trainer.model.compile": "compile",
    "trainer.model.ac": "activation checkpointing", "trainer.model.ac_offloading": "activation offloading",
    "trainer.model.cp": "context parallelism", "trainer.model.cp_style": "context parallelism",
    "trainer.model.ep": "expert parallelism", "trainer.model.fsdp_cpu_offload": "offloading",
    "trainer.model.full_offload": "offloading", "trainer.model.optim_cpu_offload": "offloading",
    "trainer.model.fused_lm_head_token_chunk_size": "kernel chunking", "trainer.model.seq_len": "packing length",
    "model.seq_len": "the trainer's packing length", "trainer.model.name": "the trainer's model is the plan's family",
    "trainer.dist_timeout_seconds": "distributed",
    "trainer.ckpt": "checkpoint cadence", "trainer.enable_token_export": "debug export",
    "trainer.pack_samples": "packing", "trainer.enable_router_replay": "MoE router replay (no MoE model here)",
    "trainer.log": "logging",
    "orchestrator.train.filter_zero_advantages": "zero-advantage samples carry no policy gradient here either",
    "trainer.monitors": "metrics",
}

# Keys read by the plan compiler outside the orchestrator's generation part (GenerationPlan fields).
APPLIED = frozenset({"max_steps", "trainer.loss", "orchestrator.max_steps", "seq_len", "trainer.optim.lr",
                     "trainer.optim.type", "trainer.optim.weight_decay", "trainer.optim.betas1", "trainer.optim.betas2",
                     "trainer.optim.mu", "trainer.optim.max_norm", "orchestrator.eval.skip_first_step",
                     "trainer.model.lora.rank", "trainer.model.lora.alpha", "trainer.model.lora.dropout",
                     "trainer.model.lora.target_modules", "orchestrator.model.lora.rank",
                     "orchestrator.model.lora.alpha", "orchestrator.model.lora.name"})

# Known run-changing keys, with what is missing here to honour them.
REASONS: dict[str, str] = {
    "trainer.model.lora.modules_to_save": "fully trained modules beside LoRA: the reference trainer freezes every "
                                          "weight but the adapters",
    "trainer.model.quantization": "quantized training: the reference trainer keeps fp32 weights (bf16 autocast "
                                  "where the device has native bf16)",
    "trainer.model.reduce_dtype": "a reduction dtype: the reference trainer keeps fp32 weights and gradients (bf16 "
                                  "autocast where the device has native bf16)",
    "trainer.model.optimization_dtype": "an optimizer dtype: the reference trainer keeps fp32 optimizer state",
    "trainer.optim": "optimizer settings other than its type, lr, weight_decay, betas, mu and max_norm",
    "trainer.scheduler": "a learning-rate schedule: the reference trainer uses a constant rate",
    "model.vlm": "a vision-language model: nothing here serves or trains images",
    "orchestrator.oversampling_factor": "oversampling: the arena generates exactly the batch it admits",
    "orchestrator.buffer": "difficulty filtering of the buffer",
    "orchestrator.val": "a validation split run on its own cadence",
    "orchestrator.training_mode": "the fork's training mode switch",
    "orchestrator.target_lag": "the fork's lag target (max_off_policy_steps bounds staleness here)",
    "orchestrator.train.sampler": "a task sampler other than the standard one",
    "orchestrator.train.curriculum": "a curriculum (sampler pools or admission gates)",
}


def _longest(path: str, table: dict[str, Any] | frozenset[str]) -> str | None:
    parts = path.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in table:
            return prefix
    return None


def refusals(path: str, value: Any, *, orchestrator_scope: bool = False) -> list[str]:
    """``"key: why"`` for every leaf under ``path`` that changes the run and is not applied; [] when the whole
    key or table is neutral or applied. ``orchestrator_scope``: the path is relative to an orchestrator-only
    file's top level."""
    full = f"orchestrator.{path}" if orchestrator_scope else path
    if _longest(full, NEUTRAL) or full in APPLIED or value == {}:  # an empty table asks for defaults only
        return []
    if isinstance(value, dict) and value:
        return [r for k, v in value.items() for r in refusals(f"{path}.{k}", v, orchestrator_scope=orchestrator_scope)]
    known = _longest(full, REASONS)
    return [f"{path}: {REASONS[known] if known else 'not applied by rollout-log'}"]


def neutral_reason(path: str, *, orchestrator_scope: bool = False) -> str | None:
    """Why a key leaves the run unchanged (None when it is not a neutral key)."""
    full = f"orchestrator.{path}" if orchestrator_scope else path
    found = _longest(full, NEUTRAL)
    return NEUTRAL[found] if found else None
