"""`compare --backends X,Y`: run the same validation on two backends and write one artifact each.

Both sides run the trainer's own validation (`vlmrl.trainer.validation.run_validation`, what validate-only mode runs)
under the same config: the same rows, images resized by the same processor, the same prompt ids, sampling settings
and seeds (greedy by default: `rollout.val_temperature=0`); only `rollout.name` differs. The backends run one after
the other, each closed before the next starts, so two engines never compete for memory.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

logger = logging.getLogger(__name__)


def run_backends(backends: list[str], overrides: list[str], out_dir: Path) -> list[Path]:
    """Validate with each backend under the same config; returns the artifact paths
    (out_dir/val_a_<backend>.jsonl, out_dir/val_b_<backend>.jsonl). Config problems raise `UsageError` (exit 2)."""
    from vlmrl.alignment.compare import UsageError
    from vlmrl.config import ROLLOUT_BACKENDS, ConfigError, load_config

    unknown = [name for name in backends if name not in ROLLOUT_BACKENDS]
    if unknown:
        raise UsageError(f"unknown backend(s) {unknown}; choose two of {list(ROLLOUT_BACKENDS)}")
    configs = []
    for backend in backends:  # check both configs before starting any engine
        try:
            configs.append(load_config([*overrides, "trainer.val_only=true", f"rollout.name={backend}"]))
        except ConfigError as err:
            raise UsageError(str(err)) from None
    if configs[0].rollout.val_top_logprobs == 0:
        logger.warning("rollout.val_top_logprobs=0: divergences cannot be judged near-tie or real (set it to 5)")
    from vlmrl.trainer.validation import run_validation  # torch, transformers and engines load only from here

    paths = []
    for side, backend, config in zip("ab", backends, configs):
        path = out_dir / f"val_{side}_{backend}.jsonl"
        started = time.perf_counter()
        logger.info("side %s: validating %s with %s -> %s", side.upper(), config.actor.model_path, backend, path)
        result = run_validation(config, backend, artifact_path=path)
        logger.info("side %s: %s done in %.1f s, val/accuracy %.4f", side.upper(), backend,
                    time.perf_counter() - started, result.metrics["val/accuracy"])
        paths.append(path)
    return paths
