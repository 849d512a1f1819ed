"""Raw-driver harness for the kernel-level GPU tests: torch allocates, cuda.bindings launches.

Deliberately independent of q12drv's driver, device and launch layers, so a kernel test cannot
pass because of a bug it shares with them (the prefill test goes through q12drv's own path).
"""

from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from q12drv.core.nvrtc import compile_source  # noqa: E402
from q12drv.kernels.registry import compile_defines  # noqa: E402

GUARD = 256  # bytes on each side of every buffer (keeps 16-byte alignment)
POISON = 0xFFFF


# ----------------------------------------------------------------------------- raw driver harness
def check(res):
    """Unwrap a cuda.bindings result tuple ``(CUresult, *values)``; raise on an error."""
    if not isinstance(res, tuple):
        res = (res,)
    if int(res[0]) != 0:
        raise RuntimeError(f"CUDA driver error {res[0]!r}")
    if len(res) == 1:
        return None
    return res[1] if len(res) == 2 else res[1:]


class Kernel:
    _cache: dict = {}

    def __init__(self, source, entry):
        from cuda.bindings import driver

        self.driver = driver
        torch.zeros(1, device="cuda")  # make torch's (primary) context current
        check(driver.cuInit(0))
        ctx = check(driver.cuCtxGetCurrent())
        if int(ctx) == 0:
            dev = check(driver.cuDeviceGet(torch.cuda.current_device()))
            ctx = check(driver.cuDevicePrimaryCtxRetain(dev))
            check(driver.cuCtxSetCurrent(ctx))
        key = (source, entry)
        if key not in Kernel._cache:
            img = compile_source(source, arch="sm_90", defines=compile_defines(source), use_cache=False,
                                 verbose_resources=True)
            spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", img.log)
            assert all(a == "0" and b == "0" for a, b in spills), img.log
            module = check(driver.cuModuleLoadData(img.image))
            Kernel._cache[key] = (module, check(driver.cuModuleGetFunction(module, entry.encode())))
        self.module, self.func = Kernel._cache[key]

    def launch(self, grid, block, smem, args):
        """args: ctypes objects in parameter order."""
        ptrs = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        stream = torch.cuda.current_stream().cuda_stream
        check(
            self.driver.cuLaunchKernel(
                self.func, *grid, *block, smem, self.driver.CUstream(stream), ctypes.addressof(ptrs), 0
            )
        )
        torch.cuda.synchronize()
        check(self.driver.cuCtxSynchronize())


def variant_kernel(source, entry, defines, *, verbose_resources=False):
    """``entry`` compiled with extra -D macros ``defines`` (uncached), launchable like :class:`Kernel`."""
    base = Kernel(source, entry)  # makes the context current
    img = compile_source(source, arch="sm_90", defines=compile_defines(source) + tuple(defines), use_cache=False,
                         verbose_resources=verbose_resources)
    kern = Kernel.__new__(Kernel)
    kern.driver = base.driver
    kern.module = check(base.driver.cuModuleLoadData(img.image))
    kern.func = check(base.driver.cuModuleGetFunction(kern.module, entry.encode()))
    return kern


class Buf:
    """Device buffer with random guard bytes on both sides; ``ptr`` is the payload address."""

    def __init__(self, arr: np.ndarray | None = None, nbytes: int | None = None, fill: int | None = None, offset=0):
        if arr is not None:
            arr = np.ascontiguousarray(arr)
            nbytes = arr.nbytes
        self.nbytes = int(nbytes)
        self.offset = offset
        self.t = torch.empty(GUARD + offset + self.nbytes + GUARD, dtype=torch.uint8, device="cuda")
        g = np.random.default_rng().integers(0, 256, 2 * GUARD, dtype=np.uint8)
        self.guard = g
        self.t[:GUARD] = torch.from_numpy(g[:GUARD]).cuda()
        self.t[GUARD + offset + self.nbytes :] = torch.from_numpy(g[GUARD:]).cuda()
        payload = self.t[GUARD + offset : GUARD + offset + self.nbytes]
        if arr is not None:
            payload.copy_(torch.from_numpy(arr.reshape(-1).view(np.uint8)).cuda())
        elif fill is not None:
            payload.view(torch.int16).fill_(np.int16(np.uint16(fill).view(np.int16)).item())
        self.ptr = self.t.data_ptr() + GUARD + offset

    def read(self, dtype, shape):
        host = self.t[GUARD + self.offset : GUARD + self.offset + self.nbytes].cpu().numpy()
        return host.view(dtype).reshape(shape)

    def check_guards(self):
        lo = self.t[:GUARD].cpu().numpy()
        hi = self.t[GUARD + self.offset + self.nbytes :].cpu().numpy()
        np.testing.assert_array_equal(lo, self.guard[:GUARD], err_msg="low guard overwritten")
        np.testing.assert_array_equal(hi, self.guard[GUARD:], err_msg="high guard overwritten")
