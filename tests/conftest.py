"""Shared test setup: engine markers skip with a reason when the engine is missing, the gpu marker when there are not
enough CUDA devices; one tiny model per session."""

from __future__ import annotations

import importlib.util
import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_ENGINE_MODULES = {"vllm": "vllm", "sglang": "sglang", "ray": "ray"}


@pytest.hookimpl(tryfirst=True)  # before xdist reads the units' marks (tests/rollout's own order comes after)
def pytest_collection_modifyitems(config, items):
    """Engine and GPU markers skip with the reason; under `pytest -n N --dist loadgroup` (make test) the tests are
    put into the units the workers take (`distribution_units`)."""
    if _distributed_by_group(config):
        items[:] = distribution_units(items)
    for item in items:
        for marker, module in _ENGINE_MODULES.items():
            if marker in item.keywords and importlib.util.find_spec(module) is None:
                item.add_marker(pytest.mark.skip(
                    reason=f"{module} is not installed (run `make test`, which installs it)"))
        gpu = item.get_closest_marker("gpu")
        if gpu is not None:
            needed, found = gpu.kwargs.get("devices", 1), _cuda_devices()
            if found < needed:
                item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA device(s), found {found}: a CUDA-only "
                                                        "path, run on a GPU machine"))


def pytest_collection_finish(session):
    """Under --dist loadgroup every test must carry its unit in its id (pytest-xdist appends `@unit`): where a
    pytest release stops taking that, tests/rollout's shared engines would be started on every worker at once. Not
    with --collect-only, where xdist steps aside (no worker, no ids rewritten, nothing run)."""
    items = session.items
    if session.config.option.collectonly:
        return
    if _distributed_by_group(session.config) and items and "@" not in items[0].nodeid:
        raise pytest.UsageError("pytest-xdist did not group the tests (--dist loadgroup): this pytest is newer than "
                                "the range pyproject.toml's test extra allows; run `make setup`")


def _distributed_by_group(config) -> bool:
    """pytest-xdist runs the session with --dist loadgroup (a worker sees it as its `loadgroup` option)."""
    return config.pluginmanager.hasplugin("xdist") and bool(
        getattr(config.option, "dist", "no") == "loadgroup" or getattr(config.option, "loadgroup", False))


def distribution_unit(item) -> str:
    """The work unit of a test when the suite runs on several workers: tests/rollout as two, by the shared engines a
    test uses (the Mixture-of-Experts families' and the others'; each engine is started once per process and closed
    after its last user, tests/rollout/conftest.py `rollout_unit`); a test that uses a module-scoped fixture (an
    engine, a Ray cluster, a run's artifacts) with its module, which then sets it up once; the other Ray tests as one
    (one Ray cluster at a time); the other slow tests alone (end-to-end runs that share nothing with their
    neighbours); everything else by module."""
    path = item.nodeid.split("::")[0]
    if path.startswith("tests/rollout/"):
        from tests.rollout.conftest import rollout_unit

        return rollout_unit(item)
    scoped = [defs[-1].scope for defs in item._fixtureinfo.name2fixturedefs.values() if defs]
    if any(scope in ("module", "class", "package") for scope in scoped):
        return path
    if item.get_closest_marker("ray") is not None:
        return "ray"
    if item.get_closest_marker("slow") is not None:
        return "slow:" + item.nodeid.replace("[", "(").replace("]", ")").replace("@", "_")
    return path


def distribution_units(items: list) -> list:
    """`items` marked with their unit (xdist_group) and reordered unit by unit, the costliest first so that no long
    run starts last: the slow runs (alone, or a module's runs that share a fixture), then tests/rollout's units, the Ray tests and the simulated clusters
    (tests/cluster), then the rest in collection order. Within a unit the collection order is kept."""
    units: dict[str, list] = {}
    for item in items:
        unit = distribution_unit(item)
        item.add_marker(pytest.mark.xdist_group(unit))
        units.setdefault(unit, []).append(item)

    def rank(entry: tuple[int, str]) -> tuple[int, int]:
        index, unit = entry
        slow = any(item.get_closest_marker("slow") is not None for item in units[unit])
        long = unit in ("rollout", "rollout:moe", "rollout:families", "ray") or unit.startswith("tests/cluster/")
        return (0 if slow and not long else 1 if long else 2, index)

    order = sorted(enumerate(units), key=rank)
    return [item for _, unit in order for item in units[unit]]


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from vlmrl.models.tiny import ensure_built

    return str(ensure_built("tiny"))


@pytest.fixture(scope="session")
def tiny_qwen3_vl_path() -> str:
    from vlmrl.models.tiny import ensure_built

    return str(ensure_built("tiny-qwen3-vl"))


@pytest.fixture(scope="session")
def tiny_qwen3_5_path() -> str:
    from vlmrl.models.tiny import ensure_built

    return str(ensure_built("tiny-qwen3.5"))


TINY_FAMILIES = ("tiny", "tiny-qwen3-vl", "tiny-qwen3.5", "tiny-glm4v", "tiny-internvl")
"""One embedded model per supported family: Qwen2.5-VL, Qwen3-VL, Qwen3.5, GLM-4.1V and InternVL3.5."""


@pytest.fixture(scope="session", params=TINY_FAMILIES)
def tiny_family(request):
    """(model folder, its processor with prompts up to 64 tokens) for each embedded family in turn."""
    from vlmrl.data.config import DataConfig
    from vlmrl.models.tiny import ensure_built
    from vlmrl.processors.loading import load_processor

    path = str(ensure_built(request.param))
    return path, load_processor(path, DataConfig(max_prompt_length=64))


@pytest.fixture(scope="session")
def processor(tiny_model_path):
    """The tiny model's processor (prompts up to 64 tokens), shared by the actor, trainer and distributed tests."""
    from vlmrl.data.config import DataConfig
    from vlmrl.processors.loading import load_processor

    return load_processor(tiny_model_path, DataConfig(max_prompt_length=64))


@pytest.fixture(scope="session")
def synthetic_rows(tmp_path_factory):
    """Real synthetic rows written as parquet (tests/batches.py); tests/distributed/ uses a smaller set."""
    from tests.batches import synthetic_rows as write_synthetic_rows

    return write_synthetic_rows(tmp_path_factory.mktemp("data"), train_size=32, val_size=8)


_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Leave with the session's status once every report is written, without the interpreter's native teardown: as
    `vlmrl.train` does (`exit_without_native_teardown`), and for the same reason. After a whole suite the process
    holds the engines' and pyarrow's native thread pools; tearing them down at exit segfaulted once (status 139, on a
    fresh clone, after "1832 passed"), turning a green run red. atexit handlers still run, and output is flushed. A
    usage error leaves the ordinary way: pytest prints its message only after this hook (and no engine ran)."""
    if not _EXIT_STATUS or _EXIT_STATUS[-1] == pytest.ExitCode.USAGE_ERROR or os.environ.get("VLMRL_TEST_NATIVE_EXIT"):
        return
    import atexit
    import logging
    import sys

    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_EXIT_STATUS[-1])
