"""LoRA adapters (peft) injected into an HF causal LM in place, for recipes with ``[trainer.model.lora]``.

Injected rather than wrapped (``peft.inject_adapter_in_model``): the model keeps its class and attribute paths, so
the trainer's chunked head (``policy.hf.token_logprobs`` reads ``model.model`` and ``model.lm_head``), the training
state and the take-over work as for full training. Only the adapters train. A revision is served one of two ways
(``schemas.plan.LoraSpec.serving``):

* ``adapter`` (prime-rl's): the adapter alone, a PEFT folder (``adapter_config.json`` and
  ``adapter_model.safetensors`` under peft's own names, ``peft_state``) that vLLM loads over its base model. The
  file's metadata names that base (its checkpoint's uri and digest, ``base_of``), so the adapter's digest covers
  which weights it applies to;
* ``merged``: base + scale B A under the model's own names (``served_state``), reloaded as any other revision.
"""

from __future__ import annotations

from typing import Any

from schemas.plan import LoraSpec
from schemas.policy import CheckpointRef

ADAPTER = "default"  # peft's name for the one adapter
PEFT_PREFIX = "base_model.model."  # what peft's saved adapters put before the model's own names (PeftModel's path)


def targets_present(model: Any, spec: LoraSpec) -> list[str]:
    """The spec's target module names that this model has (prime-rl's defaults cover several architectures;
    names a model lacks are left out, as prime-rl does)."""
    leaves = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    found = [t for t in spec.target_modules if t in leaves]
    if not found:
        raise ValueError(f"none of the LoRA target modules {spec.target_modules} is in this model "
                         f"({type(model).__name__}); set [trainer.model.lora] target_modules to its module names")
    return found


INIT_SEED = 0  # the adapters' initial draw (``inject``)


def inject(model: Any, spec: LoraSpec) -> Any:
    """``model`` with LoRA adapters (rank, alpha, dropout) on the spec's target modules, every other weight frozen.
    A model loaded from an adapter checkpoint (``load_adapter``) keeps its adapter, which must be the spec's."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                        target_modules=targets_present(model, spec))
    if has_adapters(model):
        held = model.peft_config[ADAPTER]
        if (held.r, float(held.lora_alpha), set(held.target_modules)) != \
                (config.r, float(config.lora_alpha), set(config.target_modules)):
            raise ValueError(f"the checkpoint's adapter (rank {held.r}, alpha {held.lora_alpha}, on "
                             f"{sorted(held.target_modules)}) is not the plan's (rank {spec.rank}, alpha {spec.alpha}, "
                             f"on {sorted(config.target_modules)})")
        held.lora_dropout = spec.dropout  # how it trains, not what it serves
    else:
        import torch

        # lora_A is drawn at random (lora_B starts at zero): from a fixed seed, so a trainer that takes over before
        # any training state was written draws the adapter its predecessor trained from, not a new one
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(INIT_SEED)
            inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    model.enable_input_require_grads()  # gradient checkpointing over frozen embeddings still reaches the adapters
    return model


def has_adapters(model: Any) -> bool:
    return bool(getattr(model, "peft_config", None))  # what ``inject_adapter_in_model`` leaves on the model


def _layers(model: Any) -> list[tuple[str, Any]]:
    from peft.tuners.lora import LoraLayer

    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]


def served_state(model: Any) -> dict[str, Any]:
    """The model's weights as served merged: under its own names, each adapted layer's weight merged (W + scale B A)
    without touching the base weight in place (merging and unmerging would round it). A model without adapters:
    its ``state_dict``."""
    state = model.state_dict()
    if not any("lora_" in k for k in state):
        return state
    layers = _layers(model)
    import torch

    out: dict[str, Any] = {}
    with torch.no_grad():
        for name, layer in layers:
            base = layer.get_base_layer()
            out[f"{name}.weight"] = base.weight + layer.get_delta_weight(ADAPTER).to(base.weight.dtype)
            if getattr(base, "bias", None) is not None:
                out[f"{name}.bias"] = base.bias
    for key, value in state.items():
        if "lora_" in key:
            continue
        out.setdefault(key.replace(".base_layer.", "."), value)
    return out


def merged_model(model: Any) -> Any:
    """A plain model (no adapter layers) holding ``model``'s merged weights: an adapter checkpoint trained on
    without LoRA (a derived run whose plan trains every weight)."""
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_config(model.config, dtype=next(model.parameters()).dtype)
    plain.load_state_dict(served_state(model), strict=False)
    plain.tie_weights()
    return plain.eval()


def adapter_state(model: Any) -> dict[str, Any]:
    """The adapters' own tensors (what trains), under the model's names."""
    return {k: v for k, v in model.state_dict().items() if "lora_" in k}


def peft_state(model: Any) -> dict[str, Any]:
    """The adapters' tensors under the names peft saves them by (``PeftModel.save_pretrained``: the adapter's name
    left out, ``PEFT_PREFIX`` before the model's path), which vLLM and ``PeftModel.from_pretrained`` read."""
    from peft import get_peft_model_state_dict

    return {PEFT_PREFIX + k: v for k, v in get_peft_model_state_dict(model, adapter_name=ADAPTER).items()}


def model_names(peft: dict[str, Any]) -> dict[str, Any]:
    """An adapter file's tensors (``peft_state``) under the injected model's names (``adapter_state``)."""
    out = {}
    for key, value in peft.items():
        owner, part, leaf = key.removeprefix(PEFT_PREFIX).rsplit(".", 2)
        out[f"{owner}.{part}.{ADAPTER}.{leaf}"] = value
    return out


def save_config(model: Any, folder: Any, base: str) -> None:
    """``adapter_config.json`` of the model's adapter, written by peft itself; ``base``: its base model's folder."""
    import copy

    config = copy.copy(model.peft_config[ADAPTER])
    config.target_modules = sorted(config.target_modules)  # a set: sorted, so the same adapter writes the same file
    config.base_model_name_or_path, config.task_type, config.inference_mode = base, "CAUSAL_LM", True
    config.save_pretrained(str(folder))


def base_of(ref: CheckpointRef) -> CheckpointRef:
    """The base model checkpoint an adapter checkpoint applies to, as its file's metadata names it."""
    from safetensors import safe_open

    from policy.checkpoint import checkpoint_path

    with safe_open(str(checkpoint_path(ref)), framework="pt") as f:
        meta = f.metadata() or {}
    if "base_uri" not in meta:
        raise ValueError(f"{checkpoint_path(ref)} names no base model: not an adapter checkpoint written here")
    return CheckpointRef(uri=meta["base_uri"], digest=meta["base_digest"])


def load_adapter(model: Any, folder: Any, tensors: dict[str, Any]) -> Any:
    """``model`` (the base) with the adapter of a PEFT ``folder`` injected, holding ``tensors`` (its file's, digest
    checked by the caller)."""
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict

    config = LoraConfig.from_pretrained(str(folder))
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    loaded = set_peft_model_state_dict(model, {k.removeprefix(PEFT_PREFIX): v for k, v in tensors.items()},
                                       adapter_name=ADAPTER)
    if getattr(loaded, "unexpected_keys", None):
        raise ValueError(f"adapter {folder} does not fit the model: unexpected {loaded.unexpected_keys[:5]}")
    return model


def served_tensors(model: Any, served: dict[str, Any]) -> dict[str, Any]:
    """What ``model`` holds to serve exactly ``served``, a checkpoint's tensors, by the model's state names: an
    adapter alone (``model_names``) in the adapters; merged weights in the base layers, with the adapters' B at
    zero (so they add nothing)."""
    import torch

    state = model.state_dict()
    if any("lora_" in k for k in served):
        missing = [k for k in served if k not in state]
        if missing:
            raise ValueError(f"the adapter does not fit the model: {missing[:5]}")
        return dict(served)
    layers = dict(_layers(model)) if has_adapters(model) else {}
    held = {f"{name}.lora_B.{ADAPTER}.weight": torch.zeros_like(layer.lora_B[ADAPTER].weight)
            for name, layer in layers.items()}
    for key, value in served.items():
        owner = key.rsplit(".", 1)[0]
        target = key.replace(owner, f"{owner}.base_layer", 1) if owner in layers else key
        if target in state:
            held[target] = value
    return held


def load_served(model: Any, served: dict[str, Any]) -> None:
    """Make ``model`` serve exactly ``served`` (``served_tensors``): a take-over whose re-training did not reproduce
    the served weights bit for bit takes them (merged ones: the adapters start again from zero)."""
    import torch

    with torch.no_grad():
        state = model.state_dict()
        for key, value in served_tensors(model, served).items():
            state[key].copy_(value.to(state[key].dtype))
