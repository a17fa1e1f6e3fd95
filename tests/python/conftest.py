"""Fresh random data each run; a failing test reports its seed, and DELTATRAIN_TEST_SEED replays it."""

import os
import secrets

import numpy as np
import pytest


@pytest.fixture
def rng(request):
    seed = int(os.environ.get("DELTATRAIN_TEST_SEED", secrets.randbits(32)))
    request.node.deltatrain_seed = seed
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seed = getattr(item, "deltatrain_seed", None)
    if report.failed and seed is not None:
        report.sections.append(("random seed", f"replay with DELTATRAIN_TEST_SEED={seed}"))
