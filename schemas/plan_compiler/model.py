"""The model and its targets: the family, the learner target (its client, sampling, timeout) and the inference server's
settings."""

from __future__ import annotations

from typing import Any

from schemas.plan import LEARNER, SERVER_KEYS, Target
from schemas.plan_compiler.reader import RecipeReader, join_path

CLIENT_OWNED = frozenset({"base_url", "api_key_var", "timeout"})

MODEL_OWNED = frozenset({"name", "client"})


class ModelSection(RecipeReader):
    def _family(self, data: dict, orch: dict, op: str, unified: bool) -> tuple[str, str]:
        candidates = [(orch, op)] + ([(data, "")] if unified else [])
        for scope, path in candidates:
            model = self.table(scope, "model", path)
            if model is None:
                continue
            mpath = join_path(path, "model")
            self.lenient(model, mpath, owned=MODEL_OWNED if scope is orch else {"name"})
            if "name" in model:
                return self.string(model["name"], join_path(mpath, "name")), join_path(mpath, "name")
        raise self.fail("model.name", "the learner model is not named (add [model] name = \"...\")")

    def _learner_sampling(self, orch: dict, op: str) -> dict[str, Any]:
        train = self.table(orch, "train", op)
        given = self.one_of((self.table(train, "sampling", join_path(op, "train")) if train is not None else None,
                             join_path(op, "train.sampling")),
                            (self.table(orch, "sampling", op), join_path(op, "sampling")))
        return self.sampling(*given) if given else {}

    def _learner(self, orch: dict, op: str, family: str, sampling: dict[str, Any]) -> Target:
        model = self.table(orch, "model", op) or {}
        client, cpath = self.one_of(
            (self.table(model, "client", join_path(op, "model")), join_path(op, "model.client")),
            (self.table(orch, "client", op), join_path(op, "client"))) or ({}, join_path(op, "client"))
        self.lenient(client, cpath, owned=CLIENT_OWNED)
        base_urls = (self.string_list(client["base_url"], join_path(cpath, "base_url"), allow_single=True)
                     if "base_url" in client else [])
        api_key_var = self.string(client["api_key_var"], join_path(cpath, "api_key_var")) \
            if "api_key_var" in client else None
        return Target(name=LEARNER, model=family, base_urls=base_urls, api_key_var=api_key_var,
                      sampling=sampling, timeout_s=self._timeout(client, cpath))

    def _server(self, data: dict) -> dict[str, Any]:
        """``SERVER_KEYS`` of prime-rl's ``[inference.vllm]`` (``[inference.model]`` in older recipes): what the
        vLLM a run starts is told. The rest of ``[inference]`` is where prime-rl's servers run (neutral)."""
        inference = self.table(data, "inference", "") or {}
        out: dict[str, Any] = {}
        if "inference" in data and not inference:  # an empty table: shown as not applied, as before it was read
            self.ignore("inference", inference)
        for part, value in inference.items():
            if part not in ("vllm", "model") or not isinstance(value, dict):
                self.ignore(f"inference.{part}", value)
                continue
            table = self.table(inference, part, "inference") or {}
            for key in table.keys() - SERVER_KEYS:
                self.ignore(f"inference.{part}.{key}", table[key])
            for key in SERVER_KEYS & table.keys():
                path = f"inference.{part}.{key}"
                if key in out and out[key] != table[key]:
                    raise self.fail(path, f"conflicts with the other [inference] table's {key} ({table[key]!r} != "
                                          f"{out[key]!r}); set one")
                out[key] = self.integer(table[key], path, 1) if key == "max_model_len" else table[key]
                self.provenance[f"server.{key}"] = path
        return out
