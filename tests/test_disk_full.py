"""A full disk is the environment's fault, not the batch's: the trainer, its checkpoint folder on a small tmpfs that
is filled, trains nothing and waits, with one error line each try naming the fault; nothing is dead-lettered; once
space is freed every batch is trained exactly once. A real tmpfs (mounting one needs root, as on CI's machine), a
real broker, the four services in one process."""

from __future__ import annotations

import asyncio
import errno
import subprocess
import uuid

import pytest

from consumers import testing
from consumers.runner import System
from consumers.settings import ServiceSettings
from schemas import codec
from schemas.events import TrainerBatch
from schemas.policy import PolicyRevision
from streams import topics, transactions
from tests.test_eos_pipeline import read_all, seed_groups

pytestmark = pytest.mark.integration


@pytest.fixture
def small_disk(tmp_path):
    where = tmp_path / "checkpoints"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(where)], capture_output=True,
                             text=True)
    if mounted.returncode:
        pytest.fail(f"cannot mount a tmpfs here (run the tests as root, as CI does): {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _fill(path) -> int:
    """Write into ``path`` until the disk refuses: the bytes written."""
    n = 0
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
                n += 65536
        except OSError as e:
            assert e.errno == errno.ENOSPC
    return n


async def test_a_trainer_on_a_full_disk_waits_and_trains_every_batch_once_when_space_is_back(
        kafka_settings, monkeypatch, small_disk, caplog):
    monkeypatch.setenv("ROLLOUT_TOPIC_PREFIX", f"full{uuid.uuid4().hex[:8]}.")
    monkeypatch.setattr(transactions, "ENVIRONMENT_RETRY_S", 0.5)
    kw = kafka_settings.client_kwargs()
    await topics.create_topics(kw)
    settings = ServiceSettings(family=testing.FAMILY, batch_records=8, flush_after_s=1.0,
                               checkpoint_dir=str(small_disk))
    async with System(("verifier", "credit", "batcher", "trainer"), settings, kw):  # r0 written on the tmpfs first
        filler = small_disk / "filler"
        assert _fill(filler) > 0
        await seed_groups(kw, 8)  # 32 records: 4 batches of 8
        batches = await read_all(kw, topics.TRAINER_BATCHES.name, until=lambda rs: len(rs) >= 4, timeout_s=60)
        await asyncio.sleep(3)  # the trainer tries, and waits
        revs = [codec.decode(r.value, PolicyRevision) for r in await read_all(kw, topics.POLICY_REVISIONS.name,
                                                                                idle_s=1)]
        assert [r.revision for r in revs] == [0], "a revision was published with no room to write it"
        assert "No space left on device" in caplog.text and "nothing is dead-lettered" in caplog.text
        filler.unlink()
        revs = [codec.decode(r.value, PolicyRevision) for r in await read_all(
            kw, topics.POLICY_REVISIONS.name, until=lambda rs: len(rs) >= 5, timeout_s=120)]
    assert [r.revision for r in revs] == [0, 1, 2, 3, 4]
    trained = [r.batch_id for r in revs[1:]]
    assert sorted(trained) == sorted(codec.decode(b.value, TrainerBatch).batch_id for b in batches)  # each once
    assert not await read_all(kw, topics.DEAD_LETTERS.name, idle_s=2)


def test_a_full_disk_is_an_oserror_whatever_the_checkpoint_writer_says(small_disk):
    """torch.save raises RuntimeError ("unexpected pos") and safetensors its own error on a full disk: both
    checkpoint writers raise OSError(ENOSPC) instead (what ``environment_fault`` recognises), leaving nothing
    behind."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from policy import checkpoint, hf
    from policy.model import ModelConfig, PolicyModel
    from streams.transactions import environment_fault

    _fill(small_disk / "filler")
    (small_disk / "filler").write_bytes(b"\0" * (15 * 2**20))  # 1 MB left
    torch.manual_seed(0)
    llama = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64))  # ~2.5 MB in bf16
    for save in (lambda: hf.save_checkpoint(llama, small_disk, "org/l", 1),
                 lambda: checkpoint.save_checkpoint(PolicyModel.from_seed(0, ModelConfig(hidden_dim=1024)), small_disk,
                                                    "tiny", 1)):
        with pytest.raises(OSError) as info:
            save()
        assert info.value.errno == errno.ENOSPC and environment_fault(info.value)
        assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]
