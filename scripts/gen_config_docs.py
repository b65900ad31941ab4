"""Write docs/config.md, the reference of every config key, generated from the docstrings under the config
dataclasses' fields.

    python scripts/gen_config_docs.py            # rewrite it after changing a config field
    python scripts/gen_config_docs.py --check    # exit 1 when it is stale (tests/test_config.py runs this)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vlmrl.config import Config, describe, field_docs  # noqa: E402

DOCS = ROOT / "docs" / "config.md"


def _tables(cls: type, prefix: str, title: str, level: int) -> list[str]:
    """A heading and a table of the section's own keys, then one per sub-section (one level down)."""
    lines = [f"{'#' * level} {title}", "", "| key | default | meaning |", "|---|---|---|"]
    docs, instance = field_docs(cls), cls()
    nested = []
    for f in dataclasses.fields(cls):
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(value):
            nested.append((type(value), f"{prefix}{f.name}.", f"`{prefix}{f.name}` — {docs.get(f.name, '')}"))
    own = [row for row in describe(cls, prefix=prefix) if row[0].count(".") == prefix.count(".")]
    for key, default, doc in own:
        lines.append(f"| `{key}` | `{default}` | {doc.replace('|', chr(92) + '|')} |")
    lines.append("")
    for sub, sub_prefix, sub_title in nested:
        lines += _tables(sub, sub_prefix, sub_title, level + 1)
    return lines


def markdown() -> str:
    """docs/config.md: every key, its default and meaning, one table per section and sub-section."""
    lines = [
        "# Configuration keys",
        "",
        "Generated from the config dataclasses (`vlmrl/<package>/config.py`, composed in `vlmrl/config.py`) by",
        "`python scripts/gen_config_docs.py`; a test checks it is current. Set keys in a yaml file",
        "(`config=FILE.yaml`, nested by section) or on the command line as dotted overrides (`rollout.n=8`,",
        "`rollout.vllm.enforce_eager=true`). Invalid combinations are rejected at load with what to change.",
        "Each engine's own options live in its sub-section of `rollout` (`rollout.hf`, `rollout.vllm`,",
        "`rollout.sglang`, `rollout.server`); a backend reads the engine-neutral `rollout.*` keys and its own",
        "sub-section(s) only. Renamed keys of the last release (`rollout.server_url`, `rollout.engine_kwargs`,",
        "`reward.judge.server.host` / `port` / `log_file` / `args`) still work, with a warning naming the new key.",
        "",
    ]
    docs = field_docs(Config)
    for section in dataclasses.fields(Config):
        lines += _tables(type(getattr(Config(), section.name)), f"{section.name}.",
                         f"`{section.name}` — {docs.get(section.name, '')}", 2)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that docs/config.md is current")
    args = parser.parse_args(argv)
    wanted = markdown()
    stale = DOCS.read_text() != wanted
    if args.check:
        if stale:
            print(f"{DOCS.relative_to(ROOT)} is stale: run python scripts/gen_config_docs.py", file=sys.stderr)
        return 1 if stale else 0
    if stale:
        DOCS.write_text(wanted)
        print(f"updated {DOCS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
