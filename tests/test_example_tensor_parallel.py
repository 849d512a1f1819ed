"""examples/tensor_parallel.py runs on the emulator's two devices (and on one)."""

import importlib.util
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tensor_parallel.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("tensor_parallel_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("devices", [None, 1])
def test_each_ranks_heads_equal_one_device_running_them_all(example, devices, capsys):
    argv = ["--driver", "emu"] + ([] if devices is None else ["--devices", str(devices)])
    result = example.main(argv)
    assert result["ranks"] == (devices or 2) and result["driver"] == "emu"
    assert result["identical"] and result["max_abs_diff"] == 0
    assert f"{result['ranks']} rank(s) on emu" in capsys.readouterr().out
