"""The session's gloo worlds ([Note: reused worlds] in worldpool.py)."""
import pytest

from worldpool import Worlds


@pytest.fixture(scope="session")
def pool():
    pool = Worlds()
    yield pool
    pool.close()
