"""Threads and devices on the emulated driver: a context current per thread, several devices in one process,
passes running in several threads at once (bit-identical to running them one after the other)."""

import sys
import threading
from contextlib import contextmanager

import numpy as np
import pytest

from q12drv import CudaError, ScratchArena, make_scratch_plan, open_device
from q12drv.core.bf16 import to_bf16_bits
from q12drv.core.device import CURRENT
from q12drv.core.driver import EmuDriver
from q12drv.kernels import ops, registry
from q12drv.prefill import AttentionShape, Q12Pass
from tests.helpers import make_streams

SHAPE = AttentionShape(num_q_heads=4, num_kv_heads=2, head_dim=64, rotary_dim=32, rope_theta=1e4)
COUNTS, STARTS = [5, 17, 9], [0, 3, 16]


def in_thread(fn, *args):
    """``fn(*args)`` in a fresh thread; its result, or its exception raised here."""
    out = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out.get("value")


@contextmanager
def busy_switching():
    """Threads switch every microsecond (Python's default is every 5 ms), so that a race between writing a launch's
    arguments and launching it has every chance to show."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


@pytest.fixture
def emu2():
    """Two devices of one emulated machine."""
    drv = EmuDriver(device_count=2)
    d0, d1 = open_device(drv, 0), open_device(drv, 1)
    yield d0, d1
    d1.close()
    d0.close()
    assert drv.live_allocations() == {"device": 0, "pinned": 0, "modules": 0}
    assert drv.live_handles() == {"contexts": 0, "streams": 0, "events": 0}


def attention_pass(dev, seed: int, stream=None, arena=None, layers: int = 1, start=None) -> dict:
    """One batched pass with ``layers`` attention layers (over the same buffers: RoPE rotates Q and K in place, so
    each layer computes something new) on ``dev``, everything on ``stream`` (None: the device's); the outputs (O,
    both pools, Q and K) as bytes. ``start``: a barrier the layers wait at (threads then run them together)."""
    rng = np.random.default_rng(seed)
    streams, tables = make_streams(dev, COUNTS, STARTS, rng=rng)
    num_blocks = int(max(s.block_table.max() for s in streams)) + 1
    t = sum(COUNTS)
    bf = lambda *s: to_bf16_bits(rng.standard_normal(s))  # noqa: E731
    host = {"q": bf(t, 4, 64), "k": bf(t, 2, 64), "v": bf(t, 2, 64), "kp": bf(num_blocks, 16, 2, 64),
            "vp": bf(num_blocks, 16, 2, 64), "o": np.zeros((t, 4, 64), np.uint16)}
    bufs = {k: dev.alloc(a.nbytes, k) for k, a in host.items()}
    own = arena is None
    arena = arena or ScratchArena(dev, make_scratch_plan(COUNTS, 0, False).total_bytes)
    try:
        for k, a in host.items():
            dev.upload(bufs[k].ptr, a, stream)
        chunks = [(s + c, c, 0, False) for s, c in zip(STARTS, COUNTS)]
        q12 = Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, head_dim=64, chunks=chunks,
                      mode="batched", stream=stream)
        p = {k: int(b.ptr) for k, b in bufs.items()}
        if start is not None:
            start.wait()
        for _ in range(layers):
            q12.attention_layer(p["q"], p["k"], p["v"], p["kp"], p["vp"], p["o"], SHAPE, num_blocks=num_blocks)
        return {k: dev.download(bufs[k].ptr, bufs[k].nbytes, stream) for k in ("o", "kp", "vp", "q", "k")}
    finally:
        if own:
            arena.close()
        for b in (*bufs.values(), tables):
            b.free()


# --- the emulated driver's contexts ------------------------------------------------------------------------

def test_the_emulator_has_several_devices_and_refuses_others():
    assert EmuDriver(device_count=3).device_count() == 3
    with open_device("emu", 1) as dev:  # the default emulated machine has two
        assert dev.ordinal == 1 and dev.alloc(64).alive
    with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_DEVICE"):
        open_device(EmuDriver(device_count=2), 2)
    with pytest.raises(ValueError, match="device_count"):
        EmuDriver(device_count=0)


def test_a_fresh_thread_has_no_current_context_and_the_driver_says_so():
    drv = EmuDriver()
    ctx = drv.open_context(0)  # current in this thread only
    assert drv.current_context() is ctx and in_thread(drv.current_context) is None
    with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_CONTEXT") as info:
        in_thread(drv.mem_alloc, 64)
    assert info.value.call == "cuMemAlloc"
    drv.mem_free(drv.mem_alloc(64))  # here it is current
    drv.close_context(ctx)
    with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_CONTEXT"):  # released: nothing current any more
        drv.mem_alloc(64)


def test_a_call_with_another_devices_context_current_fails_as_on_a_gpu(emu2):
    d0, d1 = emu2
    s1 = d1.new_stream()
    d0.set_current()
    with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_HANDLE"):  # a stream of device 1, context 0 current
        d0.driver.memset_d8_async(int(d0.alloc(64).ptr), 0, 64, s1.raw)
    launch = registry.prepared(d1, "q12_kv_write")  # loads on device 1: its context is current now
    d0.set_current()
    with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_HANDLE"):  # device 1's kernel, context 0 current
        d1.driver.launch(launch.kernel.func, (1, 1, 1), (32, 1, 1), 0, s1.raw, launch._addr)


def test_a_kernel_reading_another_devices_memory_faults(emu2):
    d0, d1 = emu2
    on0 = d0.alloc(1024)
    out1 = d1.alloc(1024)
    d1.memset(out1.ptr, 0, 1024)
    d1.synchronize()
    launch = registry.prepared(d1, "q12_expand_meta")  # any kernel of device 1, pointed at device 0's memory
    d1.driver.memcpy_dtod_async(int(out1.ptr), int(on0.ptr), 1024, d1.stream.raw)  # a copy may (UVA)
    with pytest.raises(CudaError, match="CUDA_ERROR_ILLEGAL_ADDRESS.*memory of device 0, read by a kernel on device 1"):
        from q12drv.core.driver.emu import _EMULATORS

        _EMULATORS["q12_probe_peer"] = lambda args, mem, grid, block: mem.array(int(on0.ptr), np.uint8, 16)
        func = type(launch.kernel.func)("q12_probe_peer", (), launch.kernel.func.ctx)
        d1.driver.launch(func, (1, 1, 1), (1, 1, 1), 0, d1.stream.raw, launch._addr)
    del _EMULATORS["q12_probe_peer"]


def test_a_lookup_is_not_disturbed_by_a_free_in_another_thread_between_its_steps(monkeypatch):
    """The emulated memory's allocation list is looked up without a lock (a bisect, then an index). Another thread
    freeing an allocation below between those two steps must not make a live allocation look like its neighbour
    (it did: the list shifted under the lookup, which then read the next allocation at a negative offset)."""
    from q12drv.core.driver import emu as emu_module

    mem = EmuDriver().memory
    low, mid, high = sorted(mem.add(4096, "device") for _ in range(3))
    real = emu_module.bisect.bisect_right

    class Interleaved:  # bisect as the lookup calls it, with another thread's free run right after it
        bisect_left = staticmethod(emu_module.bisect.bisect_left)

        @staticmethod
        def bisect_right(a, x):
            i = real(a, x)
            if x == mid + 64 and mem.owner(low) is not None:
                monkeypatch.setattr(emu_module, "bisect", emu_module.bisect)
                mem.remove(low, "device")
                monkeypatch.setattr(emu_module, "bisect", Interleaved)
            return i

    monkeypatch.setattr(emu_module, "bisect", Interleaved)
    assert mem.owner(mid + 64) == ("device", 0, mid, 4096)
    assert mem.owner(low) is None and mem.owner(high + 64) == ("device", 0, high, 4096)


# --- q12drv makes the context current where it is used ---------------------------------------------------

def test_a_call_from_a_fresh_thread_works_without_the_caller_doing_anything(emu):
    buf = emu.alloc(256)
    in_thread(emu.upload, buf.ptr, np.arange(64, dtype=np.int32))
    assert np.array_equal(in_thread(emu.download_array, buf.ptr, np.int32, 64), np.arange(64))
    expected = attention_pass(emu, 3)
    assert in_thread(attention_pass, emu, 3) == expected  # staging, the kernels and the copies, all from there
    assert in_thread(lambda: CURRENT.device) is None  # each thread's own: a fresh one knows of no device


def test_each_thread_has_its_own_prepared_launches(emu):
    mine = registry.prepared(emu, "q12_kv_write")
    theirs = in_thread(registry.prepared, emu, "q12_kv_write")
    assert mine is registry.prepared(emu, "q12_kv_write") and theirs is not mine
    assert theirs._addr != mine._addr  # separate argument blocks
    assert theirs.kernel is mine.kernel  # one module and one kernel per device
    assert registry.prepared_launches(emu) == {"q12_kv_write": mine}


def test_set_current_recovers_after_code_outside_q12drv_switched_the_context(emu2):
    d0, d1 = emu2
    d0.set_current()
    buf = d0.alloc(256)
    d0.driver.set_current(d1._ctx)  # what torch.cuda.set_device(1) would do behind q12drv's back
    with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_HANDLE"):
        d0.memset(buf.ptr, 0, 256)  # q12drv still believes device 0's context is current here
    d0.set_current()
    d0.memset(buf.ptr, 7, 256)
    assert d0.download(buf.ptr, 256) == bytes([7]) * 256


def test_another_thread_launching_the_same_kernels_between_argument_writes_and_launch(emu, monkeypatch):
    """The worst interleaving, made to happen: every time this thread is about to launch (its arguments written),
    another thread runs a whole pass of the same kernels. Each thread's launches keep their own arguments."""
    mine, theirs = attention_pass(emu, 1, layers=2), attention_pass(emu, 2)
    launch, seen = emu.driver.launch, []
    me = threading.current_thread()

    def launch_after_another_thread(*args):  # the driver's launch call: the arguments are in the block it reads
        if threading.current_thread() is me:
            seen.append(in_thread(attention_pass, emu, 2))
        return launch(*args)

    monkeypatch.setattr(emu.driver, "launch", launch_after_another_thread)
    assert attention_pass(emu, 1, layers=2) == mine
    assert len(seen) >= 6 and all(out == theirs for out in seen)  # rope, kv_write, attention per layer


def test_two_threads_run_passes_on_their_own_arenas_and_streams_equal_to_serial(emu):
    seeds, layers = list(range(4)), 24
    serial = {s: attention_pass(emu, s, layers=layers) for s in seeds}
    results, errors = {}, []

    start = threading.Barrier(2)

    def worker(mine):
        stream = emu.new_stream()
        arena = ScratchArena(emu, make_scratch_plan(COUNTS, 0, False).total_bytes)
        try:
            for s in mine:
                results[s] = attention_pass(emu, s, stream, arena, layers, start)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            arena.close()

    with busy_switching():
        threads = [threading.Thread(target=worker, args=(seeds[i::2],)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    assert results == serial  # bit for bit


# --- several devices ---------------------------------------------------------------------------------------

def test_two_devices_used_alternately_from_one_thread(emu2):
    d0, d1 = emu2
    expected = attention_pass(d0, 5)
    assert attention_pass(d1, 5) == expected
    bufs = [(d, d.alloc(256)) for d in (d0, d1, d0, d1)]
    for i, (d, b) in enumerate(bufs):
        d.memset(b.ptr, i, 256)
    assert [d.download(b.ptr, 256)[0] for d, b in bufs] == [0, 1, 2, 3]
    assert attention_pass(d0, 6) == attention_pass(d1, 6)


def test_two_devices_used_from_two_threads(emu2):
    d0, d1 = emu2
    expected = attention_pass(d0, 9)
    with busy_switching():
        out = {}

        def work(dev):
            out[dev.ordinal] = [attention_pass(dev, 9, dev.new_stream()) for _ in range(2)]

        threads = [threading.Thread(target=work, args=(d,)) for d in (d0, d1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert out == {0: [expected, expected], 1: [expected, expected]}


def test_one_device_per_thread_each_opened_there(emu2):
    drv = emu2[0].driver

    def own_device(ordinal):
        with open_device(drv, ordinal) as dev:  # another Device of the same context: its own streams, its memory
            return attention_pass(dev, 2)

    assert in_thread(own_device, 0) == in_thread(own_device, 1) == attention_pass(emu2[0], 2)


# --- streams -----------------------------------------------------------------------------------------------

class ProtocolStream:
    """A stream as cuda.core hands it over: the CUDA stream protocol only."""

    def __init__(self, handle):
        self.h = handle

    def __cuda_stream__(self):
        return (0, self.h)


class TorchLikeStream:
    def __init__(self, handle):
        self.cuda_stream = handle


def test_streams_in_every_form_and_q12drv_streams_speak_the_protocol(emu):
    s = emu.new_stream()
    assert s.__cuda_stream__() == (0, s.handle) and s.handle not in (0, 1, 2)
    for form in (s, s.handle, ProtocolStream(s.handle), TorchLikeStream(s.handle), np.int64(s.handle)):
        assert emu.as_stream(form) is s.raw
    assert emu.as_stream(None) is emu.stream.raw and emu.as_stream(ProtocolStream(0)) is not s.raw
    with pytest.raises(TypeError, match="stream must be None, an int handle"):
        emu.as_stream("default")
    with pytest.raises(ValueError, match="is no stream this device's driver knows"):
        emu.as_stream(0x7FFF_FFFF)
    s.destroy()
    with pytest.raises(ValueError, match="destroyed"):
        emu.as_stream(s)


def test_a_framework_stream_first_seen_while_it_captures_keeps_the_capture_valid(emu):
    """torch.cuda.graph captures on a side stream q12drv has not seen: asking its device then would be refused by
    the driver and invalidate the capture, so it is taken unchecked while capturing and checked after."""
    s = emu.new_stream()
    emu.driver.begin_capture(s.raw)
    assert emu.as_stream(ProtocolStream(s.handle)) is s.raw
    emu.driver.end_capture(s.raw)  # still valid
    assert emu.as_stream(TorchLikeStream(s.handle)) is s.raw  # checked now
    emu.driver.begin_capture(s.raw)
    with pytest.raises(CudaError, match="CAPTURE_UNSUPPORTED"):
        emu.driver.stream_device(s.raw)  # what the check would have done
    with pytest.raises(CudaError, match="CAPTURE_INVALIDATED"):
        emu.driver.end_capture(s.raw)


def test_a_stream_of_another_device_is_refused_in_every_form(emu2):
    d0, d1 = emu2
    s1 = d1.new_stream()
    for form in (s1, s1.handle, ProtocolStream(s1.handle), TorchLikeStream(s1.handle), d1.stream):
        with pytest.raises(ValueError, match="device 1.*this call runs on device 0"):
            d0.as_stream(form)
    buf = d0.alloc(64)
    with pytest.raises(ValueError, match="device 1"):
        d0.memset(buf.ptr, 0, 64, s1)  # refused before anything is enqueued
    launch = registry.prepared(d0, "q12_kv_write")
    with pytest.raises(ValueError, match="device 1"):
        launch.launch((1, 1, 1), (32, 1, 1), 0, s1)
    with open_device("emu") as other:  # device 0 of another emulated machine
        with pytest.raises(ValueError, match="another emu driver"):
            d0.as_stream(other.stream)
        with pytest.raises(ValueError, match="is no stream this device's driver knows"):
            d0.as_stream(other.stream.handle)


def test_device_arrays_export_the_stream_their_bytes_are_pending_on(emu):
    s = emu.new_stream()
    buf = emu.alloc(4096)
    assert buf.view(np.float32, (16,)).__cuda_array_interface__["stream"] == emu.stream.handle
    assert buf.view(np.float32, (16,), stream=s).__cuda_array_interface__["stream"] == s.handle
    with ScratchArena(emu, 1 << 12) as arena:
        cai = arena.view(0, np.uint8, (64,), stream=ProtocolStream(s.handle)).__cuda_array_interface__
        assert cai["version"] == 3 and cai["stream"] == s.handle
        assert arena.view(0, np.uint8, (64,)).__cuda_array_interface__["stream"] == emu.stream.handle


def test_ops_take_a_protocol_stream(emu):
    expected = attention_pass(emu, 4)
    s = emu.new_stream()
    assert attention_pass(emu, 4, ProtocolStream(s.handle)) == expected
    assert ops.ATTN_ALGOS  # the launchers resolve the stream through Device.as_stream
