"""Shared pieces for distributed tests: fewer real synthetic rows than the other tests (batches: tests/batches.py),
and one local Ray cluster for the whole folder (with its own temp folder, torn down after its last test): each test
closes the workers it started, so the next one finds the cluster's two CPUs free."""

from __future__ import annotations

import pytest

from tests.batches import synthetic_rows as write_synthetic_rows
from tests.ray_helpers import local_ray


@pytest.fixture(scope="session")
def synthetic_rows(tmp_path_factory):
    return write_synthetic_rows(tmp_path_factory.mktemp("data"), train_size=16, val_size=4)


@pytest.fixture(scope="package")
def ray_cluster():
    """A local 2-CPU Ray cluster for the tests of this folder, started once."""
    with local_ray(num_cpus=2) as temp_dir:
        yield temp_dir
