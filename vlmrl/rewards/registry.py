"""Choosing the reward function (`reward.function`): a built-in, dispatch by data_source, or the user's own.

Specs:
  - ``""`` or ``"auto"``: per sample by its data_source (`synthetic/...` -> synthetic; geometry3k -> geo3k).
  - ``"geo3k"``, ``"synthetic"``: that built-in for every sample.
  - ``"none"``: no rule reward (every sample scores 0), for a judge-only reward (reward.judge, weight 1).
  - ``"path/to/file.py:function"``: a function loaded from a file (by path, not from sys.path), or
    ``"package.module:function"`` for an importable module. It must take verl's keyword arguments
    (data_source, solution_str, ground_truth, extra_info); see `vlmrl.rewards.base`.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Iterable
from typing import Any

from vlmrl.rewards import geo3k, synthetic
from vlmrl.rewards.base import RewardFn
from vlmrl.rewards.config import NO_RULE


def no_rule_reward(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """reward.function=none: every sample's rule score is 0 (the judge gives the reward).

    >>> no_rule_reward("captions", "a red square", None)
    0.0
    """
    return 0.0


BUILTINS: dict[str, RewardFn] = {"geo3k": geo3k.compute_score, "synthetic": synthetic.compute_score,
                                 NO_RULE: no_rule_reward}
AUTO = ("", "auto")
GEO3K_SOURCES = ("hiyouga/geometry3k", "geometry3k", "geo3k")
USER_MODULE_PREFIX = "vlmrl_user_reward_"
"""Module names of reward files loaded by path start with this (a reward worker process loads the same files)."""


def builtin_for(data_source: str) -> str:
    """The built-in reward for a data_source; ValueError saying what to set when there is none.

    >>> builtin_for("synthetic/colour"), builtin_for("hiyouga/geometry3k")
    ('synthetic', 'geo3k')
    """
    source = (data_source or "").lower()
    if source == "synthetic" or source.startswith("synthetic/"):
        return "synthetic"
    if source in GEO3K_SOURCES or source.endswith("/geometry3k") or source.endswith("/geo3k"):
        return "geo3k"
    raise ValueError(f"no built-in reward for data_source {data_source!r}: set reward.function to "
                     f"path/to/file.py:function (or one of {sorted(BUILTINS)} to score every row with it)")


def auto_compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None):
    """Scores with the built-in that matches the sample's data_source (see `builtin_for`).

    >>> auto_compute_score("synthetic/colour", "Blue", "blue")["score"]
    1.0
    """
    return BUILTINS[builtin_for(data_source)](data_source=data_source, solution_str=solution_str,
                                              ground_truth=ground_truth, extra_info=extra_info)


def get_reward_fn(spec: str = "auto", data_sources: Iterable[str] | None = None) -> RewardFn:
    """The reward function a spec names (see the module docstring).

    With `data_sources` (e.g. `RLDataset.data_sources()` of the train and val sets), "auto" is checked to cover every
    one of them now, so a missing reward stops the run at start instead of failing every sample.
    """
    spec = spec.strip()
    if spec in AUTO:
        for source in data_sources or ():
            builtin_for(source)
        return auto_compute_score
    if spec in BUILTINS:
        return BUILTINS[spec]
    if ":" in spec:
        return load_user_fn(spec)
    raise ValueError(f"reward.function={spec!r}: use auto, one of {sorted(BUILTINS)}, or path/to/file.py:function")


def load_user_fn(spec: str) -> RewardFn:
    """`path/to/file.py:function` (loaded by file path) or `package.module:function`; checked for verl's signature."""
    location, _, name = spec.rpartition(":")
    if not location or not name:
        raise ValueError(f"reward.function={spec!r}: expected path/to/file.py:function")
    if location.endswith(".py") or os.sep in location:
        module = load_file(location)
    else:
        module = importlib.import_module(location)
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ValueError(f"reward.function={spec!r}: {location} has no function {name!r} (functions there: {found})")
    try:
        inspect.signature(fn).bind(data_source="", solution_str="", ground_truth=None, extra_info={})
    except TypeError as err:
        raise ValueError(f"reward.function={spec!r}: {name}{inspect.signature(fn)} cannot be called as "
                         f"{name}(data_source=, solution_str=, ground_truth=, extra_info=) ({err})") from None
    return fn


def load_file(path: str):
    """The module of a reward file, loaded once per path (the same module name in every process)."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"reward function file {path} does not exist")
    # A unique module name per file, registered in sys.modules so pickling and dataclasses in the file work (a
    # reward worker process loads the file under the same name, so a function pickled here unpickles there).
    module_name = USER_MODULE_PREFIX + hashlib.sha256(path.encode()).hexdigest()[:12]
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module
