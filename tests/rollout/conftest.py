"""Fixtures of the rollout tests: the processor's request batch, the HF reference (one per session), and the engines
shared by the modules that test the same engine on the same family with the same settings.

Shared engines (`SharedEngines`): one started engine per (backend, embedded model), fp32 (bfloat16 for a family whose
CPU engines run only that), started by the first test that uses it and closed right after the last one. The tests of
this folder run grouped by the shared engine they use (`pytest_collection_modifyitems`): first those that use none, then
each engine's tests one after another, so that each is started once and only one is alive at a time. Both matter on CPU
(measured): two in-process vLLM engines break each other (vLLM's parallel state is global: "pipeline model parallel
group is not initialized"), and an idle SGLang scheduler polls at about half a core. A test that changes a shared engine
puts it back (weights, options) before it ends; a test that kills one (marked `ends_engine`) runs after the engine's
other tests, and a later test that needs it gets a fresh one. Under make test's workers the folder is three units
(`rollout_unit`: the Mixture-of-Experts families' engines, the later dense families' engines, the rest), which the
two workers take beside each other.
"""

from __future__ import annotations

import collections

import pytest

from tests.rollout.helpers import GREEDY, build_batch

VIDEO_MODELS = ("tiny", "tiny-qwen3-vl")
"""The embedded model of each family the video contract (tests.rollout.video_helpers) runs on."""

ENGINE_OPTIONS = {"dtype": "float32", "max_model_len": 1024, "timeout_s": 300}
"""What every shared engine is started with (fp32: the engines then equal HF token for token)."""

SHARED = {
    # (backend, embedded model): options beyond ENGINE_OPTIONS
    ("vllm", "tiny"): {},
    ("vllm", "tiny-qwen3-vl"): {},
    ("sglang", "tiny"): {},  # the multimodal embedding cache off (SGLANG_VLM_CACHE_SIZE_MB=0), salted hashes
    ("sglang", "tiny-qwen3-vl"): {},
    # the cache ON: the weight-versioned mm_hashes alone must keep old vision embeddings out
    ("sglang-server", "tiny"): {"vlm_cache_size_mb": 100},
    # Qwen3.5: bfloat16, its engines' only dtype on CPU
    ("vllm", "tiny-qwen3.5"): {"dtype": "bfloat16"},
    ("sglang", "tiny-qwen3.5"): {"dtype": "bfloat16"},
    ("sglang-server", "tiny-qwen3.5"): {"dtype": "bfloat16"},
    ("vllm", "tiny-glm4v"): {},
    ("sglang", "tiny-glm4v"): {},
    ("vllm", "tiny-internvl"): {},
    ("sglang", "tiny-internvl"): {},
    # launched servers of the other families: the `full` tier's family matrix (tests/rollout/test_family_contract.py)
    ("sglang-server", "tiny-qwen3-vl"): {},
    ("sglang-server", "tiny-glm4v"): {},
    ("sglang-server", "tiny-internvl"): {},
    # the Mixture-of-Experts families (their tests a unit of their own for make test's workers: `rollout_unit`)
    ("vllm", "tiny-qwen3-vl-moe"): {},
    ("sglang", "tiny-qwen3-vl-moe"): {},
    ("sglang-server", "tiny-qwen3-vl-moe"): {},
    ("vllm", "tiny-qwen3.5-moe"): {"dtype": "bfloat16"},
}
ENGINE_FIXTURES = {
    "vllm_qwen2_5_vl": ("vllm", "tiny"),
    "vllm_qwen3_vl": ("vllm", "tiny-qwen3-vl"),
    "sglang_qwen2_5_vl": ("sglang", "tiny"),
    "sglang_qwen3_vl": ("sglang", "tiny-qwen3-vl"),
    "sglang_server_qwen2_5_vl": ("sglang-server", "tiny"),
    "vllm_qwen3_5": ("vllm", "tiny-qwen3.5"),
    "sglang_qwen3_5": ("sglang", "tiny-qwen3.5"),
    "sglang_server_qwen3_5": ("sglang-server", "tiny-qwen3.5"),
    "vllm_glm4v": ("vllm", "tiny-glm4v"),
    "sglang_glm4v": ("sglang", "tiny-glm4v"),
    "vllm_internvl": ("vllm", "tiny-internvl"),
    "sglang_internvl": ("sglang", "tiny-internvl"),
    "vllm_qwen3_vl_moe": ("vllm", "tiny-qwen3-vl-moe"),
    "sglang_qwen3_vl_moe": ("sglang", "tiny-qwen3-vl-moe"),
}
VIDEO_ENGINE_FIXTURES = {"video_vllm": "vllm", "video_sglang": "sglang"}
"""The shared engine of a backend on the module's current `video_model_path` family."""


class SharedEngines:
    """The started shared engines of the session, by (backend, embedded model)."""

    def __init__(self) -> None:
        self.running: dict[tuple[str, str], object] = {}
        self.starts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.last_user: dict[tuple[str, str], str] = {}
        """The node id of the last test (in the session's order) that uses each engine: closed after it."""
        self.log_folder = None

    def get(self, backend: str, model: str):
        from vlmrl.models.tiny import ensure_built
        from vlmrl.rollout.registry import get_backend
        from vlmrl.utils.processes import is_alive

        key = (backend, model)
        engine = self.running.get(key)
        if engine is not None and not all(is_alive(pid) for pid in engine.engine_pids):
            self.close(key)  # a test killed it
            engine = None
        if engine is None:
            options = dict(ENGINE_OPTIONS, **SHARED[key])
            if backend == "sglang-server":  # the server's own log, named in its errors
                options["log_file"] = str(self.log_folder / f"{backend}-{model}.log")
            engine = self.running[key] = get_backend(backend, str(ensure_built(model)), **options)
            self.starts[key] += 1
        return engine

    def close(self, key: tuple[str, str]) -> None:
        engine = self.running.pop(key, None)
        if engine is not None:
            engine.close()

    def close_all(self) -> None:
        for key in list(self.running):
            self.close(key)


ENGINES = SharedEngines()


def shared_engines_of(item) -> set[tuple[str, str]]:
    """The shared engines a test uses, read from the fixtures it requests (directly or through others), or from its
    class (a family-matrix class names its engine: `shared_engine`)."""
    keys = {ENGINE_FIXTURES[name] for name in item.fixturenames if name in ENGINE_FIXTURES}
    if getattr(getattr(item, "cls", None), "shared_engine", None):
        keys.add(item.cls.shared_engine)
    video = [VIDEO_ENGINE_FIXTURES[name] for name in item.fixturenames if name in VIDEO_ENGINE_FIXTURES]
    if video:
        keys |= {(backend, item.callspec.params["video_model_path"]) for backend in video}
    return keys


SECOND_UNIT_MODELS = ("tiny-qwen3.5", "tiny-glm4v", "tiny-internvl")
"""The embedded models whose shared engines make up the unit "rollout:families" (the families added after the first
two: Qwen2.5-VL and Qwen3-VL, whose engines stay in "rollout" with the tests that use no shared engine)."""


def rollout_unit(item) -> str:
    """This folder's work unit for the test workers (tests/conftest.py, `distribution_unit`): "rollout:moe" for a
    test that uses a shared engine of a Mixture-of-Experts family, "rollout:families" for one on the later dense
    families' engines (`SECOND_UNIT_MODELS`), "rollout" for the others. The units run beside each other on make
    test's two workers; one alone would hold every engine start of the folder (measured: the suite's longest
    path). Every user of a shared engine is in one unit, as its close after the last user is decided per process."""
    from vlmrl.models.tiny.registry import VARIANTS

    models = {model for _, model in shared_engines_of(item)}
    if any(VARIANTS[model].experts for model in models):
        return "rollout:moe"
    return "rollout:families" if models & set(SECOND_UNIT_MODELS) else "rollout"


def pytest_collection_modifyitems(config, items):
    """This folder's tests grouped by the shared engine they use (see the module's docstring); collection order kept
    within a group, except that the tests which end the engine go last. Under make test the folder is three units
    (`rollout_unit`, marked by tests/conftest.py), each a block of the list: each is sorted among its own places."""
    places: dict[str, list[int]] = {}
    for index, item in enumerate(items):
        if item.nodeid.startswith("tests/rollout/"):
            unit = item.get_closest_marker("xdist_group")
            places.setdefault(unit.args[0] if unit else "", []).append(index)
    order = list(SHARED)

    def group(pair):
        index, item = pair
        engines = sorted(order.index(key) + 1 for key in shared_engines_of(item))
        return (engines[0] if engines else 0, item.get_closest_marker("ends_engine") is not None, index)

    for unit, indices in places.items():
        assert indices == list(range(indices[0], indices[-1] + 1)), \
            f"tests/rollout's tests {'of unit ' + unit + ' ' if unit else ''}are not collected together"
        items[indices[0]:indices[-1] + 1] = [item for _, item in sorted(
            enumerate(items[indices[0]:indices[-1] + 1]), key=group)]
    users: dict[tuple[str, str], set[str]] = {}
    for item in items:
        for key in shared_engines_of(item) if item.nodeid.startswith("tests/rollout/") else ():
            users.setdefault(key, set()).add(rollout_unit(item))
    split = {key: units for key, units in users.items() if len(units) > 1}
    assert not split, f"a shared engine used by tests of two units (each would start it): {split}"


def pytest_collection_finish(session):
    for item in session.items:
        for key in shared_engines_of(item):
            ENGINES.last_user[key] = item.nodeid


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield  # the test's own fixtures torn down first
    for key in [key for key, nodeid in ENGINES.last_user.items() if nodeid == item.nodeid]:
        ENGINES.close(key)
    return result


@pytest.fixture(scope="session")
def shared_engines(tmp_path_factory) -> SharedEngines:
    ENGINES.log_folder = tmp_path_factory.mktemp("shared-engines")
    yield ENGINES
    ENGINES.close_all()


@pytest.fixture(scope="module")
def vllm_qwen2_5_vl(shared_engines):
    return shared_engines.get("vllm", "tiny")


@pytest.fixture(scope="module")
def vllm_qwen3_vl(shared_engines):
    return shared_engines.get("vllm", "tiny-qwen3-vl")


@pytest.fixture(scope="module")
def sglang_qwen2_5_vl(shared_engines):
    return shared_engines.get("sglang", "tiny")


@pytest.fixture(scope="module")
def sglang_qwen3_vl(shared_engines):
    return shared_engines.get("sglang", "tiny-qwen3-vl")


@pytest.fixture(scope="module")
def sglang_server_qwen2_5_vl(shared_engines):
    return shared_engines.get("sglang-server", "tiny")


@pytest.fixture(scope="module")
def vllm_qwen3_5(shared_engines):
    return shared_engines.get("vllm", "tiny-qwen3.5")


@pytest.fixture(scope="module")
def sglang_qwen3_5(shared_engines):
    return shared_engines.get("sglang", "tiny-qwen3.5")


@pytest.fixture(scope="module")
def sglang_server_qwen3_5(shared_engines):
    return shared_engines.get("sglang-server", "tiny-qwen3.5")


@pytest.fixture(scope="module")
def vllm_glm4v(shared_engines):
    return shared_engines.get("vllm", "tiny-glm4v")


@pytest.fixture(scope="module")
def sglang_glm4v(shared_engines):
    return shared_engines.get("sglang", "tiny-glm4v")


@pytest.fixture(scope="module")
def vllm_internvl(shared_engines):
    return shared_engines.get("vllm", "tiny-internvl")


@pytest.fixture(scope="module")
def sglang_internvl(shared_engines):
    return shared_engines.get("sglang", "tiny-internvl")


@pytest.fixture(scope="module")
def vllm_qwen3_vl_moe(shared_engines):
    return shared_engines.get("vllm", "tiny-qwen3-vl-moe")


@pytest.fixture(scope="module")
def sglang_qwen3_vl_moe(shared_engines):
    return shared_engines.get("sglang", "tiny-qwen3-vl-moe")


def _embedded_name(model_path: str) -> str:
    from vlmrl.models.tiny import ensure_built

    return next(name for name in VIDEO_MODELS if str(ensure_built(name)) == model_path)


@pytest.fixture(scope="module")
def video_vllm(shared_engines, video_model_path):
    return shared_engines.get("vllm", _embedded_name(video_model_path))


@pytest.fixture(scope="module")
def video_sglang(shared_engines, video_model_path):
    return shared_engines.get("sglang", _embedded_name(video_model_path))


class References:
    """One transformers reference per embedded model for the session, in its engines' dtype (float32; bfloat16 for a
    family whose CPU engines run only that), with its nine requests and their greedy results: what every engine
    test of that model compares with, whichever module or matrix class asks. A bfloat16 family's float32 reference
    too, where a test asks for it (the drift band of Qwen3.5-MoE: how far bfloat16 alone moves transformers)."""

    def __init__(self) -> None:
        self.backends: dict[tuple[str, str], object] = {}
        self.batches: dict[str, list] = {}
        self.greedy: dict[str, list] = {}
        self.videos: dict[tuple[str, float], tuple[list, list]] = {}

    def hf(self, model_path: str, dtype: str | None = None):
        """The reference in `dtype` (None: the family's CPU engine dtype, float32 unless it runs only another)."""
        if dtype is None:
            from vlmrl.models.families import family_for_path

            dtype = family_for_path(model_path).engines.cpu_engine_dtype or "float32"
        if (model_path, dtype) not in self.backends:
            from vlmrl.rollout.registry import get_backend

            self.backends[model_path, dtype] = get_backend("hf", model_path, dtype=dtype, max_model_len=1024,
                                                           timeout_s=300)
        return self.backends[model_path, dtype]

    def batch(self, model_path: str) -> list:
        if model_path not in self.batches:
            self.batches[model_path] = build_batch(self.hf(model_path).processor)
        return self.batches[model_path]

    def hf_greedy(self, model_path: str) -> list:
        if model_path not in self.greedy:
            self.greedy[model_path] = self.hf(model_path).generate(self.batch(model_path), GREEDY)
        return self.greedy[model_path]

    def hf_videos(self, model_path: str, fps: float) -> tuple[list, list]:
        """(seven video requests with frames at `fps`, one also holding an image; the reference's greedy results)."""
        if (model_path, fps) not in self.videos:
            from tests.rollout.video_helpers import video_batch

            requests = video_batch(model_path, fps)
            self.videos[model_path, fps] = requests, self.hf(model_path).generate(requests, GREEDY)
        return self.videos[model_path, fps]

    def close(self) -> None:
        for backend in self.backends.values():
            backend.close()
        self.backends.clear()


@pytest.fixture(scope="session")
def references():
    refs = References()
    yield refs
    refs.close()


@pytest.fixture(scope="session")
def hf(references, tiny_model_path):
    """The transformers reference backend of `tiny_model_path` (fp32; a folder's own model in its folder). Tests that
    edit its weights restore them."""
    return references.hf(tiny_model_path)


@pytest.fixture(scope="session")
def batch(references, tiny_model_path):
    """Nine requests (0, 1 and 2 images of different sizes) built by vlmrl.processors from dataset rows."""
    return references.batch(tiny_model_path)


@pytest.fixture(scope="session")
def hf_greedy(references, tiny_model_path):
    """HF's greedy results for the batch (with top-5 logprobs): what every engine must reproduce."""
    return references.hf_greedy(tiny_model_path)


@pytest.fixture(scope="module", params=VIDEO_MODELS)
def video_model_path(request) -> str:
    """Each embedded family's model in turn (module scope: one engine per family at a time)."""
    from vlmrl.models.tiny import ensure_built

    return str(ensure_built(request.param))


@pytest.fixture(scope="module")
def video_hf(video_model_path):
    """transformers (fp32) on the module's current model: the reference."""
    from vlmrl.rollout.registry import get_backend

    with get_backend("hf", video_model_path, dtype="float32", max_model_len=1024, timeout_s=300) as backend:
        yield backend
