import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.rank_pool import PoolRegistry  # noqa: E402


@pytest.fixture(scope="session")
def pools():
    """``pools(n)`` -> a persistent :class:`RankPool` of n gloo ranks (shared by every test)."""
    reg = PoolRegistry()
    yield reg
    reg.close()
