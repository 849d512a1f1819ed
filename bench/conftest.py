"""Benchmarks: pytest-benchmark over q12drv's host path (``python -m pytest bench``; see bench/README.md).

The device is ``Q12DRV_DRIVER`` (``cuda`` or ``emu``), else the GPU when there is one. Every
benchmark synchronizes before it starts timing, so one benchmark's queued work never lands in
another's numbers.
"""

import pytest

from bench.inputs import StagingCase, open_bench_device


@pytest.fixture(scope="session")
def dev():
    d = open_bench_device()
    yield d
    d.close()


@pytest.fixture(scope="session")
def staging_cases(dev):
    """(n, tokens per stream) -> StagingCase, built once per session."""
    cases = {}

    def get(n, tokens):
        if (n, tokens) not in cases:
            cases[(n, tokens)] = StagingCase(dev, n, tokens)
        return cases[(n, tokens)]

    yield get
    for c in cases.values():
        c.close()

