"""vLLM's worker, extended with the weight reload the arena calls (``--worker-extension-cls``, which
``producers.inference.vllm_server.VllmServer`` passes): vLLM's own reload, then the LM head's kernel state rebuilt from the
weights it now holds.

Why: on a CPU, vLLM's unquantized LM head (``UnquantizedEmbeddingMethod.process_weights_after_loading`` ->
``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``) computes logits from a copy of its weight that
oneDNN (or the AMX kernel) packed when the layer was processed, not from ``lm_head.weight``. vLLM's in-place reload
(``model_loader.reload.layerwise``) processes a layer again only when the checkpoint holds its weights. A tied head
(SmolLM2's ``lm_head`` is ``embed_tokens``: ``ParallelLMHead.tie_weights``; ``LlamaForCausalLM`` skips
``lm_head.weight``, and our checkpoints leave it out) loads none, so vLLM logs ``ParallelLMHead: Failed to load
weights``, puts the shared tensor back (the new embeddings) and keeps the packed copy of the weights the server
started with: every later revision was served with revision 0's head. Packing the head again from its current
weight costs one pack of a 49k x 576 matrix (well under a second on 2 cores) and is a no-op off the CPU.

    POST /collective_rpc {"method": "reload_policy_weights", "kwargs": {"weights_path": DIR}}
"""

from __future__ import annotations

from typing import Any


class PolicyWeightsExtension:
    """Mixed into vLLM's worker class by vLLM itself (so no name here may be one of the worker's)."""

    def reload_policy_weights(self: Any, weights_path: str) -> None:
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod

        self.reload_weights(weights_path=weights_path)
        for module in self.get_model().modules():
            # an unquantized head only: its processing just derives kernel state from the weight, so it can run again
            if isinstance(module, ParallelLMHead) and isinstance(module.quant_method, UnquantizedEmbeddingMethod):
                module.quant_method.process_weights_after_loading(module)
