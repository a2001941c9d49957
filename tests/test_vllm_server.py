"""How ``VllmServer`` is started, without starting it: the KV cache it reserves is sized from the model's config and
the context it serves (a fixed 2 GiB was a fifth of the main job's memory)."""

from __future__ import annotations

import json

import pytest

from producers.vllm_server import KV_CACHE_MAX_BYTES, SEQUENCES, VllmServer, kv_cache_bytes


@pytest.fixture
def llama(tmp_path):
    """SmolLM2-135M's attention shape: 30 layers, 3 key/value heads of 64."""
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "hidden_size": 576}))
    return tmp_path


PER_TOKEN = 2 * 30 * 3 * 64 * 2  # keys and values, every layer, bf16


def test_kv_cache_holds_every_sequence_at_full_length(llama):
    assert kv_cache_bytes(llama, 256) == SEQUENCES * 256 * PER_TOKEN  # 377 MB where 2 GiB was reserved


def test_kv_cache_is_capped_but_never_below_one_sequence(llama):
    assert kv_cache_bytes(llama, 2048) == KV_CACHE_MAX_BYTES  # 64 x 2048 tokens would be 3 GB
    longest = 131072 * PER_TOKEN  # one sequence of this context is larger than the cap: it must still fit
    assert kv_cache_bytes(llama, 131072) >= longest > KV_CACHE_MAX_BYTES


def test_kv_cache_from_a_config_without_head_dim_and_in_float32(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "text_config": {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}}))
    assert kv_cache_bytes(tmp_path, 100, sequences=3, dtype_bytes=4) == 3 * 100 * (2 * 2 * 4 * 16 * 4)


def test_the_command_reserves_the_sized_cache_or_the_one_asked_for(llama, monkeypatch):
    def flag(server: VllmServer) -> int:
        cmd = server.command()
        return int(cmd[cmd.index("--kv-cache-memory-bytes") + 1])

    sized = VllmServer(llama, max_model_len=256)
    assert flag(sized) == kv_cache_bytes(llama, 256, dtype_bytes=2 if sized.dtype == "bfloat16" else 4)
    assert flag(VllmServer(llama, max_model_len=256, kv_cache_gb=1.5)) == int(1.5 * 1024**3)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # a user's own, which vLLM reads over the flag
    assert "VLLM_CPU_KVCACHE_SPACE" not in VllmServer(llama).environment()
