"""How ``VllmServer`` is started, without starting it: the KV cache it reserves is sized from the model's config and
the context it serves (a fixed 2 GiB was a fifth of the main job's memory)."""

from __future__ import annotations

import json

import pytest

from producers.inference.vllm_server import (BLOCK_SIZE, KV_CACHE_MAX_BYTES, SEQUENCES, SHORT_CONTEXT, VllmServer,
                                            kv_cache_bytes)


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


def test_a_short_context_has_kv_blocks_of_32_tokens_so_a_groups_prompt_is_cached_unless_the_user_says_otherwise(
        llama):
    """vllm-cpu's 128-token blocks never cache a 45-token prompt for the other 7 of its group (``BLOCK_SIZE``); a long
    context keeps vLLM's own (smaller blocks walk slower there)."""
    cmd = VllmServer(llama, max_model_len=SHORT_CONTEXT).command()
    assert cmd[cmd.index("--block-size") + 1] == "32" == str(BLOCK_SIZE)
    assert "--block-size" not in VllmServer(llama, max_model_len=SHORT_CONTEXT + 1).command()
    mine = VllmServer(llama, max_model_len=256, extra_args=("--block-size", "128")).command()
    assert mine[-2:] == ["--block-size", "128"]  # argparse: the last one wins


def test_the_model_runs_in_the_engine_cores_process_unless_the_user_says_otherwise(llama, monkeypatch):
    """vllm-cpu runs the "uni" executor only with V1 multiprocessing off (else it forces "mp", a third process);
    a user's own setting and arguments come after ours and win."""
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    server = VllmServer(llama, extra_args=("--distributed-executor-backend", "mp"))
    cmd = server.command()
    assert cmd[cmd.index("--distributed-executor-backend") + 1] == "uni"
    assert cmd[-2:] == ["--distributed-executor-backend", "mp"]  # argparse: the last one wins
    assert server.environment()["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert server.environment()["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_an_eager_server_runs_vllms_sampler_uncompiled_unless_the_user_says_otherwise(llama, monkeypatch):
    """--enforce-eager leaves vLLM's sampler compiling a helper on the first request that asks for logprobs (1.5 s
    on 2 cores: ``python -m benchmarks first_request``): off for an eager server, left to vLLM when the model is
    compiled, and a user's own setting wins."""
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    assert VllmServer(llama).environment()["TORCHDYNAMO_DISABLE"] == "1"
    assert "TORCHDYNAMO_DISABLE" not in VllmServer(llama, compile=True).environment()
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")
    assert VllmServer(llama).environment()["TORCHDYNAMO_DISABLE"] == "0"


def test_a_recipes_server_settings_become_vllms_arguments_as_prime_rl_passes_them():
    """``[inference.vllm]``: an explicit parser verbatim, with auto tool choice; "auto" (prime-rl's default) from
    the served model's name by prime-rl's table (none for SmolLM2); auto tool choice switched off when asked."""
    from producers.inference.vllm_server import recipe_server_args

    assert recipe_server_args({}, "HuggingFaceTB/SmolLM2-135M-Instruct") == []
    assert recipe_server_args({}, "Qwen/Qwen3-4B-Instruct-2507") == ["--tool-call-parser", "hermes",
                                                                     "--enable-auto-tool-choice"]
    assert recipe_server_args({"tool_call_parser": "hermes", "chat_template": "t.jinja"}, "any") == [
        "--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--chat-template", "t.jinja"]
    assert recipe_server_args({"enable_auto_tool_choice": False}, "Qwen/Qwen3-4B-Thinking-2507") == [
        "--tool-call-parser", "hermes", "--reasoning-parser", "deepseek_r1"]


def test_a_lora_plan_serving_adapters_starts_vllm_with_lora_as_prime_rl_does(llama, monkeypatch):
    """``[trainer.model.lora]`` served as adapters: ``--enable-lora``, ``--max-lora-rank`` the rank rounded up to one
    vLLM accepts, runtime adapter loading allowed (the arena's ``/v1/load_lora_adapter``); served merged, or without
    LoRA, none of it."""
    from producers.inference.vllm_server import lora_server_args
    from schemas.plan import LoraSpec
    from schemas.plan_compiler import compile_plan

    assert lora_server_args(16) == ["--enable-lora", "--max-lora-rank", "16"]
    assert [lora_server_args(r)[-1] for r in (1, 2, 9, 33, 300, 512)] == ["1", "8", "16", "64", "320", "512"]
    with pytest.raises(ValueError, match="above the largest"):
        lora_server_args(1024)
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    plan = compile_plan("examples/plans/arithmetic-smollm2-lora.toml")
    server = VllmServer.for_plan(plan, llama)
    cmd = server.command()
    assert cmd[cmd.index("--enable-lora"):cmd.index("--enable-lora") + 3] == ["--enable-lora", "--max-lora-rank", "16"]
    assert server.environment()["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    for other in (plan.model_copy(update={"lora": LoraSpec(serving="merged")}), plan.model_copy(update={"lora": None})):
        server = VllmServer.for_plan(other, llama)
        assert "--enable-lora" not in server.command()
        assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in server.environment()


def test_the_plan_reads_the_server_settings_of_either_inference_table_and_lists_the_rest(tmp_path):
    from schemas.plan import PlanError
    from schemas.plan_compiler import compile_plan

    recipe = tmp_path / "r.toml"
    base = ('max_steps = 2\n[model]\nname = "HuggingFaceTB/SmolLM2-135M-Instruct"\n'
            '[[orchestrator.train.source]]\nenv = { taskset = { id = "t" } }\n')
    recipe.write_text(base + '[inference.vllm]\ntool_call_parser = "hermes"\ngpu_memory_utilization = 0.5\n'
                             '[inference.model]\nmax_model_len = 512\n[inference.server]\nport = 8000\n')
    plan = compile_plan(str(recipe))
    assert plan.server == {"tool_call_parser": "hermes", "max_model_len": 512}
    assert plan.provenance["server.tool_call_parser"] == "inference.vllm.tool_call_parser"
    listed = plan.ignored_sections + plan.ignored_keys
    assert "inference.vllm.gpu_memory_utilization" in listed and "inference.server" in listed
    assert not any(k.endswith(("tool_call_parser", "max_model_len")) for k in listed)
    recipe.write_text(base + '[inference.vllm]\nmax_model_len = 512\n[inference.model]\nmax_model_len = 1024\n')
    with pytest.raises(PlanError, match="inference.model.max_model_len: conflicts"):
        compile_plan(str(recipe))


@pytest.mark.integration
async def test_a_recipe_naming_a_tool_call_parser_starts_a_vllm_that_accepts_tool_calls(tmp_path):
    """The failure a user met: a tool-using environment's "auto" tool choice refused with HTTP 400 by a vLLM started
    without a parser. Started for a recipe with ``tool_call_parser = "hermes"`` (real vLLM, the packaged SmolLM2),
    the same request is answered."""
    import httpx

    from policy.hf import prepare_model
    from schemas.plan_compiler import compile_plan
    from streams.local_broker import free_port

    recipe = tmp_path / "r.toml"
    recipe.write_text('max_steps = 2\nseq_len = 512\n[model]\nname = "HuggingFaceTB/SmolLM2-135M-Instruct"\n'
                      '[[orchestrator.train.source]]\nenv = { taskset = { id = "t" } }\n'
                      '[inference.vllm]\ntool_call_parser = "hermes"\n')
    plan = compile_plan(str(recipe))
    server = VllmServer.for_plan(plan, prepare_model().path, port=free_port(), max_model_len=512,
                                 log_path=tmp_path / "vllm.log")
    assert server.command()[-3:] == ["--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
    await server.start()
    try:
        tool = {"type": "function", "function": {"name": "add", "description": "add two numbers", "parameters": {
            "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}
        async with httpx.AsyncClient(timeout=60) as http:
            r = await http.post(server.base_url + "/chat/completions", json={
                "model": plan.family, "messages": [{"role": "user", "content": "What is 2+3? Use the tool."}],
                "tools": [tool], "tool_choice": "auto", "max_tokens": 16})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["role"] == "assistant"
        # the model runs in the engine core's process, forked from the fork server that imported it beside the API
        # server (producers.inference.vllm_launch): one process besides the two (and vLLM's resource tracker), where vllm-cpu's
        # default "mp" executor adds a worker under it
        import psutil

        forkserver = [p for p in psutil.Process(server.proc.pid).children()
                      if "resource_tracker" not in " ".join(p.cmdline())]
        assert len(forkserver) == 1 and "forkserver" in " ".join(forkserver[0].cmdline())
        engine = forkserver[0].children(recursive=True)
        assert len(engine) == 1, [p.cmdline() for p in engine]
    finally:
        await server.stop()


@pytest.mark.integration
def test_a_server_a_killed_run_left_waiting_on_its_engine_core_is_killed_with_its_process_group(tmp_path):
    """The run that started vLLM is SIGKILLed while a weight reload waits on the engine core (held here with SIGSTOP,
    so the reload never answers): the SIGTERM the kernel sends the server cannot stop it (its HTTP server waits for
    the reload's reply first), so ``ORPHAN_GRACE_S`` after the run died its whole process group is killed
    (``producers.inference.children.end_group_after_parent``): no process of the server is alive 5 s after that."""
    import os
    import signal
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    from streams.local_broker import free_port

    port = free_port()
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import asyncio
        from policy.hf import prepare_model
        from producers.inference.vllm_server import VllmServer

        async def main():
            server = VllmServer(prepare_model().path, port={port}, max_model_len=256, log_path={str(tmp_path / 'v.log')!r})
            await server.start()
            print(server.proc.pid, flush=True)
            await asyncio.sleep(600)

        asyncio.run(main())
        """))
    run = subprocess.Popen([sys.executable, str(script)], cwd=Path(__file__).resolve().parents[1],
                           stdout=subprocess.PIPE)
    leaders: list[int] = []
    try:
        _kill_a_run_mid_reload(run, port, leaders)
    finally:  # whatever failed, nothing of it is left running
        run.kill()
        for pid in leaders:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _kill_a_run_mid_reload(run, port: int, leaders: list[int]) -> None:
    import signal
    import threading
    import time

    import httpx
    import psutil

    from producers.inference.children import ORPHAN_GRACE_S
    from producers.inference.pool import server_root

    server = psutil.Process(int(run.stdout.readline()))
    leaders.append(server.pid)
    tree = [server, *server.children(recursive=True)]
    engine = [p for p in tree[1:] if p.ppid() != server.pid]  # the fork server's child
    assert len(engine) == 1, [p.cmdline() for p in tree]
    engine[0].send_signal(signal.SIGSTOP)
    url = server_root(f"http://127.0.0.1:{port}/v1")
    reload = threading.Thread(target=lambda: httpx.post(url + "/collective_rpc", json={"method": "reload_weights"},
                                                        timeout=120), daemon=True)
    reload.start()
    time.sleep(1.0)
    run.kill()
    run.wait()
    died = time.monotonic()

    def alive() -> list[int]:  # a zombie is gone (whoever reaps it here)
        found = []
        for p in tree:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p.pid)
            except psutil.NoSuchProcess:
                pass
        return found

    while alive() and time.monotonic() - died < ORPHAN_GRACE_S + 5:
        time.sleep(0.2)
    assert not alive(), alive()


def test_a_trainer_checkpoint_is_served_with_its_familys_tokenizer_and_an_unknown_one_says_what_to_pass(tmp_path):
    """A checkpoint folder holds weights and config only (``policy.hf.save_checkpoint``): served alone (a teacher,
    ``rollout serve vllm --model CHECKPOINT``), vLLM needs its tokenizer from elsewhere."""
    from policy.hf import FAMILY, prepare_model
    from producers.inference.vllm_server import VllmStartError, checkpoint_tokenizer

    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text("{}")
    (ck / "revision.json").write_text(json.dumps({"family": FAMILY, "revision": 3}))
    packaged = prepare_model().path
    assert checkpoint_tokenizer(ck) == packaged
    cmd = VllmServer(ck, kv_cache_gb=1).command()
    assert cmd[cmd.index("--tokenizer") + 1] == str(packaged)
    assert "--tokenizer" not in VllmServer(packaged, kv_cache_gb=1).command()  # a model folder holds its own
    (ck / "revision.json").write_text(json.dumps({"family": "org/elsewhere", "revision": 3}))
    assert checkpoint_tokenizer(ck) is None
    with pytest.raises(VllmStartError, match="holds no tokenizer.*--tokenizer"):
        VllmServer(ck).check()
    given = VllmServer(ck, tokenizer=packaged, kv_cache_gb=1).command()
    assert given[given.index("--tokenizer") + 1] == str(packaged)
