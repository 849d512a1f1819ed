import pytest


@pytest.fixture(scope="module")
def gpu():
    """The first CUDA device through q12drv's own driver, for the tests that go through q12drv's path."""
    from q12drv import open_device

    dev = open_device("cuda")
    yield dev
    dev.close()
