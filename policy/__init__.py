"""The small local torch language model and its checkpoints.

Used by the producers' local policy server (``producers.inference.policy_server``) and the consumers'
reference trainer. Depends on ``schemas`` only.

    from policy import ByteTokenizer, PolicyModel, generate, token_logprobs, save_checkpoint, load_checkpoint
"""

from schemas._lazy import exports

# Imported on first use (torch): ``policy.hf.model_dir()`` or a ``policy.tokenizer`` constant do not load the model.
_WHERE = {
    **dict.fromkeys(("load_checkpoint", "save_checkpoint"), "policy.checkpoint"),
    **dict.fromkeys(("ModelConfig", "PolicyModel", "generate", "generate_batch", "token_logprobs"), "policy.model"),
    **dict.fromkeys(("ByteTokenizer", "TOKENIZER"), "policy.tokenizer"),
}
__all__ = sorted(_WHERE)
__getattr__ = exports(__name__, _WHERE)
