"""`rollout plan FILE [--json] [--rollout ID --seed N]`: compile a recipe and show its GenerationPlan."""

from __future__ import annotations

import argparse
import json
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="compile a TOML recipe into its GenerationPlan and show routes per member",
                       description="Compile a recipe (prime-rl formats or ours, see examples/plans/) and print "
                                   "targets, routes per member and the sections the pipeline ignores.")
    p.add_argument("file", help="the TOML recipe")
    p.add_argument("--json", action="store_true", help="print the compiled plan as JSON (GenerationPlan)")
    p.add_argument("--rollout", metavar="ID", help="also resolve the routes of this rollout id ...")
    p.add_argument("--seed", type=int, default=0, help="... with this seed (default 0)")
    p.add_argument("--members", metavar="A,B", help="members to resolve with --rollout (default: those the plan names)")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    from schemas.plan import PlanError
    from schemas.plan_compiler import compile_plan

    try:
        plan = compile_plan(args.file)
    except PlanError as exc:
        print(f"rollout: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(plan.model_dump_json(indent=2))
        return 0
    print(render(plan, args.rollout, args.seed, args.members.split(",") if args.members else None))
    return 0


def _kv(d: dict) -> str:
    return ", ".join(f"{k}={json.dumps(v)}" for k, v in d.items()) or "-"


def _algorithm(a) -> str:
    head = f"{a.type} ({a.origin})" + (f" {_kv(a.params)}" if a.params else "")
    if a.credit is None:
        return f"{head} -> CANNOT RUN HERE (services refuse it): {a.note}"
    return f"{head} -> credit {a.credit}" + (f" ({_kv(a.credit_params)})" if a.credit_params else "") + f": {a.note}"


def _objective(plan, describe) -> str:
    """The plan's objective, and ref_kl for the sources that train with it (opd): each with its sources and where
    it came from, as prime-rl's compute_loss runs each record's component."""
    from schemas.plan import references

    refs = references(plan).by_source
    origin = "trainer.loss" if any(k.startswith("objective.") for k in plan.provenance) else "default: prime-rl"
    rl = [name for name, r in refs.items() if r is None]
    lines = [f"{describe(plan.objective)}   ({origin})" + (f" for {', '.join(rl)}" if len(rl) < len(refs) else "")]
    lines += [f"ref_kl (prime-rl's reverse KL to the reference, fixed settings) for {name}: reference {_reference(r)}, "
              "each token's logprob by prefill (the reference service)"
              for name, r in refs.items() if r is not None]
    if not rl and refs:
        lines = lines[1:]
    return "\n                        ".join(lines)


def _reference(r) -> str:
    where = r.base_url or "the run's own policy server"
    if r.demonstration is None:
        return f"{r.model} at {where}"
    return f"the live policy {r.model} at {where} with the demonstration {r.demonstration.key!r} prepended"


def _inflight(c) -> str:
    if c is None:
        return "from --concurrency, then sized by the engine's KV cache and the machine's memory"
    start = c.initial_inflight if c.initial_inflight is not None else "the engine's KV capacity"
    top = c.max_inflight if c.max_inflight is not None else "none"
    return (f"starts at {start}, between {c.min_inflight} and {top}, sized by the engine's KV cache and the "
            "machine's memory   (orchestrator.concurrency)")


def _optimizer(o) -> str:
    clip = f"gradients clipped at norm {o.max_norm:g}" if o.max_norm is not None else "no gradient clipping"
    if o.type == "sign_sgd":
        return f"sign_sgd (no state); {clip}"
    betas = f"betas {o.betas[0]:g}/{o.betas[1]:g}"
    if o.type == "muon":
        return f"muon (momentum {o.momentum:g}) on the 2-D weights but embeddings and LM head, AdamW ({betas}) on the rest; {clip}"
    return f"adamw ({betas}); {clip}"


def _env_line(e, top) -> str:
    parts = [f"id {e.id}"]
    if e.args:
        parts.append(f"args {_kv(e.args)}")
    if "weight" in e.options:
        parts.append(f"weight {e.options['weight']:g}")
    for k in ("group_size", "num_examples", "interval"):
        if k in e.options:
            parts.append(f"{k} {e.options[k]}")
    if e.sampling:
        parts.append(f"sampling {_kv(e.sampling)}")
    if e.seats:
        parts.append("seats " + ", ".join(f"{n}->{s.target}{'' if s.trainable else ' (fixed)'}"
                                          for n, s in e.seats.items()))
    if e.gates:
        parts.append("admission gates " + ", ".join(f"{g.name} (advantage_range [{g.reject_min:g}, {g.reject_max:g}]: "
                                                    "such a group is not trained, another fills its slots)"
                                                    for g in e.gates))
    line = f"  {e.display_name}: " + "; ".join(parts)
    if e.algorithm is not None and e.algorithm != top:
        line += f"\n    algorithm {_algorithm(e.algorithm)}"
    return line


def render(plan, rollout: str | None = None, seed: int = 0, members: list[str] | None = None) -> str:
    from schemas.objectives import describe
    from schemas.plan import LEARNER

    prov = plan.provenance
    out = [f"plan {plan.source}",
           f"  family                {plan.family}",
           f"  group_size            {plan.group_size}   ({prov.get('group_size', '?')})",
           f"  batch_size            {plan.batch_size}   ({prov.get('batch_size', '?')})"
           + (f"; token_batch_size {plan.token_batch_size}" if plan.token_batch_size else ""),
           f"  max_off_policy_steps  {plan.max_off_policy_steps}   ({prov.get('max_off_policy_steps', '?')})",
           f"  max_async_level       {plan.max_async_level}   ({prov.get('max_async_level', '?')})",
           f"  algorithm             {_algorithm(plan.advantage)}",
           f"  max_steps             {plan.max_steps or 'none (until stopped)'}   ({prov.get('max_steps', '?')})",
           f"  seq_len               {plan.seq_len or 'the server default'}   ({prov.get('seq_len', '?')})",
           f"  eval_interval         {plan.eval_interval}{'; skip_first_step' if plan.eval_skip_first_step else ''}"
           f"   ({prov.get('eval_interval', '?')})",
           f"  in flight             {_inflight(plan.concurrency)}",
           f"  trainer               {_kv(plan.trainer) if plan.trainer else 'the reference trainer defaults'}",
           f"  optimizer             {_optimizer(plan.optimizer)}",
           f"  objective             {_objective(plan, describe)}"]
    if plan.lora:
        out.append(f"  lora                  rank {plan.lora.rank}, alpha {plan.lora.alpha:g}, dropout "
                   f"{plan.lora.dropout:g}, on {', '.join(plan.lora.target_modules)} (those the model has): only the "
                   + ("adapters train; vLLM loads each revision's adapter, requests name it "
                      f"{plan.lora.adapter_name!r}" if plan.lora.serving == "adapter" else
                      "adapters train; each revision is served merged"))
    if plan.served_model:
        out.append(f"  served model          {plan.served_model}  (stands in for {plan.family})")
    out += ["", "environments (training)"]
    out += [_env_line(e, plan.advantage) for e in plan.environments]
    if plan.eval_environments:
        out += ["", "environments (evaluation: scored, never trained)"]
        out += [_env_line(e, None) for e in plan.eval_environments]
    out += [
        "", "targets"]
    width = max(len(n) for n in plan.targets)
    for name, t in plan.targets.items():
        where = ", ".join(t.base_urls) if t.base_urls else "(the run's local policy server)"
        extra = [f"api_key_var={t.api_key_var}"] if t.api_key_var else []
        if t.timeout_s is not None:
            extra.append(f"timeout={t.timeout_s:g}s")
        kind = "trainable" if name == LEARNER else "fixed"
        out.append(f"  {name:<{width}}  {kind:<9}  model={t.model}  at {where}  mode={t.request_mode}  "
                   f"sampling: {_kv(t.sampling)}" + (f"  {' '.join(extra)}" if extra else ""))

    out += ["", "routes"]
    rows = plan.route_table()
    w = [max(len(str(r[k])) for r in rows + [{"member": "member", "target": "target", "trainable": "trainable"}])
         for k in ("member", "target", "trainable")]
    out.append(f"  {'member':<{w[0]}}  {'target':<{w[1]}}  {'trainable':<{w[2]}}  rule")
    for r in rows:
        trainable = {True: "yes", False: "no"}.get(r["trainable"], r["trainable"])
        out.append(f"  {r['member']:<{w[0]}}  {r['target']:<{w[1]}}  {trainable:<{w[2]}}  {r['rule']}")
    if plan.train_one is not None:
        out.append(f"  train_one: one of {', '.join(plan.train_one.members)} is the learner per rollout "
                   f"(sha256(f\"{{seed}}:{{rollout_id}}\") mod {len(plan.train_one.members)}); "
                   f"the other seat(s) go to {plan.train_one.unselected!r}")

    if rollout is not None:
        names = members or sorted({*plan.members, *(plan.train_one.members if plan.train_one else []),
                                   *plan.untrained_members}) or ["*"]
        out += ["", f"rollout {rollout!r} seed {seed}" + (f": selected {plan.selected_member(rollout, seed)!r}"
                                                          if plan.train_one else "")]
        for m in names:
            target, trainable = plan.route(m, rollout, seed)
            out.append(f"  {m:<{w[0]}}  -> {target.name} ({target.model}){'  trainable' if trainable else ''}")

    if plan.passthrough_sampling:
        out += ["", "sampling keys passed to the inference server as is (extra_body): "
                + ", ".join(plan.passthrough_sampling)]
    if plan.server:
        out += ["", "inference server (the vLLM a run starts is given): "
                + ", ".join(f"{k}={v!r}" for k, v in sorted(plan.server.items()))]
    out += ["", "ignored sections: " + (", ".join(plan.ignored_sections) or "none"),
            "ignored keys:     " + (", ".join(plan.ignored_keys) or "none")]
    if plan.refused:
        out += ["", "refused when a run starts (they change the run; nothing here applies them):"]
        out += [f"  {r}" for r in plan.refused]
    return "\n".join(out)
