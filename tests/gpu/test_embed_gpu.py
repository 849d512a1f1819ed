"""On the GPU: what the emulated tests of embedding check (tests/test_threads_devices.py, tests/test_caller_memory.py),
through the real driver: the driver's view of pointers and streams, arenas and pinned rings over torch's memory,
torch's streams, threads, and the tensor-parallel example on every GPU there is."""

import threading

import numpy as np
import pytest

from q12drv import ScratchArena, make_scratch_plan
from q12drv.core.pinned import PinnedRing
from tests.test_threads_devices import COUNTS, attention_pass, in_thread

pytestmark = pytest.mark.gpu


def test_the_driver_knows_pointers_and_streams(gpu):
    buf = gpu.alloc(1 << 20)
    where = gpu.driver.pointer_info(int(buf.ptr) + 4096)
    assert (where.kind, where.ordinal, where.start) == ("device", gpu.ordinal, int(buf.ptr))
    assert where.nbytes >= 1 << 20
    pinned = gpu.pinned(4096)
    assert gpu.driver.pointer_info(pinned.addr).kind == "host"
    assert gpu.driver.pointer_info(np.zeros(4096, np.uint8).ctypes.data) is None  # pageable host memory
    s = gpu.new_stream()
    assert gpu.driver.stream_device(s.raw) == gpu.ordinal and gpu.driver.stream_device(gpu.driver.stream_from_handle(0)) is None
    assert gpu.as_stream(s.__cuda_stream__()[1]) is not None
    buf.free()
    pinned.free()


def test_an_arena_over_a_torch_tensor(gpu):
    torch = pytest.importorskip("torch")
    need = make_scratch_plan(COUNTS, 0, False).total_bytes
    expected = attention_pass(gpu, 7)
    workspace = torch.zeros(ScratchArena.buffer_bytes(need), dtype=torch.uint8, device=f"cuda:{gpu.ordinal}")
    torch.cuda.synchronize()
    with ScratchArena.over(gpu, workspace) as arena:
        assert not arena.owns_memory and arena.base == workspace.data_ptr()
        assert attention_pass(gpu, 7, arena=arena) == expected
        assert arena.guard_intact()
    with pytest.raises(ValueError, match="no device memory the cuda driver knows|host memory"):
        ScratchArena.over(gpu, torch.zeros(ScratchArena.buffer_bytes(need), dtype=torch.uint8))  # a CPU tensor
    with pytest.raises(ValueError, match="not 64-byte aligned"):
        ScratchArena.over(gpu, workspace[8:])


def test_torch_streams_and_a_pinned_ring_over_a_pinned_tensor(gpu):
    torch = pytest.importorskip("torch")
    expected = attention_pass(gpu, 5)
    s = torch.cuda.Stream(device=gpu.ordinal)
    assert attention_pass(gpu, 5, s) == expected  # .cuda_stream (or __cuda_stream__ in newer torch)
    assert attention_pass(gpu, 5, torch.cuda.current_stream(gpu.ordinal)) == expected
    pinned = torch.zeros(1 << 16, dtype=torch.uint8).pin_memory()
    ring = PinnedRing.over(gpu, pinned)
    assert not ring.owns_memory and ring.acquire(1024).addr >= pinned.data_ptr()
    ring.close()
    with pytest.raises(ValueError, match="not page-locked"):
        PinnedRing.over(gpu, torch.zeros(1 << 16, dtype=torch.uint8))


def test_cuda_core_buffers_and_streams(gpu):
    """cuda.core's objects where they fit q12drv's seams: an arena over a cuda.core Buffer (DLPack), a pass on a
    cuda.core Stream (``__cuda_stream__``), and q12drv's own stream taken by cuda.core."""
    core = pytest.importorskip("cuda.core")
    expected = attention_pass(gpu, 3)
    device = core.Device(gpu.ordinal)
    device.set_current()
    need = make_scratch_plan(COUNTS, 0, False).total_bytes
    stream = device.create_stream()
    buf = device.memory_resource.allocate(ScratchArena.buffer_bytes(need), stream=stream)  # keyword-only in 1.x
    with ScratchArena.over(gpu, buf) as arena:
        assert arena.base == int(buf.handle) and not arena.owns_memory
        assert attention_pass(gpu, 3, stream, arena=arena) == expected
    wrapped = device.create_stream(gpu.new_stream())  # q12drv's Stream exports __cuda_stream__
    assert attention_pass(gpu, 3, wrapped) == expected
    stream.sync()
    buf.close(stream)


def test_a_pass_on_torch_tensors_between_torch_ops_and_replayed_from_a_torch_graph(gpu):
    """A pass on torch tensors and torch's current stream, its attention layer between torch ops (the projections
    before, a reduction after): eager equals the same pass on raw addresses; captured with ``torch.cuda.graph``
    (``Q12Pass.stream`` set to the capture stream) and replayed, it gives the eager result again."""
    torch = pytest.importorskip("torch")
    from q12drv import Q12Pass
    from tests.helpers import make_streams
    from tests.test_threads_devices import SHAPE, STARTS

    dev = f"cuda:{gpu.ordinal}"
    hq, hkv, d = SHAPE.num_q_heads, SHAPE.num_kv_heads, SHAPE.head_dim
    t = sum(COUNTS)
    g = torch.Generator(device=dev).manual_seed(3)
    x = torch.randn(t, 256, device=dev, generator=g, dtype=torch.bfloat16)
    wq, wk, wv = (torch.randn(256, h * d, device=dev, generator=g, dtype=torch.bfloat16) * 0.06 for h in (hq, hkv, hkv))
    streams, tables = make_streams(gpu, COUNTS, STARTS)
    nb = int(max(s.block_table.max() for s in streams)) + 1
    pools = [torch.zeros(nb, 16, hkv, d, device=dev, dtype=torch.bfloat16) for _ in range(2)]
    o = torch.empty(t, hq, d, device=dev, dtype=torch.bfloat16)
    main = torch.cuda.current_stream(gpu.ordinal)
    with ScratchArena(gpu, make_scratch_plan(COUNTS, 0, False).total_bytes) as arena:
        q12 = Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, head_dim=d, stream=main)

        def layer():
            q, k, v = ((x @ w).view(t, -1, d) for w in (wq, wk, wv))  # torch ops on torch's stream
            q12.attention_layer(q, k, v, pools[0], pools[1], o, SHAPE)
            return o.float().square().sum(-1)  # a torch op reading q12drv's output

        eager = layer().clone()
        # the same pass on raw addresses, fed the same projections
        q, k, v = ((x @ w).view(t, -1, d).contiguous() for w in (wq, wk, wv))
        o_raw = torch.empty_like(o)
        kp, vp = (torch.zeros_like(p) for p in pools)
        q12.attention_layer(q.data_ptr(), k.data_ptr(), v.data_ptr(), kp.data_ptr(), vp.data_ptr(), o_raw.data_ptr(),
                            SHAPE, num_blocks=nb)
        torch.cuda.synchronize()
        assert torch.equal(o, o_raw) and torch.equal(pools[0], kp) and torch.equal(pools[1], vp)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            q12.stream = torch.cuda.current_stream(gpu.ordinal)  # the capture stream
            captured = layer()
        q12.stream = main
        for p in pools:
            p.zero_()
        o.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager) and torch.equal(o, o_raw) and torch.equal(pools[0], kp)
    tables.free()


def test_threads_on_the_gpu(gpu):
    expected = attention_pass(gpu, 3)
    assert in_thread(attention_pass, gpu, 3) == expected  # a fresh thread: no context current there
    out, start = {}, threading.Barrier(2)

    def work(i):
        out[i] = attention_pass(gpu, 3, gpu.new_stream(), None, 1, start)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == {0: expected, 1: expected}


def test_the_tensor_parallel_example_on_every_gpu():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "tensor_parallel.py"
    spec = importlib.util.spec_from_file_location("tensor_parallel_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    result = mod.main(["--driver", "cuda"])
    assert result["ranks"] >= 1 and result["max_abs_diff"] <= 1e-2
