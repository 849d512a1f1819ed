import functools

import pytest


def _gpu_available() -> bool:
    try:
        from q12drv.core.driver import open_driver

        open_driver("cuda")
        return True
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if any("gpu" in item.keywords for item in items) and not _gpu_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200 with scripts/gpu_check.sh)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated_cubin_cache(tmp_path_factory, monkeypatch):
    # Tests never write into the user's cache; one cache per test session.
    monkeypatch.setenv("Q12DRV_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cubin-cache"))
    monkeypatch.delenv("Q12DRV_DRIVER", raising=False)
    yield


@pytest.fixture
def emu():
    from q12drv import open_device

    dev = open_device("emu")
    yield dev
    dev.close()
    assert dev.driver.live_allocations()["device"] == 0
    assert dev.driver.live_allocations()["pinned"] == 0


@pytest.fixture(scope="session")
def kernel_build():
    """``build(source, arch="sm_90") -> CompiledImage``: a ``cuda_src`` source compiled as q12drv builds it (its
    contract defines) with ptxas's resource report, once per test session. The doctor's test, each kernel's
    no-spill test and the SASS tests read the same compile instead of each paying for their own (the
    wgmma and mma GDN sources take seconds each). The report changes no instruction: its SASS is the
    shipped build's (test_sass.py checks)."""
    from q12drv.core.nvrtc import compile_source
    from q12drv.kernels.registry import compile_defines

    @functools.cache
    def cached(source: str, arch: str):
        return compile_source(source, arch=arch, defines=compile_defines(source), use_cache=False,
                              verbose_resources=True)

    def build(source: str, arch: str = "sm_90"):
        return cached(source, arch)  # one cache key however the arguments are spelled

    return build


@pytest.fixture(scope="session")
def disassembled():
    """``sass(image) -> {entry: SASS text}``: :func:`q12drv.tools.sass.disassemble` of a cubin, run once per image
    per test session (images from :func:`kernel_build` are shared, so are their disassemblies)."""
    from q12drv.tools.sass import disassemble

    return functools.cache(lambda image: disassemble(image))
