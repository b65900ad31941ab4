"""Code outside the family and processor rooms (`vlmrl/models/`, `vlmrl/processors/`) asks the family a question
(`family.experts`, `family.inputs.image_layout`), never its name: no module there reads a config's `model_type`,
compares a value with a model type or a family name, or keys a table by one. A new family is then one entry in
`FAMILIES`, not a hunt through the trainer for the places that test names.

Read from the source with `ast`: docstrings and messages may name a family; code may not test for one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import vlmrl
from vlmrl.models.families import FAMILIES

ROOT = Path(vlmrl.__file__).parent
ROOMS = ("models", "processors")  # where model types and family names are the subject


def _names() -> set[str]:
    return {name for family in FAMILIES for name in (family.name, *family.model_types)}


def _strings(node: ast.AST) -> list[str]:
    """The string constants of a comparison operand: the constant itself, or those of a tuple, list or set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for element in node.elts for s in _strings(element)]
    return []


def findings(path: Path, names: set[str]) -> list[str]:
    """`path:line: what` for each model-type read and each comparison with a family's name or model type."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    where = path.relative_to(ROOT.parent) if path.is_relative_to(ROOT.parent) else path.name
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "model_type":
            found.append(f"{where}:{node.lineno}: reads .model_type")
        elif isinstance(node, ast.Constant) and node.value == "model_type" and id(node) not in docstrings:
            found.append(f"{where}:{node.lineno}: reads 'model_type'")
        elif isinstance(node, ast.Compare):
            named = [s for operand in (node.left, *node.comparators) for s in _strings(operand) if s in names]
            if named:
                found.append(f"{where}:{node.lineno}: compares with {', '.join(map(repr, named))}")
        elif isinstance(node, ast.Dict):  # a table keyed by family: {"Qwen3-VL": ..., "Qwen3.5": ...}
            named = [s for key in node.keys if key is not None for s in _strings(key) if s in names]
            if named:
                found.append(f"{where}:{node.lineno}: keys a table by {', '.join(map(repr, named))}")
    return sorted(found, key=lambda line: int(line.split(":")[1]))


def test_no_code_outside_the_family_rooms_tests_a_model_type_or_a_family_name():
    names = _names()
    found = [f for path in sorted(ROOT.rglob("*.py"))
             if path.relative_to(ROOT).parts[0] not in ROOMS for f in findings(path, names)]
    assert not found, ("ask the family (a field or method of vlmrl.models.families.ModelFamily) instead of testing "
                       "its name:\n  " + "\n  ".join(found))


def test_the_checker_catches_each_kind(tmp_path):
    planted = tmp_path / "vlmrl_planted.py"
    planted.write_text('"""Qwen3.5 named in a docstring is fine."""\n'
                       'def f(config, family):\n'
                       '    """model_type in a docstring is fine."""\n'
                       '    a = config.model_type\n'
                       '    b = config["model_type"]\n'
                       '    c = family.name == "Qwen3.5"\n'
                       '    d = a in ("qwen2_vl", "llava")\n'
                       '    e = {"GLM-4.1V": 1, "other": 2}\n'
                       '    return f"{family.name}: not Qwen3-VL"\n')
    got = [line.split(": ", 1)[1] for line in findings(planted, _names())]
    assert got == ["reads .model_type", "reads 'model_type'", "compares with 'Qwen3.5'", "compares with 'qwen2_vl'",
                   "keys a table by 'GLM-4.1V'"], got
