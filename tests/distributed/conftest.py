"""Shared fixtures of the multi-rank tests."""

import pytest

from megatron_p3o.runtime.parallel import Layout

from . import bodies


@pytest.fixture(scope="session")
def init_ckpts(pools, tmp_path_factory):
    """One random checkpoint per model family, written at TP=1 (DP=2)."""
    root = tmp_path_factory.mktemp("init")
    made = {}

    def get(family):
        if family not in made:
            path = str(root / family)
            pools(2).run(bodies.save_init, Layout(), family=family, out=path)
            made[family] = path
        return made[family]

    return get
