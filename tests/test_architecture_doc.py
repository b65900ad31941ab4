"""docs/ARCHITECTURE.md and docs/design.md name only modules and names that exist.

Every dotted `vlmrl.x.y` inside backticks is resolved the way Python would: the longest prefix that imports as a
module, then each remaining part as an attribute (`vlmrl.trainer.fit.train_step`: the module `vlmrl.trainer.fit`,
its `train_step`; `vlmrl.processors.base.Processor.build_request`: a method of a class). A renamed or moved name
then fails here instead of leaving the page wrong. Importing a vlmrl module imports torch at most: no engine starts,
engines and Ray are imported only where a backend or a worker is built.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("docs/ARCHITECTURE.md", "docs/design.md")

FENCED = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`([^`]+)`")  # a span may run over a line break, as markdown allows
DOTTED = re.compile(r"(?<![\w.])vlmrl(?:\.[A-Za-z_]\w*)+")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def named_paths(text: str) -> list[str]:
    """Every dotted vlmrl path inside a backtick span of `text` (fenced blocks are not spans), in order, each once."""
    found: dict[str, None] = {}
    for span in CODE_SPAN.findall(FENCED.sub("", text)):
        for path in DOTTED.findall(span):
            found.setdefault(path, None)
    return list(found)


def _import(name: str) -> tuple[object | None, str | None]:
    """(the module, None) when `name` imports as a module; (None, None) when it is no module; (None, why) when it is
    one that fails to import (a broken module is a finding too, not a reason to look for a shorter prefix)."""
    try:
        return importlib.import_module(name), None
    except ModuleNotFoundError as err:
        missing = err.name or ""
        if missing and (name == missing or name.startswith(missing + ".")):
            return None, None
        return None, f"importing {name} fails: {type(err).__name__}: {err}"
    except ImportError as err:  # `from x import y` inside the module failed
        return None, f"importing {name} fails: {type(err).__name__}: {err}"


def resolve(path: str) -> str | None:
    """None when `path` names a module or an attribute reachable from one; else why not."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        module, why = _import(".".join(parts[:cut]))
        if why is not None:
            return why
        if module is None:
            continue
        owner: object = module
        for depth, attribute in enumerate(parts[cut:], start=cut):
            try:
                owner = getattr(owner, attribute)
            except AttributeError:
                return f"{'.'.join(parts[:depth])} has no {attribute!r}"
        return None
    return f"no module {parts[0]!r}"


def missing_names(text: str) -> list[str]:
    """Every backticked vlmrl path in `text` that does not exist, with why."""
    problems = []
    for path in named_paths(text):
        why = resolve(path)
        if why is not None:
            problems.append(f"`{path}`: {why}")
    return problems


def broken_links(text: str, folder: Path) -> list[str]:
    """Relative markdown links of `text` (a file in `folder`) whose target does not exist."""
    return [target for target in LINK.findall(text)
            if "://" not in target and not target.startswith("mailto:") and not (folder / target).exists()]


@pytest.mark.parametrize("doc", DOCS)
def test_every_named_module_and_name_exists(doc):
    text = (ROOT / doc).read_text()
    assert named_paths(text), f"{doc} names no vlmrl module: the check would pass vacuously"
    problems = missing_names(text)
    assert not problems, f"{doc} names what the code does not have:\n  " + "\n  ".join(problems)


def test_the_architecture_page_names_many_modules():
    """The page is checked, not only parsed: it names the modules the journey goes through."""
    paths = named_paths((ROOT / "docs/ARCHITECTURE.md").read_text())
    for module in ("vlmrl.trainer.fit", "vlmrl.trainer.placement", "vlmrl.batch.padding", "vlmrl.rollout.base"):
        assert any(p == module or p.startswith(module + ".") for p in paths), module
    assert len(paths) >= 40, len(paths)


def test_every_layer_of_the_layering_test_is_on_the_page():
    """tests/test_layering.py holds the layering; a package it places must appear on the page's layer diagram."""
    from tests.test_layering import CONFIG_LEAVES, LAYERS

    text = (ROOT / "docs/ARCHITECTURE.md").read_text()
    diagram = text.split("## The layers", 1)[1].split("\n## ", 1)[0]
    absent = []
    for layer in LAYERS:
        for unit in layer:
            if unit in (CONFIG_LEAVES, "vlmrl"):
                continue
            short = unit.removeprefix("vlmrl.")
            if not re.search(rf"(?<![\w.]){re.escape(unit)}\b|\|\s*{re.escape(short)}\b", diagram):
                absent.append(unit)
    assert not absent, f"packages of tests/test_layering.py's LAYERS missing from the page's layers: {absent}"


@pytest.mark.parametrize("doc", [*DOCS, "README.md"])
def test_links_hold(doc):
    path = ROOT / doc
    broken = broken_links(path.read_text(), path.parent)
    assert not broken, f"{doc} links to files that do not exist: {broken}"


def test_the_checker_catches_a_planted_name(tmp_path):
    """The check above can fail: a copy of the page with a name that does not exist, a module that does not exist
    and an attribute of a real class that does not exist is refused on each, and nothing else."""
    page = (ROOT / "docs/ARCHITECTURE.md").read_text()
    planted = tmp_path / "ARCHITECTURE.md"
    planted.write_text(page + "\nPlanted: `vlmrl.trainer.fit.no_such_step`, `vlmrl.no_such_package.module`,\n"
                       "`vlmrl.trainer.run.Placement.no_such_method(run)` and `python -m vlmrl.trainer.nowhere`.\n")
    problems = missing_names(planted.read_text())
    assert problems == [
        "`vlmrl.trainer.fit.no_such_step`: vlmrl.trainer.fit has no 'no_such_step'",
        "`vlmrl.no_such_package.module`: vlmrl has no 'no_such_package'",
        "`vlmrl.trainer.run.Placement.no_such_method`: vlmrl.trainer.run.Placement has no 'no_such_method'",
        "`vlmrl.trainer.nowhere`: vlmrl.trainer has no 'nowhere'",
    ]


def test_the_checker_reads_only_code_spans_and_whole_paths():
    """Prose and fenced blocks are not read (only backtick spans); a path ends where the identifier does."""
    text = ("vlmrl.not_checked in prose. `vlmrl.batch.padding.pad_sample(prompt, ids)` and `python -m\n"
            "vlmrl.alignment.compare A.jsonl` and `vlmrl/<package>/config.py` and `vlmrl.<package>.config` and\n"
            "```\nvlmrl.not_checked_either   in a fenced block\n```\nand `vlmrl.trainer.fit`.")
    assert named_paths(text) == ["vlmrl.batch.padding.pad_sample", "vlmrl.alignment.compare", "vlmrl.trainer.fit"]
    assert missing_names(text) == []


def test_a_module_that_fails_to_import_is_a_finding(tmp_path, monkeypatch):
    """A module that exists but fails to import (a missing dependency) is reported as such, not as a missing name."""
    package = tmp_path / "vlmrl_planted"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "broken.py").write_text("import no_such_dependency_vlmrl_planted\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    why = resolve("vlmrl_planted.broken.Name")
    assert why is not None and why.startswith("importing vlmrl_planted.broken") and "no_such_dependency" in why, why
