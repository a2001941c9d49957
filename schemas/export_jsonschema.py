"""Export the JSON Schema of every event: ``python -m schemas.export_jsonschema [--check]``.

Writes ``schemas/jsonschema/<event_type>.v<N>.json``, one file per event type and schema
version. The files are checked in; ``tests/test_schema_evolution.py`` fails when the models
export something else, so a contract change is always a visible, reviewed diff (and, when it
breaks old readers, a new ``SCHEMA_VERSION`` with an upcaster, leaving the old file in place).

``--check`` writes nothing and exits 1 listing the files that differ or are missing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from schemas.envelope import Event
from schemas.events import ALL_EVENTS

SCHEMA_DIR = Path(__file__).with_name("jsonschema")


def filename(cls: type[Event]) -> str:
    return f"{cls.EVENT_TYPE}.v{cls.SCHEMA_VERSION}.json"


def schema_of(cls: type[Event]) -> dict[str, Any]:
    schema = cls.model_json_schema(mode="validation")
    props = schema.get("properties", {})
    # The envelope stamps these from class constants: in the contract they are constants.
    props["event_type"] = {"const": cls.EVENT_TYPE, "title": "Event Type", "type": "string"}
    props["schema_version"] = {"const": cls.SCHEMA_VERSION, "title": "Schema Version", "type": "integer"}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"rollout-log/{filename(cls)}",
        "x-event-type": cls.EVENT_TYPE,
        "x-schema-version": cls.SCHEMA_VERSION,
        **schema,
    }


def render(cls: type[Event]) -> str:
    return json.dumps(schema_of(cls), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def rendered() -> dict[str, str]:
    return {filename(cls): render(cls) for cls in ALL_EVENTS}


def differences(directory: Path = SCHEMA_DIR) -> list[str]:
    out = []
    for name, text in rendered().items():
        path = directory / name
        if not path.exists():
            out.append(f"{name}: missing")
        elif path.read_text(encoding="utf-8") != text:
            out.append(f"{name}: differs from what the models export")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m schemas.export_jsonschema", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 if a file differs")
    parser.add_argument("--dir", type=Path, default=SCHEMA_DIR)
    args = parser.parse_args(argv)
    if args.check:
        diffs = differences(args.dir)
        for d in diffs:
            print(d, file=sys.stderr)
        return 1 if diffs else 0
    args.dir.mkdir(parents=True, exist_ok=True)
    for name, text in rendered().items():
        path = args.dir / name
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
