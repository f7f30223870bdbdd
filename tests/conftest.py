"""Fixtures shared by all test tiers: cached rank pools and the CUDA skip.

Pools are cached per world size for the whole session (spawning a rank costs
seconds on a 2-core CI machine), so a test asks for a world size, not a pool:

    @pytest.mark.parametrize("dist_pool", [1, 2, 4], indirect=True)
    def test_x(dist_pool): dist_pool.run(_job)

Jobs run in spawned processes and are pickled by reference, so they must be
module-level functions of importable modules; the repository root goes on
``sys.path`` here so ``tests.dist.<module>`` imports in every worker.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

# Plans must not depend on a calibration stored on this machine: tests (and the
# rank pools they spawn, which inherit the environment) use an empty cache.
os.environ["SBPFLOW_CACHE_DIR"] = tempfile.mkdtemp(prefix="sbpflow-test-cache-")

from sbpflow.testing import DistributedPool, get_pool, shutdown_all  # noqa: E402

_GPU_DIR = _ROOT / "tests" / "gpu"
_DIST_DIR = _ROOT / "tests" / "dist"
_DEFAULT_WORLD_SIZE = 2


def _is_gpu_test(item: pytest.Item) -> bool:
    return item.get_closest_marker("gpu") is not None or _GPU_DIR in Path(item.path).parents


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark tests/dist as ``dist`` (for ``-m "not dist"``); skip gpu tests without CUDA."""
    for item in items:
        if _DIST_DIR in Path(item.path).parents:
            item.add_marker(pytest.mark.dist)
    gpu_items = [item for item in items if _is_gpu_test(item)]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA; torch.cuda.is_available() is False here")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture
def dist_pool(request: pytest.FixtureRequest) -> DistributedPool:
    """The session's pool for ``request.param`` ranks (indirect parametrization), default 2."""
    return get_pool(getattr(request, "param", _DEFAULT_WORLD_SIZE))


@pytest.fixture
def pool() -> Callable[[int], DistributedPool]:
    """``pool(world_size)``: the session's pool of that size, for tests using several."""
    return get_pool


@pytest.fixture(scope="session", autouse=True)
def _shutdown_pools() -> Iterator[None]:
    yield
    shutdown_all()
