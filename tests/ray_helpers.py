"""A local Ray cluster for tests, in its own short temp folder (Unix socket paths are limited to ~107 characters, so
not under pytest's deep tmp_path), shut down and removed on exit."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile


@contextlib.contextmanager
def local_ray(num_cpus: int = 2):
    """Yields the cluster's temp folder."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp_dir = tempfile.mkdtemp(prefix="vlmrl-ray-")
    ray.init(num_cpus=num_cpus, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=True)
    try:
        yield temp_dir
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
