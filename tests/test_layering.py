"""The import graph of `vlmrl/` points only downward, and has no circle.

Read from the source with `ast` (every import counts: module level, function-local and TYPE_CHECKING ones alike, since
a function-local import is how a circle is usually held open). The allowed layering is written here, top to bottom:
a module may import modules of its own package, or of a package in a LOWER layer; packages that share a layer are
siblings and may not import each other. `vlmrl.distributed` is held to more: it imports nothing of `vlmrl.trainer`,
not even the config leaf `vlmrl.trainer.config`.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import vlmrl

ROOT = Path(vlmrl.__file__).parent
CONFIG_LEAVES = "config leaves"  # the modules vlmrl.<pkg>.config: one dataclass per component and its own checks

# Top to bottom. Each entry is a package (`vlmrl.<pkg>`) or a top-level module (`vlmrl.<module>`).
LAYERS: list[tuple[str, ...]] = [
    ("vlmrl.train", "vlmrl.plan"),  # the entry points: python -m vlmrl.train | python -m vlmrl.plan (memory plan)
    ("vlmrl.trainer",),  # the fit loop, run setup, validation (and the artifact it writes), checkpoints, metrics
    ("vlmrl.distributed", "vlmrl.alignment"),  # a service the loop drives | the compare tool (never the trainer)
    ("vlmrl.agent", "vlmrl.actor"),  # multi-turn rollout | the policy, its logprobs and update
    ("vlmrl.config",),  # the run config: composes the sections' own config modules, checks across sections
    # the judge reward launches its server with the rollout engines' own argument builders (one place says how an
    # engine starts), so rewards sits above rollout; nothing in rollout scores a response
    ("vlmrl.rewards",),
    ("vlmrl.batch", "vlmrl.data", "vlmrl.rollout"),
    ("vlmrl.processors",),
    ("vlmrl.algorithms", "vlmrl.models"),
    (CONFIG_LEAVES,),
    ("vlmrl.types", "vlmrl.utils", "vlmrl.atomic", "vlmrl"),
]


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def resolve(name: str, known: dict[str, Path]) -> str | None:
    """The vlmrl module an import names (the longest known prefix), None outside vlmrl."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def from_module(node: ast.ImportFrom, package: str) -> str:
    """The module a `from ... import` reads from, a relative one resolved against `package`."""
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    return base


def import_edges() -> dict[str, set[str]]:
    known = modules()
    edges: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        package = package_of(name, path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = from_module(node, package)
                targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
            for target in targets:
                if target == "vlmrl" or target.startswith("vlmrl."):
                    resolved = resolve(target, known)
                    if resolved and resolved != name:
                        edges[name].add(resolved)
    for name in edges:  # `from vlmrl.x import y` where y is a module already names vlmrl.x.y; drop the bare package
        edges[name] = {t for t in edges[name] if not any(o.startswith(t + ".") for o in edges[name]) or t == "vlmrl"}
    return edges


def unit(module: str) -> str:
    """What a module's layer is decided by: its package (or itself at top level); config modules of a package are
    the config leaves."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[-1] == "config":
        return CONFIG_LEAVES
    return ".".join(parts[:2])


def layer_of(name: str) -> int:
    for index, layer in enumerate(LAYERS):
        if name in layer:
            return index
    raise AssertionError(f"{name} is in no layer of LAYERS: add it where it belongs")


def test_every_module_has_a_layer():
    for module in modules():
        layer_of(unit(module))


def test_imports_point_down():
    upward = []
    for source, targets in import_edges().items():
        for target in targets:
            a, b = unit(source), unit(target)
            if a != b and layer_of(a) >= layer_of(b):
                upward.append(f"{source} -> {target} ({a}: layer {layer_of(a)}, {b}: layer {layer_of(b)})")
    assert not upward, "imports that do not point down the layering:\n  " + "\n  ".join(sorted(upward))


def test_no_import_circle():
    edges = import_edges()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    assert not circles, "import circles:\n  " + "\n  ".join(" <-> ".join(c) for c in circles)


def origin(module: str, name: str, known: dict[str, Path], depth: int = 8) -> str:
    """The vlmrl module that defines what `from module import name` gives: followed through modules that import it
    and pass it on (`vlmrl.config` passes on `TrainerConfig`, imported from `vlmrl.trainer.config`)."""
    if f"{module}.{name}" in known:
        return f"{module}.{name}"
    path = known[module]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and depth > 0:  # depth: a circle of passing-on stops
            for alias in node.names:
                source = resolve(from_module(node, package_of(module, path)), known)
                if (alias.asname or alias.name) == name and source:
                    return origin(source, alias.name, known, depth - 1)
    return module


def imports_of_the_trainer(package: str) -> list[str]:
    """Every arrow from a module of `package` to one of vlmrl.trainer: direct imports (its config module included,
    which the layering lets through as a config leaf) and trainer names taken from a module that passes them on."""
    known = modules()
    arrows = []
    for source, targets in import_edges().items():
        if source != package and not source.startswith(package + "."):
            continue
        arrows += [f"{source} -> {target}" for target in targets if target.startswith("vlmrl.trainer")]
        path = known[source]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            module = resolve(from_module(node, package_of(source, path)), known) if isinstance(
                node, ast.ImportFrom) else None
            if module is None or module.startswith("vlmrl.trainer"):
                continue  # outside vlmrl, or a direct import: counted above
            for alias in node.names:
                defined = origin(module, alias.name, known)
                if defined.startswith("vlmrl.trainer"):
                    arrows.append(f"{source} -> {defined} (as {module}.{alias.name})")
    return sorted(arrows)


def test_distributed_imports_nothing_of_the_trainer():
    """The Ray workers are a service the trainer drives: what they need of a run (the cluster, the engine's
    options) comes as their own records (`ClusterSpec`, `EngineSpec`), not as the trainer's config."""
    arrows = imports_of_the_trainer("vlmrl.distributed")
    assert not arrows, "vlmrl.distributed imports the trainer:\n  " + "\n  ".join(arrows)


def copy_of_the_package(tmp_path: Path, monkeypatch) -> Path:
    """A copy of vlmrl/ that the checks read instead of the real one (to plant imports in)."""
    fake = tmp_path / "vlmrl"
    for source in ROOT.rglob("*.py"):
        target = fake / source.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(source.read_text())
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake)
    return fake


def test_the_checker_sees_a_planted_trainer_import_in_distributed(tmp_path, monkeypatch):
    """The check above can fail: a config-leaf import of the trainer, and the same class taken through
    `vlmrl.config`, are both caught."""
    fake = copy_of_the_package(tmp_path, monkeypatch)
    (fake / "distributed" / "planted.py").write_text("from vlmrl.trainer.config import TrainerConfig\n")
    (fake / "distributed" / "passed_on.py").write_text("from vlmrl.config import Config, TrainerConfig\n")
    assert imports_of_the_trainer("vlmrl.distributed") == [
        "vlmrl.distributed.passed_on -> vlmrl.trainer.config (as vlmrl.config.TrainerConfig)",
        "vlmrl.distributed.planted -> vlmrl.trainer.config",
    ]


def test_the_checker_sees_a_planted_upward_arrow(tmp_path, monkeypatch):
    """The checks above can fail: a rollout module importing the trainer is caught."""
    fake = copy_of_the_package(tmp_path, monkeypatch)
    (fake / "rollout" / "planted.py").write_text("from vlmrl.trainer import fit\n")
    edges = import_edges()
    assert "vlmrl.trainer.fit" in edges["vlmrl.rollout.planted"]
    assert layer_of(unit("vlmrl.rollout.planted")) > layer_of(unit("vlmrl.trainer.fit"))


MODULE_LINE_BUDGET = 600
"""The longest a module of vlmrl/ may be: past it, a module usually holds two jobs (split it by role)."""


def test_no_module_is_over_the_line_budget():
    package = Path(vlmrl.__file__).parent
    over = {str(path.relative_to(package.parent)): n for path in sorted(package.rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > MODULE_LINE_BUDGET}
    assert not over, f"modules over {MODULE_LINE_BUDGET} lines (split them by role): {over}"
