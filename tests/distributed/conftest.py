"""Shared pieces for distributed tests: fewer real synthetic rows than the other tests (batches: tests/batches.py),
and one local Ray cluster for the whole folder (with its own temp folder, torn down after its last test): each test
closes the workers it started, so the next one finds the cluster's two CPUs free."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from tests.batches import synthetic_rows as write_synthetic_rows


@pytest.fixture(scope="session")
def synthetic_rows(tmp_path_factory):
    return write_synthetic_rows(tmp_path_factory.mktemp("data"), train_size=16, val_size=4)


@pytest.fixture(scope="package")
def ray_cluster():
    """A local 2-CPU Ray cluster for the tests of this folder, started once, in its own short temp folder (Unix
    socket paths are limited to ~107 characters, so not under pytest's deep tmp_path)."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp_dir = tempfile.mkdtemp(prefix="vlmrl-ray-")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=True)
    try:
        yield temp_dir
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
