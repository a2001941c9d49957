"""The trainer on ``torch.distributed``: FSDP2 data parallelism, launched with ``torchrun``.

    torchrun --nproc-per-node 2 --max-restarts 3 -m consumers serve trainer --family F --checkpoint-dir D

Rank 0 is the service: it alone owns the Kafka consumer, the transaction and the revision it publishes. The
other ranks never touch Kafka: they follow rank 0 in lockstep (``Lockstep``). Every call rank 0 makes on its
trainer (open it on a checkpoint, load the training state, train a batch, publish) is first broadcast on a
gloo control group, then made on every rank, so the collectives inside each call (FSDP2's all-gathers and
reduce-scatters, the full state gathered for a checkpoint) line up. Each rank trains its contiguous share of
the batch's rows; the loss is normalised by the whole batch's token count, so the step equals the
single-process trainer's on the same batch (to float rounding: ``tests/test_distributed_trainer.py``).

Failure is the group's: when any rank dies, torchrun's agent stops the others and starts the whole group
again (``--max-restarts``). Rank 0's open transaction is aborted by its successor (same transactional id), and
the new group takes over from the changelog and the last committed revision's training state, so no batch is
trained twice and no revision is skipped. Every rank reads checkpoints from the same path: on several nodes
the checkpoint directory is a shared volume.

The model is sharded with FSDP2 (``fully_shard``): it runs on CPU with gloo (checked on torch 2.13), so the
same code path is tested here that a GPU group runs with NCCL.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("rollout.trainer")

CONTROL_TIMEOUT = timedelta(days=7)
"""How long the followers wait for rank 0's next call: a trainer waits for batches as long as there are none.
A dead rank 0 does not leave them waiting: torchrun stops the group when any rank exits."""


@dataclass
class Group:
    """This process's place in the trainer's process group."""

    rank: int
    world: int
    control: Any  # a gloo group: calls are broadcast on it whatever the compute backend

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def agree(self, value: Any = None) -> Any:
        """Rank 0's ``value`` on every rank."""
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def rows(self, n: int) -> slice:
        """This rank's contiguous share of ``n`` rows (the last ranks' shares may be shorter or empty)."""
        share = -(-n // self.world)
        return slice(min(n, self.rank * share), min(n, (self.rank + 1) * share))

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t


_GROUP: Group | None = None


def current() -> Group | None:
    """The group this process trains in (``launch``), or None when it trains alone."""
    return _GROUP


def world_size() -> int:
    """How many processes torchrun started for this trainer (1 when not under torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launch() -> Group:
    """Join the group torchrun set up (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment): NCCL on GPUs, gloo
    on CPUs, and a gloo control group for the calls rank 0 broadcasts."""
    global _GROUP
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(device())
    # the store's keys of this attempt only: a group torchrun restarted read a dead rank's address left in its
    # store by the attempt before, and could not connect (seen in 3 of 4 restarts on torch 2.13)
    from torch.distributed.rendezvous import rendezvous

    store, rank, world = next(rendezvous("env://"))
    store = dist.PrefixStore(f"rollout/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)
    # the collectives of a step keep the default timeout: it bounds how long a wedged rank holds the others
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    _GROUP = Group(dist.get_rank(), dist.get_world_size(), control)
    log.info("joined the trainer group", extra={"fields": {"service": "trainer", "rank": _GROUP.rank,
                                                           "world": _GROUP.world, "backend": backend}})
    return _GROUP


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2: each transformer block its own unit (its parameters gathered only while it runs), then the rest
    (embeddings, the tied head, norms) at the root; a model without blocks (the tiny GRU) is one unit."""
    from torch.distributed.fsdp import fully_shard

    for block in getattr(getattr(model, "model", None), "layers", ()):
        fully_shard(block)
    fully_shard(model)
    return model


def device() -> torch.device:
    """This rank's device: its GPU (torchrun's LOCAL_RANK) where there are GPUs, else the CPU."""
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() \
        else torch.device("cpu")


def full_state(model: torch.nn.Module, group: Group | None) -> dict[str, torch.Tensor]:
    """The model's whole state on rank 0 (gathered from every rank's shards; empty on the others), on the CPU."""
    if group is None:
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def local_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's weights and optimizer state by name: the tensors themselves, not copies."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}


def _one_process() -> bool:
    """No process group: torch.distributed.checkpoint's ``no_dist``. Its warning then ("torch.distributed is
    disabled", on a process's first save and first load, though one process is what is meant: a line on every demo's
    stderr that newcomers read as a fault) is silenced, here rather than at import (pytest resets filters set
    while it collects)."""
    if dist.is_initialized():
        return False
    warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
    return True


def save_sharded(state: dict[str, Any], path: Path, tmp: Path, *, writer: bool) -> None:
    """A model's and optimizer's ``local_state`` as a torch.distributed.checkpoint folder: each rank writes its own
    shards into ``tmp`` (collective in a group; one name for the group, the writer's process id in it, so a fenced trainer
    and its successor never write into one folder). ``writer`` (rank 0, or the only process) flushes it to the disk
    and moves it in whole."""
    import torch.distributed.checkpoint as dcp

    from policy.checkpoint import fsync_dir, fsync_tree

    if writer:  # before the save's first collective: no rank writes a shard into it until then
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        dcp.save(state, checkpoint_id=tmp, no_dist=_one_process())
        if writer:
            fsync_tree(tmp)
            shutil.rmtree(path, ignore_errors=True)
            os.replace(tmp, path)
            fsync_dir(path.parent)
    except BaseException:
        if writer:  # a full disk: the part written is freed, not left beside the checkpoints
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_sharded(model: torch.nn.Module, opt: torch.optim.Optimizer, path: Path) -> None:
    """``save_sharded``'s folder into this rank's shards, whatever the number of ranks that wrote it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = local_state(model, opt)
    dcp.load(state, checkpoint_id=path, no_dist=_one_process())
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optimizer"])


def read_sharded(path: Path) -> dict[str, Any]:
    """A ``save_sharded`` folder read whole in one process (tools, tests): ``{"model": ..., "optimizer": ...}``."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    _one_process()
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path, Path(tmp, "state.pt"))
        return torch.load(Path(tmp, "state.pt"), map_location="cpu", weights_only=False)


def load_full_state(model: torch.nn.Module, opt: torch.optim.Optimizer, blob: dict[str, Any] | None,
                    group: Group | None) -> None:
    """Rank 0's whole model and optimizer state (the single-file training state) into every rank's shards; its
    optimizer state, keyed by position, is renamed to parameter names first."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=group is not None)
    weights, optim = {}, {}  # a follower's part: rank 0 broadcasts
    if blob is not None:
        names = [n for n, _ in model.named_parameters()]
        weights, optim = blob["model"], blob["optimizer"]
        optim = {"state": {names[i]: v for i, v in optim["state"].items()},
                 "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in optim["param_groups"]]}
    set_model_state_dict(model, weights, options=options)
    set_optimizer_state_dict(model, opt, optim, options=options)


def load_full_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], group: Group | None) -> None:
    """Rank 0's whole weights (a served checkpoint's, any dtype) into this rank's model or shards; the optimizer's
    state is left as it is."""
    if group is None:
        with torch.no_grad():
            model.load_state_dict(weights, strict=False)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                                  strict=False))


class Lockstep:
    """Rank 0's handle on the trainer of every rank: each call is broadcast, then made here; the followers
    (``follow``) make the same call on their own trainer."""

    def __init__(self, group: Group, opened: Any) -> None:
        self.group = group
        self.local = opened

    @classmethod
    def open(cls, group: Group, opener: Callable[..., Any], **kw: Any) -> Lockstep:
        """Every rank opens its trainer with ``opener`` (``consumers.trainer.step.open_trainer``) and ``kw``."""
        group.agree(("open", (), kw))
        return cls(group, opener(group=group, **kw))

    def call(self, name: str, *args: Any, **kw: Any) -> Any:
        self.group.agree((name, args, kw))
        return getattr(self.local, name)(*args, **kw)

    def step(self, *args: Any) -> dict[str, float]:
        return self.call("step", *args)

    def publish(self, **kw: Any) -> Any:
        return self.call("publish", **kw)

    def load_training_state(self, *args: Any, **kw: Any) -> bool:
        return self.call("load_training_state", *args, **kw)

    def advance(self) -> None:
        return self.call("advance")

    def settle(self, ref: Any, revision: int) -> bool:
        return self.call("settle", ref, revision)

    def __getattr__(self, name: str) -> Any:  # what rank 0 only reads: revision, training_state_path, ...
        return getattr(self.local, name)


def stop_followers(group: Group) -> None:
    """Rank 0 is done: the followers return from ``follow``, and every rank leaves the group. A group a rank has
    died out of is left as it is: torchrun stops the rest and starts it again."""
    try:
        group.agree(("stop", (), {}))
        leave(group)
    except RuntimeError as e:  # gloo/NCCL: a peer is gone
        log.warning("the trainer group is broken", extra={"fields": {"service": "trainer", "error": str(e)[:300]}})


def leave(group: Group) -> None:
    """Leave together: a rank that tore its process group down while another still used it aborted the process
    (gloo: "terminate called without an active exception")."""
    dist.barrier(group=group.control)
    dist.destroy_process_group()


def follow(group: Group, opener: Callable[..., Any]) -> None:
    """A rank > 0: make every call rank 0 broadcasts on its own trainer, until rank 0 stops. SIGTERM is left to
    rank 0, which finishes its step and transaction and then stops the group; if rank 0 dies instead, the next
    broadcast fails at once and this rank exits with the error."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    trainer = None
    while True:
        name, args, kw = group.agree()
        if name == "stop":
            leave(group)
            return
        if name == "open":  # rank 0 opened its trainer again (a new task after a rebalance or a client rebuild)
            trainer = opener(group=group, **kw)
        else:
            getattr(trainer, name)(*args, **kw)

