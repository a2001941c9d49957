"""Which weights serve a plan's family on this machine, decided once per run and said out loud.

    served = served_model(plan.family, args.model)    # args.model: None, "packaged" or an HF folder
    plan = plan.model_copy(update={"served_model": served.note})

* the family's own model: the packaged SmolLM2-135M-Instruct (named ``SmolLM2-135M-Instruct`` or as Hugging Face
  names it, ``HuggingFaceTB/SmolLM2-135M-Instruct``), or the tiny byte-level model;
* ``--model PATH``: an HF folder (``config.json`` + ``model.safetensors``) holds the weights;
* ``--model packaged``: the packaged SmolLM2 stands in for a recipe's model that cannot be served here (no model
  hub can be reached). The note goes into the plan, the demo's summary and every PolicyRevision
  (``served_model``), so no result is mistaken for the recipe's own model.

Without ``--model``, a family that is none of these is refused with what to pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from policy import hf
from schemas.policy import TINY_FAMILY, CheckpointRef

PACKAGED = "packaged"
PACKAGED_NAMES = frozenset({hf.FAMILY, f"HuggingFaceTB/{hf.FAMILY}"})


@dataclass(frozen=True)
class ServedModel:
    path: Path | None         # the HF folder vLLM and the trainer load; None: the tiny model (seeded init)
    note: str | None = None   # what stands for the family, when not its own weights

    def checkpoint(self) -> CheckpointRef | None:
        """Revision 0's checkpoint: the folder's ``model.safetensors`` and its digest."""
        if self.path is None:
            return None
        if self.path.resolve() == hf.model_dir().resolve():
            return hf.prepare_model().checkpoint
        from policy.checkpoint import file_sha256

        weights = self.path / hf.WEIGHTS
        return CheckpointRef(uri=weights.resolve().as_uri(), digest=file_sha256(weights))


def served_model(family: str, model: str | None = None) -> ServedModel:
    """The weights for ``family`` (see the module docstring); ``hf.ModelUnavailable`` says what to pass."""
    if model is None:
        if family == TINY_FAMILY:
            return ServedModel(None)
        if family in PACKAGED_NAMES:
            return ServedModel(hf.prepare_model().path)
        raise hf.ModelUnavailable(
            f"the recipe's model {family!r} cannot be served here (no model hub can be reached): pass --model "
            f"{PACKAGED} to run the packaged {hf.FAMILY} in its place (the plan, the summary and every revision say "
            "so), or --model /path/to/hf-folder holding its weights")
    if model == PACKAGED:
        note = None if family in PACKAGED_NAMES else \
            f"{hf.FAMILY} (packaged, {hf.MODEL_PIP}) standing in for {family}"
        return ServedModel(hf.prepare_model().path, note)
    path = Path(model).expanduser()
    missing = [f for f in ("config.json", hf.WEIGHTS) if not (path / f).is_file()]
    if missing:
        raise hf.ModelUnavailable(f"--model {model}: not an HF model folder (missing {', '.join(missing)}); "
                                  f"pass a folder saved by transformers' save_pretrained, or --model {PACKAGED}")
    return ServedModel(path, f"the HF folder {path.resolve()} serving {family}")
