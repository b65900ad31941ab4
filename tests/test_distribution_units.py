"""How make test's two workers split the suite (tests/conftest.py, `distribution_units`): what shares an engine or a
Ray cluster stays in one worker's unit (tests/rollout's shared engines in two: the Mixture-of-Experts families' and the
others'), the long runs go first."""

from __future__ import annotations

import torch  # noqa: F401 - before pytester's in-process run: the modules that run imports are dropped after it, and
# torch's C extension cannot be imported a second time in one process (the next test importing torch crashed)

from tests.conftest import distribution_unit, distribution_units

pytest_plugins = ["pytester"]

ENGINES = """
import pytest

@pytest.fixture(scope="module")
def vllm_qwen3_vl_moe():  # the name of a shared engine of a Mixture-of-Experts family (tests/rollout/conftest.py)
    return object()

def test_one():
    pass

def test_two():
    pass

def test_on_a_moe_engine(vllm_qwen3_vl_moe):
    pass
"""

ALPHA = """
import pytest

@pytest.fixture(scope="module")
def engine():
    return object()

def test_plain():
    pass

@pytest.mark.slow
def test_slow_with_the_modules_engine(engine):
    pass

@pytest.mark.slow
@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_slow_alone(backend):
    pass

@pytest.mark.ray
def test_ray():
    pass
"""


def test_units_keep_shared_engines_together_and_put_the_long_runs_first(pytester):
    pytester.makeini("[pytest]\nmarkers =\n  slow: s\n  ray: r\n")
    pytester.makepyfile(**{
        "tests/rollout/test_engine": ENGINES,
        "tests/alpha/test_alpha": ALPHA,
        "tests/beta/test_beta": "import pytest\n\n@pytest.mark.ray\ndef test_ray_too():\n    pass\n",
        "tests/gamma/test_gamma": "def test_quick():\n    pass\n"})
    items, _ = pytester.inline_genitems("tests")
    units = {item.nodeid.split("::")[1]: distribution_unit(item) for item in items}
    assert units["test_one"] == units["test_two"] == "rollout", "tests/rollout shares its engines: one worker"
    assert units["test_on_a_moe_engine"] == "rollout:moe", "the MoE families' shared engines: a unit of their own"
    assert units["test_slow_with_the_modules_engine"] == units["test_plain"] == "tests/alpha/test_alpha.py", \
        "a module-scoped fixture keeps its users in one unit, set up once"
    assert units["test_ray"] == units["test_ray_too"] == "ray", "one Ray cluster at a time"
    alone = [unit for name, unit in units.items() if name.startswith("test_slow_alone")]
    assert len(set(alone)) == 2 and all(unit.startswith("slow:") and "[" not in unit for unit in alone), alone

    ordered = [item.nodeid.split("::")[1] for item in distribution_units(items)]
    # the units holding a slow run first, in collection order (a module's whole unit with its slow test: its runs
    # share a fixture), then the long units, then the rest
    assert ordered[:4] == ["test_plain", "test_slow_with_the_modules_engine", "test_slow_alone[vllm]",
                           "test_slow_alone[sglang]"], ordered
    assert set(ordered[4:9]) == {"test_one", "test_two", "test_on_a_moe_engine", "test_ray", "test_ray_too"}, ordered
    assert ordered[9:] == ["test_quick"], ordered
