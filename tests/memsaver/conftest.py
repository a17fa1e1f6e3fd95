"""Fresh random data each run; the seed is printed, so a failure's captured output shows it."""

import secrets

import numpy as np
import pytest


@pytest.fixture
def rng():
    seed = secrets.randbits(32)
    print(f"random seed {seed}")
    return np.random.default_rng(seed)
