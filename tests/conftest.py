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
