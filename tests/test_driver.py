"""The driver layer: the choke point, driver selection, the emulated driver's semantics and faults."""

import ctypes

import numpy as np
import pytest

from q12drv import CudaError, DriverUnavailableError, open_device
from q12drv.core.driver import EmuDriver, EmuImage, open_driver, register_emulator
from q12drv.core.driver.emu import POISON_BYTE
from q12drv.core.driver.result import check
from q12drv.core.errors import HostRaceError
from q12drv.core.ptr import NULL, DevicePtr


def test_check_is_the_choke_point():
    check("cuMemAlloc", 0)
    with pytest.raises(CudaError) as info:
        check("cuMemAlloc", 2)
    e = info.value
    assert (e.name, e.code, e.call) == ("CUDA_ERROR_OUT_OF_MEMORY", 2, "cuMemAlloc")
    assert "cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY (2)" in str(e)


def test_auto_falls_back_to_emu_and_cuda_is_a_clear_error(monkeypatch):
    assert open_driver("auto").name in ("emu", "cuda")
    monkeypatch.setenv("Q12DRV_DRIVER", "emu")
    assert open_driver().name == "emu"
    assert open_device("auto").driver.name == "emu"
    monkeypatch.setenv("Q12DRV_DRIVER", "gpu")
    with pytest.raises(ValueError, match="Q12DRV_DRIVER"):
        open_driver()


def test_cuda_without_libcuda_is_a_clear_error():
    try:
        open_driver("cuda")
    except DriverUnavailableError as exc:
        assert "emu" in str(exc)
    else:
        pytest.skip("a GPU is present")


def test_device_ptr():
    p = DevicePtr(0x1000)
    assert p + 1 == 0x1001 and isinstance(p.offset(16), DevicePtr) and p.offset(16) == 0x1010
    assert repr(p) == "DevicePtr(0x1000)" and not NULL and NULL.is_null
    ctypes.c_uint64(p)  # usable wherever an int is
    with pytest.raises(ValueError):
        DevicePtr(-1)
    with pytest.raises(ValueError):
        DevicePtr(1 << 64)


def test_emu_memory_is_real_poisoned_and_bounds_checked():
    d = EmuDriver()
    with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_CONTEXT"):
        d.mem_alloc(100)  # no context current in this thread (as on a GPU)
    d.open_context(0)  # retained and made current, as the real driver's
    p = d.mem_alloc(100)
    assert p % 256 == 0
    assert ctypes.string_at(p, 100) == bytes([POISON_BYTE]) * 100
    host = np.arange(25, dtype=np.int32)
    d.memcpy_htod_async(p, host.ctypes.data, 100, 0)
    assert np.array_equal(d.memory.array(p, np.int32, 25), host)
    with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_VALUE"):
        d.memcpy_htod_async(p + 4, host.ctypes.data, 100, 0)
    d.mem_free(p)
    with pytest.raises(CudaError):
        d.mem_free(p)


def test_fault_injection_reaches_the_caller_and_nothing_leaks():
    dev = open_device("emu")
    dev.driver.inject_fault("cuMemAlloc", "CUDA_ERROR_OUT_OF_MEMORY", after=1)
    a = dev.alloc(64)
    with pytest.raises(CudaError) as info:
        dev.alloc(64)
    assert info.value.name == "CUDA_ERROR_OUT_OF_MEMORY" and info.value.call == "cuMemAlloc"
    b = dev.alloc(64)
    assert a.alive and b.alive
    dev.close()
    assert dev.driver.live_allocations() == {"device": 0, "pinned": 0, "modules": 0}


def test_deferred_mode_runs_work_at_sync_and_catches_pinned_rewrites():
    d = EmuDriver(deferred=True)
    d.open_context(0)
    s = d.stream_create()
    dst = d.mem_alloc(8)
    src = d.host_alloc(8)
    ctypes.memmove(src, b"AAAAAAAA", 8)
    d.memcpy_htod_async(dst, src, 8, s)
    assert ctypes.string_at(dst, 8) == bytes([POISON_BYTE]) * 8  # not run yet
    ev = d.event_create()
    d.event_record(ev, s)
    assert not d.event_query(ev)
    d.event_synchronize(ev)
    assert d.event_query(ev) and ctypes.string_at(dst, 8) == b"AAAAAAAA"
    d.memcpy_htod_async(dst, src, 8, s)
    ctypes.memmove(src, b"BBBBBBBB", 8)  # rewritten before the copy ran
    with pytest.raises(HostRaceError):
        d.stream_synchronize(s)


def test_emu_launch_decodes_packed_params_at_enqueue():
    seen = []
    register_emulator("t_probe", lambda args, mem, grid, block: seen.append((dict(args), grid, block)))
    d = EmuDriver(deferred=True)
    d.open_context(0)
    mod = d.module_load(EmuImage("probe.cu", {"t_probe": (("x", ctypes.c_uint64), ("n", ctypes.c_int32), ("f", ctypes.c_float))}))
    fn = d.module_get_function(mod, "t_probe")

    class Args(ctypes.Structure):
        _fields_ = [("x", ctypes.c_uint64), ("n", ctypes.c_int32), ("f", ctypes.c_float)]

    a = Args(0xABC, -3, 0.5)
    ptrs = (ctypes.c_void_p * 3)(*(ctypes.addressof(a) + getattr(Args, f).offset for f in ("x", "n", "f")))
    d.launch(fn, (2, 1, 1), (32, 1, 1), 0, 0, ctypes.addressof(ptrs))
    a.n = 7  # updating the packed args after enqueue must not change the enqueued launch
    d.stream_synchronize(0)
    assert seen == [({"x": 0xABC, "n": -3, "f": 0.5}, (2, 1, 1), (32, 1, 1))]
    with pytest.raises(CudaError, match="INVALID_VALUE"):
        d.launch(fn, (1, 1, 1), (32, 1, 1), 64 * 1024, 0, ctypes.addressof(ptrs))  # > 48 KiB without opt-in
    with pytest.raises(CudaError, match="NOT_FOUND"):
        d.module_get_function(mod, "missing")


def test_device_array_interface(emu):
    buf = emu.alloc(4096)
    view = buf.view(np.float32, (16, 8), offset=256)
    cai = view.__cuda_array_interface__
    assert cai["version"] == 3 and cai["shape"] == (16, 8) and cai["typestr"] == "<f4"
    assert cai["data"] == (int(buf.ptr) + 256, False)
    with pytest.raises(ValueError):
        buf.view(np.float32, (2048,), offset=0)
