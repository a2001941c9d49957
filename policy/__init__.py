"""The small local torch language model and its checkpoints.

Used by the producers' local policy server (``producers.policy_server``) and the consumers'
reference trainer. Depends on ``schemas`` only.

    from policy import ByteTokenizer, PolicyModel, generate, token_logprobs, save_checkpoint, load_checkpoint
"""

from policy.checkpoint import load_checkpoint, save_checkpoint
from policy.model import ModelConfig, PolicyModel, generate, generate_batch, token_logprobs
from policy.tokenizer import ByteTokenizer, TOKENIZER

__all__ = ["ByteTokenizer", "ModelConfig", "PolicyModel", "TOKENIZER", "generate", "generate_batch",
           "load_checkpoint", "save_checkpoint", "token_logprobs"]
