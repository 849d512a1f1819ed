"""The per-SSM-layer ``h_state_ptrs`` upload (:meth:`~q12drv.core.staging.HStateSlot.upload`): host time and round trip."""

import pytest

from q12drv import ScratchArena
from q12drv.core.staging import reserve_h_state_slot

from bench.inputs import on_gpu
from bench.timing import round_trip


@pytest.mark.parametrize("wait", [False, True], ids=["host time", "round trip"])
@pytest.mark.parametrize("n", [1, 8, 64])
def test_h_state_upload(benchmark, dev, n, wait):
    benchmark.group = f"jit slot upload ({'round trip' if wait else 'host time'})"
    with ScratchArena(dev, 1 << 16) as arena:
        slot = reserve_h_state_slot(arena, n)
        ptrs = [0x7F00_0000_0000 + 4096 * b for b in range(n)]

        def upload():
            slot.upload(ptrs)

        fn = round_trip(dev, upload) if wait else upload
        benchmark.pedantic(fn, setup=dev.synchronize, rounds=300 if on_gpu(dev) else 5, iterations=1, warmup_rounds=2)
        dev.synchronize()
