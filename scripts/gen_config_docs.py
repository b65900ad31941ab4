"""Write the reference of every config key, generated from the docstrings under the config dataclasses' fields:
docs/config.md, and the README's configuration reference (between its config-reference markers).

    python scripts/gen_config_docs.py            # rewrite both after changing a config field
    python scripts/gen_config_docs.py --check    # exit 1 naming what is stale (tests/test_config.py runs this)
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
README = ROOT / "README.md"
START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def markdown() -> str:
    """docs/config.md: every key, its default and meaning, one table per section."""
    lines = [
        "# Configuration keys",
        "",
        "Generated from the config dataclasses (`vlmrl/<package>/config.py`, composed in `vlmrl/config.py`) by",
        "`python scripts/gen_config_docs.py`; a test checks it is current. Set keys in a yaml file",
        "(`config=FILE.yaml`, nested by section) or on the command line as dotted overrides (`rollout.n=8`).",
        "Invalid combinations are rejected at load with what to change.",
        "",
    ]
    docs = field_docs(Config)
    for section in dataclasses.fields(Config):
        lines += [f"## `{section.name}` — {docs.get(section.name, '')}", "", "| key | default | meaning |",
                  "|---|---|---|"]
        for key, default, doc in describe(type(getattr(Config(), section.name)), prefix=f"{section.name}."):
            escaped = doc.replace("|", "\\|")
            lines.append(f"| `{key}` | `{default}` | {escaped} |")
        lines.append("")
    return "\n".join(lines)


def readme_reference() -> str:
    """The README's configuration reference: the same tables one heading level down, without the title."""
    body = markdown().split("\n", 2)[2]
    return "\n".join("#" + line if line.startswith("## ") else line for line in body.splitlines()) + "\n"


def readme_with_reference(readme: str) -> str:
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{readme_reference()}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that both files are current")
    args = parser.parse_args(argv)
    wanted = {DOCS: markdown(), README: readme_with_reference(README.read_text())}
    stale = [path for path, text in wanted.items() if path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is stale: run python scripts/gen_config_docs.py", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(wanted[path])
        print(f"updated {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
