"""The reference service (prime-rl's opd teacher scoring): the pure parts without Kafka, then the service on a real
broker with a real vLLM as the reference: every trainable token's logprob equal to transformers' under the served
dtype's tolerance, carried by credit onto the TrainingRecords, a reference that is down waited out with nothing
dropped, malformed or refused input dead-lettered with its reason, and a grpo source beside it credited as before."""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import numpy as np
import pytest

from consumers.credit import CreditAssigner
from consumers.reference import ReferenceRefused, ReferenceScorer, completion_logprobs, prefill_body
from schemas import codec
from schemas.events import RolloutReferenced, RolloutScored, StepReference, StepTokens
from schemas.objectives import Reference
from schemas.plan import References
from schemas.policy import PolicyRef
from streams import serde, topics

TEACHER = Reference(model="teacher", base_url="http://teacher:8001/v1")
REFS = References(by_source={"rt-grpo": None, "rt-opd": TEACHER})


def _scored(rid: str, group: str, source: str, prompt: list[int], completion: list[int], reward: float,
            group_size: int = 2) -> RolloutScored:
    return RolloutScored(
        run_id="run", producer="test", rollout_id=rid, group_id=group, root_group_id=group, group_size=group_size,
        environment="reverse-text@1", example_id="ex", status="completed", rewards={"agent": reward},
        verifier="exact_match", verifier_version="1", train_source=source,
        trainable_steps=[StepTokens(step_id=f"{rid}-000", member_id="agent", policy=PolicyRef(family="f", revision=0),
                                    prompt_token_ids=np.array(prompt, np.int32),
                                    completion_token_ids=np.array(completion, np.int32),
                                    completion_logprobs=np.full(len(completion), -1.0, np.float32))])


def test_a_prefill_answer_gives_each_completion_tokens_own_logprob_checked_by_its_id():
    ids = [5, 9, 3, 7]
    answer = {"choices": [{"prompt_logprobs": [None, {"9": {"logprob": -1.5}}, {"3": {"logprob": -0.25},
                                                                                 "8": {"logprob": -0.1}},
                                               {"7": {"logprob": -9999.0}}]}]}
    assert completion_logprobs(answer, ids, 2).tolist() == [-0.25, -9999.0]
    assert prefill_body("m", ids) == {"model": "m", "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0,
                                      "temperature": 1.0, "top_p": 1.0}
    with pytest.raises(ReferenceRefused, match="no logprob of token 7"):
        completion_logprobs({"choices": [{"prompt_logprobs": [None, {}, {"3": {"logprob": 0}}, {"8": {}}]}]}, ids, 2)


def test_credit_trains_a_ref_kl_sources_score_from_its_reference_and_credits_the_grpo_source_as_before():
    a = CreditAssigner("grpo", {"scale_std": False}, producer="credit")
    opd = _scored("o1", "go", "rt-opd", [1, 2], [3, 4, 5], 0.0)
    ref = np.array([-0.5, -1.0, -2.0], np.float32)
    ev = RolloutReferenced(run_id="run", producer="reference", scored=opd, root_group_id="go", reference=TEACHER,
                           steps=[StepReference(step_id="o1-000", ref_logprobs=ref)])
    [rec] = a.add_referenced(ev)
    assert rec.ref_logprobs.tolist() == ref.tolist() and rec.advantage == 0.0 and rec.credit == "ref_kl"
    assert rec.causation_id == ev.event_id
    grpo = [a.add(_scored(f"g{i}", "gg", "rt-grpo", [1, 2], [3], float(i)), 0.0) for i in range(2)]
    assert [r.advantage for r in grpo[1]] == [-0.5, 0.5] and all(r.ref_logprobs is None for r in grpo[1])
    with pytest.raises(ValueError, match="do not match"):
        RolloutReferenced(run_id="run", producer="reference", scored=opd, root_group_id="go", reference=TEACHER,
                          steps=[StepReference(step_id="o1-000", ref_logprobs=ref[:2])])


async def test_credit_takes_a_ref_kl_sources_score_from_the_reference_service_only_and_never_twice():
    from types import SimpleNamespace

    from consumers.settings import ServiceSettings
    from consumers.tasks.credit import CreditTask

    def rec(topic, event, offset=0):
        return SimpleNamespace(topic=topic, partition=0, offset=offset, key=b"k", headers=[],
                               value=codec.encode(event))

    opd = _scored("o1", "go", "rt-opd", [1, 2], [3], 0.0)
    ev = RolloutReferenced(run_id="run", producer="reference", scored=opd, root_group_id="go", reference=TEACHER,
                           steps=[StepReference(step_id="o1-000", ref_logprobs=np.array([-0.5], np.float32))])
    task = CreditTask(0, ServiceSettings(references=REFS))
    assert await task.process(rec(topics.SCORES.name, opd)) == []  # the reference service's to score
    [out] = await task.process(rec(topics.REFERENCED.name, ev))
    assert out.event.ref_logprobs.tolist() == [-0.5] and out.event.credit == "ref_kl"
    # a credit service whose plan names no reference credits the score itself, and refuses the referenced copy
    unaware = CreditTask(0, ServiceSettings(credit="per_step"))
    assert [o.event.credit for o in await unaware.process(rec(topics.SCORES.name, opd))] == ["per_step"]
    [letter] = await unaware.process(rec(topics.REFERENCED.name, ev))
    assert letter.event.error_type == "PlanError" and "credited from the scores topic" in letter.event.error_message


def test_a_run_starts_the_reference_service_only_for_a_plan_with_an_opd_source():
    from consumers.registry import SERVICES
    from consumers.settings import build
    from schemas.plan_compiler import compile_plan

    wanted = lambda plan: [n for n, s in SERVICES.items() if s.needed(build(plan=plan, credit=True))]  # noqa: E731
    mixed = compile_plan("tests/fixtures/prime-rl-2026-08/configs_debug_algo_mixed_grpo_opd.toml")
    assert wanted(mixed) == ["verifier", "credit", "batcher", "trainer", "reference"]
    assert wanted(compile_plan("examples/plans/arithmetic.toml")) == ["verifier", "credit", "batcher", "trainer"]


# -- the service on a real broker, with vLLM as the reference ------------------------------------------------------


async def _proxy(listen_port: int, target: str):
    """A TCP forwarder to ``target`` (host:port): the reference's address, up only once this is started."""
    host, port = target.rsplit(":", 1)

    async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        except ConnectionError:
            pass
        finally:
            w.close()

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection(host, int(port))
        await asyncio.gather(pipe(cr, sw), pipe(sr, cw))

    return await asyncio.start_server(handle, "127.0.0.1", listen_port)


def _transformers_logprobs(model_dir, dtype, pairs: list[tuple[list[int], list[int]]]) -> list[np.ndarray]:
    """transformers' logprob of each completion token given the prompt and the completion before it."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    out = []
    for prompt, completion in pairs:
        ids = torch.tensor([[*prompt, *completion]])
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits.float(), -1)[0, :-1].gather(1, ids[0, 1:, None])[:, 0]
        out.append(lp[len(prompt) - 1:].numpy())
    return out


@pytest.fixture
def prefix(monkeypatch):
    p = f"t{uuid.uuid4().hex[:8]}."
    monkeypatch.setenv("ROLLOUT_TOPIC_PREFIX", p)
    return p


@pytest.mark.integration
async def test_the_reference_service_scores_every_token_as_transformers_does_and_waits_out_a_reference_that_is_down(
        kafka_settings, vllm_server, prefix, monkeypatch):
    """The reference is down for 4 s: longer than a request tries (1 s here), so the transaction is given up and the
    partition's waiting scores tried again (the processor's wait: 1 s here); nothing is dropped or doubled."""
    import torch

    from consumers import reference
    from streams import transactions
    from transformers import AutoTokenizer

    from consumers.runner import System
    from consumers.settings import ServiceSettings
    from policy.hf import FAMILY, prepare_model
    from producers.inference.weights import VllmWeights, probe_tolerance
    from schemas.policy import PolicyRevision
    from streams.local_broker import free_port
    from test_eos_pipeline import read_all

    monkeypatch.setattr(reference, "RETRY_S", 1.0)
    monkeypatch.setattr(transactions, "ENVIRONMENT_RETRY_S", 1.0)
    kw = kafka_settings.client_kwargs()
    async with httpx.AsyncClient(timeout=120) as http:  # the shared server serves the packaged weights again
        await VllmWeights(vllm_server.base_url).load(http, PolicyRevision(
            run_id="t", producer="test", family=FAMILY, revision=0, checkpoint=prepare_model().checkpoint))
    tok = AutoTokenizer.from_pretrained(vllm_server.model_dir)
    texts = [("Reverse the text: hello world", "dlrow olleh"), ("What is 12+7?", "12+7 is 19."),
             ("Name a colour.", "Blue, like the sky on a clear day."), ("Say hi.", "Hi!")]
    pairs = [(tok(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=False), add_special_tokens=False)["input_ids"],
              tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]) for q, a in texts]
    port = free_port()
    teacher = Reference(model=vllm_server.served_model_name, base_url=f"http://127.0.0.1:{port}/v1")
    refs = References(by_source={"rt-grpo": None, "rt-opd": teacher})
    opd = [_scored(f"o{i}", f"go{i // 2}", "rt-opd", p, c, 0.0) for i, (p, c) in enumerate(pairs)]
    grpo = [_scored(f"g{i}", "gg", "rt-grpo", *pairs[0], float(i)) for i in range(2)]
    too_big = _scored("bad", "gb", "rt-opd", pairs[0][0], [10 ** 7], 0.0, group_size=1)  # no such token id
    frames = [serde.to_message(s) for s in [*opd, *grpo, too_big]] + [(b"go0", b"RLEV\x01garbage", [])]
    cfg = ServiceSettings(family=FAMILY, references=refs, credit="grpo", credit_params={"scale_std": False})
    assert cfg.needs_reference
    await topics.create_topics(kw)
    from aiokafka import AIOKafkaProducer

    prod = AIOKafkaProducer(**kw)
    await prod.start()
    try:
        for key, value, headers in frames:
            await prod.send_and_wait(topics.SCORES.name, value, key=key, headers=headers)
    finally:
        await prod.stop()
    t0 = time.monotonic()
    async with System(["reference", "credit"], cfg, kw) as system:
        await asyncio.sleep(4.0)  # the reference is down: connections refused, the service waits
        proxy = await _proxy(port, vllm_server.base_url.split("//", 1)[1].split("/", 1)[0])
        up_at = time.monotonic() - t0
        try:
            records = await read_all(kw, topics.TRAINING_RECORDS.name, until=lambda rs: len(rs) >= 6, timeout_s=120)
            referenced = await read_all(kw, topics.REFERENCED.name, until=lambda rs: len(rs) >= 4, timeout_s=30)
            letters = await read_all(kw, topics.DEAD_LETTERS.name, until=lambda rs: len(rs) >= 3, timeout_s=30)
            aborted = system.processors["reference"].stats.aborted  # the fault waited out, its scores tried again
        finally:
            proxy.close()
    took = time.monotonic() - t0
    records = await read_all(kw, topics.TRAINING_RECORDS.name, idle_s=2.0)  # all of them: none twice
    assert aborted >= 1
    recs = {r.rollout_id: r for r in (codec.decode(x.value) for x in records)}
    assert sorted(recs) == ["g0", "g1", "o0", "o1", "o2", "o3"] and len(records) == 6  # nothing dropped or doubled
    assert [recs[f"g{i}"].advantage for i in range(2)] == [-0.5, 0.5] and recs["g0"].ref_logprobs is None
    refd = [codec.decode(x.value) for x in referenced]
    assert {e.scored.rollout_id for e in refd} == {"o0", "o1", "o2", "o3"}
    assert all(e.reference.model == teacher.model and e.reference.revision for e in refd)  # which model scored them
    # each token's logprob as transformers gives it (float32), within the served dtype's rounding: the bound the
    # arena's probe holds a served revision to (mean), and bf16's worst token as measured there (max 0.34)
    dtype = getattr(vllm_server, "dtype", "bfloat16")
    worst = {}
    for name, torch_dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        d = np.concatenate([recs[f"o{i}"].ref_logprobs - want for i, want in
                            enumerate(_transformers_logprobs(vllm_server.model_dir, torch_dtype, pairs))])
        worst[name] = (float(np.abs(d).mean()), float(np.abs(d).max()))
    print(f"\n[reference] served {dtype}; up after {up_at:.1f}s ({aborted} transactions given up meanwhile), all "
          f"{len(recs)} records after {took:.1f}s; "
          f"|vLLM - transformers| (mean, max) over {sum(len(c) for _, c in pairs)} tokens: {worst}")
    assert worst["float32"][0] < probe_tolerance(dtype)
    assert worst["float32"][1] < (1e-3 if dtype == "float32" else 0.35)
    # malformed input and tokens the reference refuses are dead-lettered with their reason, by this service
    mine = [codec.decode(x.value) for x in letters]
    mine = {d.error_type: d for d in mine if d.service == "reference"}
    assert set(mine) == {"EventDecodeError", "ReferenceRefused"}, mine
    assert "refused the tokens: HTTP 400" in mine["ReferenceRefused"].error_message


# -- opsd: the live policy under a demonstration -------------------------------------------------------------------

SELF_DISTILL = "tests/fixtures/prime-rl-2026-08/configs_debug_algo_self_distill.toml"


def test_an_opsd_source_is_referenced_by_the_live_policy_under_its_demonstration_and_needs_the_policys_url():
    """prime-rl's self_distill recipe: its source trains with ref_kl against the learner itself (the run's own server,
    named at run time), conditioned on the example's ``answer`` in prime-rl's default template; the reference
    service refuses to start without the learner's endpoint, and points every such reference at it."""
    from consumers.registry import SERVICES
    from consumers.settings import build
    from consumers.tasks.reference import with_policy_url
    from schemas.objectives import OPSD_TEMPLATE, Demonstration
    from schemas.plan import PlanError, references
    from schemas.plan_compiler import compile_plan

    plan = compile_plan(SELF_DISTILL)
    ref = references(plan).of("reverse-text")
    assert ref == Reference(model=plan.learner.model, base_url=None,
                            demonstration=Demonstration(key="answer", template=OPSD_TEMPLATE))
    cfg = build(plan=plan, credit=True)
    assert [n for n, s in SERVICES.items() if s.needed(cfg)] == ["verifier", "credit", "batcher", "trainer",
                                                                   "reference"]
    with pytest.raises(PlanError, match="--policy-url"):
        with_policy_url(cfg)
    resolved = with_policy_url(cfg.model_copy(update={"policy_url": "http://127.0.0.1:8000/v1"}))
    assert resolved.references.of("reverse-text").base_url == "http://127.0.0.1:8000/v1"
    assert with_policy_url(build(plan=compile_plan(
        "tests/fixtures/prime-rl-2026-08/configs_debug_algo_mixed_grpo_opd.toml"), credit=True)).references == \
        references(compile_plan("tests/fixtures/prime-rl-2026-08/configs_debug_algo_mixed_grpo_opd.toml"))


def test_the_verifier_copies_the_demonstration_only_for_a_source_that_self_distills():
    from consumers.scoring import Verdict, to_scored
    from schemas.objectives import Demonstration
    from consumers import testing

    [(steps, rollout)] = testing.arithmetic_group("g", size=1)
    rollout = rollout.model_copy(update={"artifacts": {**rollout.artifacts, "answer": "olleh",
                                                       "example_info": {"hint": "in the info", "answer": "info's"}}})
    verdict = Verdict({"solver": 1.0}, {}, "exact_match")

    def demonstration(demo):
        return to_scored(rollout, steps, verdict, producer="v", demonstration=demo).demonstration

    assert demonstration(None) is None
    assert demonstration(Demonstration(key="hint")) == "in the info"
    assert demonstration(Demonstration(key="answer")) == "info's"  # the example's info first, as prime-rl's trace info
    rollout = rollout.model_copy(update={"artifacts": {**rollout.artifacts, "example_info": {}}})
    assert demonstration(Demonstration(key="answer")) == "olleh"  # then the rollout's own field
    assert demonstration(Demonstration()) is None  # "demonstration": none here


@pytest.mark.integration
async def test_opsd_scores_each_token_under_the_policy_with_the_demonstration_prepended_as_transformers_does(
        vllm_server):
    """The hint block is what the model's chat template makes of the system message (vLLM's /tokenize), and each
    completion token's logprob is transformers' given hint + prompt + completion before it; a score without its
    demonstration is dead-lettered, not scored without it."""
    import torch
    from transformers import AutoTokenizer

    from consumers.settings import ServiceSettings
    from consumers.tasks.reference import ReferenceTask, with_policy_url
    from policy.hf import FAMILY, prepare_model
    from producers.inference.weights import VllmWeights, probe_tolerance
    from schemas.objectives import Demonstration
    from schemas.policy import PolicyRevision
    from test_partition_tasks import Rec

    async with httpx.AsyncClient(timeout=120) as http:  # the shared server serves the packaged weights again
        await VllmWeights(vllm_server.base_url).load(http, PolicyRevision(
            run_id="t", producer="test", family=FAMILY, revision=0, checkpoint=prepare_model().checkpoint))
    tok = AutoTokenizer.from_pretrained(vllm_server.model_dir)
    question, answer = "Reverse the text: hello world", "dlrow olleh"
    prompt = tok(tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False), add_special_tokens=False)["input_ids"]
    completion = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    live = Reference(model=vllm_server.served_model_name, demonstration=Demonstration(key="answer"))
    cfg = with_policy_url(ServiceSettings(family=FAMILY, references=References(by_source={"rt": live}),
                                          policy_url=vllm_server.base_url))
    hint = live.demonstration.hint(answer)
    want_hint = tok(tok.apply_chat_template([{"role": "system", "content": hint}], add_generation_prompt=False,
                                            tokenize=False), add_special_tokens=False)["input_ids"]
    with_demo = _scored("o1", "g1", "rt", prompt, completion, 0.0, group_size=1).model_copy(
        update={"demonstration": answer})
    without = _scored("o2", "g2", "rt", prompt, completion, 0.0, group_size=1)
    async with httpx.AsyncClient(timeout=120) as http:
        scorer = ReferenceScorer(http)
        assert await scorer.hint_ids(cfg.references.of("rt"), answer) == want_hint
        task = ReferenceTask(0, cfg, scorer)
        outs = [*await task.process(Rec(topics.SCORES.name, 0, with_demo)),
                *await task.process(Rec(topics.SCORES.name, 1, without))]
        deadline = time.monotonic() + 60
        while len(outs) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            outs += task.input_read(time.monotonic())
    by_kind = {type(o.event).__name__: o.event for o in outs}
    assert set(by_kind) == {"RolloutReferenced", "DeadLetter"}
    assert "opsd needs the demonstration 'answer'" in by_kind["DeadLetter"].error_message
    referenced = by_kind["RolloutReferenced"]
    assert referenced.reference.demonstration == live.demonstration
    assert referenced.reference.base_url == vllm_server.base_url  # which server, conditioned how: on the log
    got = referenced.steps[0].ref_logprobs
    dtype = getattr(vllm_server, "dtype", "bfloat16")
    conditioned, plain = _transformers_logprobs(vllm_server.model_dir, torch.float32,
                                                [(want_hint + prompt, completion), (prompt, completion)])
    print(f"\n[opsd] served {dtype}: |vLLM - transformers(hint + sample)| mean {np.abs(got - conditioned).mean():.4f} "
          f"max {np.abs(got - conditioned).max():.4f}; the demonstration moved transformers' logprobs by "
          f"{np.abs(conditioned - plain).mean():.4f} (mean)")
    assert np.abs(got - conditioned).mean() < probe_tolerance(dtype)
    assert np.abs(got - conditioned).mean() < np.abs(got - plain).mean()  # scored under the hint, not without it
