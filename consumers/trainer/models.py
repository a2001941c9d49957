"""The two kinds of model the trainer steps: the tiny byte-level GRU of ``policy/`` (``.pt``) and a Hugging Face
causal LM (``policy.hf``: a ``model.safetensors`` folder). Each loads, saves, removes a checkpoint and computes
log-probabilities at the trained positions, cut into micro-batches its own way."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from schemas.policy import CheckpointRef
from consumers.trainer.tensors import TrainerTensors, padded_micro_batches


class TinyPolicy:
    """The byte-level GRU of ``policy/``: ``.pt`` checkpoints, served in float32."""

    @staticmethod
    def load(ref: CheckpointRef | str | Path) -> Any:
        from policy.checkpoint import load_checkpoint

        return load_checkpoint(ref)

    @staticmethod
    def weights(ref: CheckpointRef, *, verify: bool = True) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors as served (digest verified unless ``verify`` is off: HFPolicy.weights)."""
        return TinyPolicy.load(ref if verify else TinyPolicy.location(ref)).state_dict()

    @staticmethod
    def save(model: Any, directory: Path, family: str, revision: int, base: None = None) -> CheckpointRef:
        from policy.checkpoint import save_checkpoint

        return save_checkpoint(model, directory, family, revision)

    @staticmethod
    def location(ref: CheckpointRef) -> Path:
        """The checkpoint's file."""
        from policy.checkpoint import checkpoint_path

        return checkpoint_path(ref)

    @staticmethod
    def remove(ref: CheckpointRef) -> None:
        TinyPolicy.location(ref).unlink(missing_ok=True)

    @staticmethod
    def logprobs(model: Any, t: TrainerTensors, max_width: int | None = None) -> torch.Tensor:
        logits, _ = model(t.input_ids[:, :-1])  # a 256-token vocabulary: whole logits are small
        return torch.log_softmax(logits.float(), dim=-1).gather(2, t.input_ids[:, 1:].unsqueeze(2)).squeeze(2)

    @staticmethod
    def micro_batches(model: Any, t: TrainerTensors, budget: int) -> list[tuple[list[int], int]]:
        return padded_micro_batches(t, budget)


class HFPolicy:
    """A transformers causal LM (``policy.hf``): float32 weights trained with bf16 autocast on a GPU or a CPU with
    native bf16 (``policy.hf.cpu_bf16``), float32 elsewhere; ``model.safetensors`` folders served in that dtype
    (``policy.hf.served_dtype``)."""

    @staticmethod
    def load(ref: CheckpointRef | str | Path) -> Any:
        from policy.hf import load_model

        return load_model(ref)

    @staticmethod
    def weights(ref: CheckpointRef, *, verify: bool = True) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors as served, under the model's names (an adapter's: the injected adapters' names,
        ``policy.lora.model_names``), its digest verified unless ``verify`` is off: for a file the trainer wrote and
        hashed as it wrote it (a 513 MB float32 model's sha256 is 0.4 s of the mismatch probe, every step)."""
        from policy.checkpoint import checkpoint_path
        from policy.hf import load_weights
        from policy.lora import model_names

        weights = load_weights(ref if verify else checkpoint_path(ref))
        return model_names(weights) if ref.adapter else weights

    @staticmethod
    def save(model: Any, directory: Path, family: str, revision: int, base: CheckpointRef | None = None
             ) -> CheckpointRef:
        """``base``: the LoRA adapter alone, over that base checkpoint (``policy.hf.save_checkpoint``)."""
        from policy.hf import save_checkpoint

        return save_checkpoint(model, directory, family, revision, base=base)

    @staticmethod
    def location(ref: CheckpointRef) -> Path:
        """The checkpoint's folder (what vLLM loads)."""
        from policy.hf import checkpoint_folder

        return checkpoint_folder(ref)

    @staticmethod
    def remove(ref: CheckpointRef) -> None:
        shutil.rmtree(HFPolicy.location(ref), ignore_errors=True)  # the revision's folder

    @staticmethod
    def logprobs(model: Any, t: TrainerTensors, max_width: int | None = None) -> torch.Tensor:
        """At the trained positions only (``policy.hf.token_logprobs``: no whole-vocabulary tensor per token), a
        prompt shared by several rows run once (in packed rows of at most ``max_width`` tokens)."""
        from policy.hf import token_logprobs

        return token_logprobs(model, t.input_ids, t.attention_mask.long(), wanted=t.wanted,
                              prompt_lens=t.prompt_lens, seq_lens=t.seq_lens, max_width=max_width)

    @staticmethod
    def micro_batches(model: Any, t: TrainerTensors, budget: int) -> list[tuple[list[int], int]]:
        """A group's rows in one micro-batch, where its prompt runs once (``policy.shared_prefix``)."""
        from policy import shared_prefix
        from policy.hf import shares_prompts

        if not shares_prompts(model):
            return padded_micro_batches(t, budget)
        return shared_prefix.micro_batches(t.input_ids.cpu(), t.wanted.cpu(), t.prompt_lens.cpu(),
                                           t.seq_lens.cpu(), budget)


def policy_kind(ref: CheckpointRef | str | Path) -> type[TinyPolicy] | type[HFPolicy]:
    """What a checkpoint holds, from its file: ``.safetensors`` is an HF model, anything else the tiny GRU."""
    from policy.hf import is_hf_checkpoint

    return HFPolicy if is_hf_checkpoint(ref) else TinyPolicy
