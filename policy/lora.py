"""LoRA adapters (peft) injected into an HF causal LM in place, for recipes with ``[trainer.model.lora]``.

Injected rather than wrapped (``peft.inject_adapter_in_model``): the model keeps its class and attribute paths, so
the trainer's chunked head (``policy.hf.token_logprobs`` reads ``model.model`` and ``model.lm_head``), the training
state and the take-over work as for full training. Only the adapters train; what is served is the merged weights
under the model's own names (``served_state``), so vLLM reloads a revision as it reloads any other.
"""

from __future__ import annotations

from typing import Any

from schemas.plan import LoraSpec

ADAPTER = "default"  # peft's name for the one adapter


def targets_present(model: Any, spec: LoraSpec) -> list[str]:
    """The spec's target module names that this model has (prime-rl's defaults cover several architectures;
    names a model lacks are left out, as prime-rl does)."""
    leaves = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    found = [t for t in spec.target_modules if t in leaves]
    if not found:
        raise ValueError(f"none of the LoRA target modules {spec.target_modules} is in this model "
                         f"({type(model).__name__}); set [trainer.model.lora] target_modules to its module names")
    return found


def inject(model: Any, spec: LoraSpec) -> Any:
    """``model`` with LoRA adapters (rank, alpha, dropout) on the spec's target modules, every other weight frozen."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                        target_modules=targets_present(model, spec))
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    model.enable_input_require_grads()  # gradient checkpointing over frozen embeddings still reaches the adapters
    return model


def _layers(model: Any) -> list[tuple[str, Any]]:
    from peft.tuners.lora import LoraLayer

    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]


def served_state(model: Any) -> dict[str, Any]:
    """The model's weights as served: under its own names, each adapted layer's weight merged (W + scale B A)
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


def adapter_state(model: Any) -> dict[str, Any]:
    """The adapters' own tensors (what trains)."""
    return {k: v for k, v in model.state_dict().items() if "lora_" in k}


def load_served(model: Any, served: dict[str, Any]) -> None:
    """Make ``model`` serve exactly ``served`` (a take-over whose re-training did not reproduce the committed
    weights bit for bit): the base weights become the served ones and the adapters start again from zero."""
    import torch

    layers = dict(_layers(model))
    with torch.no_grad():
        for name, layer in layers.items():
            layer.lora_B[ADAPTER].weight.zero_()
        state = model.state_dict()
        for key, value in served.items():
            owner = key.rsplit(".", 1)[0]
            target = key.replace(owner, f"{owner}.base_layer", 1) if owner in layers else key
            if target in state:
                state[target].copy_(value.to(state[target].dtype))
