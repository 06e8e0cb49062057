"""The session's gloo worlds ([Note: reused worlds] in worldpool.py)."""
import pytest

from worldpool import Worlds


@pytest.fixture(scope="session")
def pool():
    pool = Worlds()
    yield pool
    pool.close()


# The test files that take longest (a fresh clone's `--durations`, two workers), run first, so
# that pytest-xdist's workers, given a file at a time in this order, end together instead of
# one finishing a long file alone. Only the order of files changes; within a file it is as written.
LONGEST_FIRST = ["test_cli.py", "test_compile.py", "test_hf_trainer.py", "test_hf_models.py", "test_trust.py",
                 "test_core.py", "test_grad_clearing.py", "test_tensor_parallel.py", "test_lightning.py",
                 "test_accelerate.py", "test_checkpoint.py", "test_reliability.py", "test_finetune.py",
                 "test_deepspeed.py"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))
