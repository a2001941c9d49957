"""The trainer, one room: the step (``step``: the reference trainer; ``objectives``; ``tensors``: the batch and its
micro-batches; ``models``: the GRU and HF kinds), its state on disk (``state``; checkpoints and LoRA are
``policy/``'s), its distribution over a torchrun group (``distributed``), and the Kafka task that drives it
(``task``). Arrows point from the task to the step, never back: only ``task`` imports ``streams``."""
