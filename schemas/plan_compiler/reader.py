"""How a recipe is read, and every refusal worded in one place: the key paths, strict and lenient tables (an unknown key
refused with its near miss, or listed as ignored), typed values, sampling tables."""

from __future__ import annotations

import difflib
from typing import Any, Iterable

from schemas.recipe_keys import neutral_reason, refusals
from schemas.plan import MemberRoute, PlanError, Target

# Sampling keys we know: prime-rl's train/eval sampling configs (and the fork's), verifiers'
# SamplingConfig and the request fields producers.inference.client sends. Any other key is a sampling
# parameter for the server (vLLM takes extra ones), passed through in extra_body.
SAMPLING_KEYS = frozenset({
    "temperature", "max_tokens", "max_completion_tokens", "top_p", "top_k", "min_p", "min_tokens",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop", "extra_body",
    "reasoning_effort", "logprobs", "n"})

SAMPLING_IGNORED = frozenset({"temp_scheduler"})  # the fork's orchestrator-side temperature schedule


class RecipeReader:
    """The reading and refusing every section uses; holds what the compile has collected."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.ignored_sections: list[str] = []
        self.ignored_keys: list[str] = []
        self.refused: list[str] = []
        self.unified = True
        self.passthrough: list[str] = []
        self.provenance: dict[str, str] = {}
        self.targets: dict[str, Target] = {}
        self.members: dict[str, MemberRoute] = {}
        self.seat_origin: dict[str, str] = {}  # seat -> path of the source that routed it

    def fail(self, field: str, msg: str) -> PlanError:
        return PlanError(f"{self.source}: {field}: {msg}")

    def _unknown(self, path: str, key: str, known: Iterable[str]) -> PlanError:
        close = near_miss(key, known) or difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else f"; known keys: {', '.join(sorted(known))}"
        return self.fail(join_path(path, key), f"unknown key in [{path or '<top level>'}]{hint}")

    def strict(self, table: dict[str, Any], path: str, known: Iterable[str]) -> None:
        known = frozenset(known)
        for key in table:
            if key not in known:
                raise self._unknown(path, key, known)

    def lenient(self, table: dict[str, Any], path: str, owned: Iterable[str], skip: Iterable[str] = ()) -> None:
        """Pass over keys we do not read (recording them) unless one is a near miss of an owned key."""
        owned = frozenset(owned)
        skip = frozenset(skip)
        for key, value in table.items():
            if key in owned or key in skip:
                continue
            if near_miss(key, owned):
                raise self._unknown(path, key, owned)
            self.ignore(join_path(path, key), value)

    def ignore(self, path: str, value: Any) -> None:
        """A key the generation plan does not read: refused when it changes the run (``schemas.recipe_keys``),
        else listed as not applicable here."""
        refused = refusals(path, value, orchestrator_scope=not self.unified)
        self.refused.extend(refused)
        if not refused and neutral_reason(path, orchestrator_scope=not self.unified) is not None:
            table = isinstance(value, dict) or is_table_list(value)
            (self.ignored_sections if table else self.ignored_keys).append(path)

    def table(self, parent: dict[str, Any], key: str, path: str) -> dict[str, Any] | None:
        value = parent.get(key)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self.fail(join_path(path, key), f"expected a table, got {kind_of(value)}")
        return value

    def tables(self, value: Any, path: str) -> list[tuple[str, dict[str, Any]]]:
        """One table or an array of tables, each with its path."""
        if isinstance(value, dict):
            return [(path, value)]
        if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
            raise self.fail(path, f"expected one or more tables, got {kind_of(value)}")
        return [(f"{path}[{i}]", t) for i, t in enumerate(value)]

    def one_of(self, first: tuple[dict[str, Any] | None, str], second: tuple[dict[str, Any] | None, str],
               why: str = "") -> tuple[dict[str, Any], str] | None:
        """The one of two spellings of a table that the recipe uses, as (table, path); both is refused."""
        if first[0] is not None and second[0] is not None:
            raise self.fail(second[1], f"set only one of [{first[1]}] and [{second[1]}]{why}")
        return next(((t, path) for t, path in (first, second) if t is not None), None)

    def integer(self, value: Any, field: str, minimum: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(field, f"expected an integer, got {kind_of(value)} {value!r}")
        if value < minimum:
            raise self.fail(field, f"must be >= {minimum}, got {value}")
        return value

    def number(self, value: Any, field: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(field, f"expected a number, got {kind_of(value)} {value!r}")
        return float(value)

    def string(self, value: Any, field: str) -> str:
        if not isinstance(value, str) or not value.strip():
            raise self.fail(field, f"expected a non-empty string, got {kind_of(value)} {value!r}")
        return value

    def string_list(self, value: Any, field: str, *, allow_single: bool = False) -> list[str]:
        if allow_single and isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise self.fail(field, f"expected a list of strings, got {kind_of(value)}")
        return [self.string(v, f"{field}[{i}]") for i, v in enumerate(value)]

    def sampling(self, table: dict[str, Any], path: str) -> dict[str, Any]:
        """Known keys checked and normalised (max_completion_tokens -> max_tokens); a near miss refused;
        any other key moved into extra_body (sent to the server as is) and listed."""
        out: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in table.items():
            if key in SAMPLING_IGNORED:
                self.ignore(join_path(path, key), value)
            elif key == "extra_body":
                if not isinstance(value, dict):
                    raise self.fail(join_path(path, key), f"expected a table, got {kind_of(value)}")
                extra.update(value)
            elif key in SAMPLING_KEYS:
                out[key] = value
            elif near_miss(key, SAMPLING_KEYS):
                raise self._unknown(path, key, SAMPLING_KEYS)
            else:
                if key in table.get("extra_body", {}) and table["extra_body"][key] != value:
                    raise self.fail(join_path(path, key), f"conflicts with extra_body.{key}; set one of them")
                extra[key] = value
                self.passthrough.append(join_path(path, key))
        if extra:
            out["extra_body"] = extra
        if "max_completion_tokens" in out:
            mct = out.pop("max_completion_tokens")
            if "max_tokens" in out and out["max_tokens"] != mct:
                raise self.fail(join_path(path, "max_completion_tokens"),
                                f"conflicts with max_tokens ({mct} != {out['max_tokens']}); set one of them")
            out["max_tokens"] = mct
        for key in ("max_tokens", "min_tokens", "top_k"):
            if key in out and out[key] is not None:
                least = 1 if key == "max_tokens" else (-1 if key == "top_k" else 0)
                self.integer(out[key], join_path(path, key), least)
        for key in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            if key in out and out[key] is not None:
                self.number(out[key], join_path(path, key))
        if out.get("temperature") is not None and out["temperature"] < 0:
            raise self.fail(join_path(path, "temperature"), f"must be >= 0, got {out['temperature']}")
        return out

    def sampling_of(self, parent: dict[str, Any], path: str) -> dict[str, Any]:
        """The ``sampling`` table of ``parent`` (at ``path``), compiled; {} when it has none."""
        return self.sampling(self.table(parent, "sampling", path) or {}, join_path(path, "sampling"))

    def _timeout(self, table: dict, path: str) -> float | None:
        if "timeout" not in table:
            return None
        t = table["timeout"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
            raise self.fail(join_path(path, "timeout"), f"expected a positive number of seconds, got {t!r}")
        return float(t)

    def _bool(self, value: Any, field: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(field, f"expected true or false, got {kind_of(value)} {value!r}")
        return value


def near_miss(key: str, known: Iterable[str]) -> list[str]:
    """The known key ``key`` is a typo of, if any: one edit or transposition (two for keys of 8+
    characters); for 4-character keys a transposition only, as real neighbours differ by one letter
    there (the fork's ``val`` next to ``eval``)."""
    for k in sorted(known):
        if k == key or len(k) < 4:
            continue
        n = _edits(key, k)
        if (len(k) == 4 and n == 1 and sorted(k) == sorted(key)) or (len(k) > 4 and n <= (2 if len(k) >= 8 else 1)):
            return [k]
    return []

def _edits(a: str, b: str) -> int:
    """Damerau-Levenshtein distance (optimal string alignment)."""
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            cost = a[i - 1] != b[j - 1]
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[len(a)][len(b)]

def join_path(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key

def is_table_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)

def kind_of(value: Any) -> str:
    return {dict: "a table", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
            float: "a float"}.get(type(value), type(value).__name__)
