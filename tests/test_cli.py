"""The q12drv command: demo (staging and kernels, on emu), doctor (every kernel compiled and reported), help."""

import subprocess
import sys

import pytest

from q12drv.tools.cli import main
from q12drv.tools.doctor import parse_ptxas_report


def test_demo_runs_and_verifies(capsys):
    assert main(["demo", "--driver", "emu"]) == 0
    out = capsys.readouterr().out
    assert "admission: admitted" in out
    assert "read-back: every field, pad and the JIT slot verified" in out
    assert "batched vs per stream: bit-identical" in out
    assert "emulated driver: numpy on the host, not GPU time" in out
    assert "stacked_metadata" in out and "h_state_ptrs" in out
    assert out.strip().endswith("demo: all checks passed")


def test_demo_cuda_without_gpu_is_a_clear_error(capsys):
    try:
        from q12drv.core.driver import open_driver

        open_driver("cuda")
        pytest.skip("a GPU is present")
    except Exception:
        pass
    assert main(["demo", "--driver", "cuda", "--no-kernels"]) == 2
    assert "emu" in capsys.readouterr().err


def test_doctor_compiles_every_kernel_for_sm90(capsys, monkeypatch, kernel_build, disassembled):
    from q12drv.kernels import attention, attention_wgmma
    from q12drv.kernels.gdn import chunked_mma
    from q12drv.kernels.ops import SOURCES
    from q12drv.kernels.registry import compile_defines
    from q12drv.tools import doctor

    compiled = []

    def shared_compile(source, *, arch, defines, verbose_resources):
        # the doctor's own call, answered from the session's compile of the same build (tests/conftest.py)
        assert tuple(defines) == tuple(compile_defines(source)) and verbose_resources
        compiled.append(source)
        return kernel_build(source, arch)

    monkeypatch.setattr(doctor, "compile_source", shared_compile)
    monkeypatch.setattr(doctor, "disassemble", lambda image, tool=None: disassembled(image))
    assert main(["doctor", "--driver", "emu"]) == 0
    out = capsys.readouterr().out
    assert compiled == list(SOURCES)
    assert "target sm_90" in out and out.strip().endswith("doctor: ok") and "variant" not in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("q12_")}
    assert set(rows) == {entry for entries in SOURCES.values() for entry in entries}
    # registers, spills, stack, static smem, dynamic smem, compile s, SASS instructions, wgmma MMAs/groups
    assert all(len(r) == 10 and r[2] == r[3] == "0" for r in rows.values()), rows
    assert int(rows["q12_attn_prefill_d256"][6]) == attention.smem_bytes(256)
    assert int(rows["q12_attn_prefill_d128"][6]) == attention.smem_bytes(128)
    assert int(rows["q12_attn_wgmma_d128"][6]) == attention_wgmma.smem_bytes(128)
    assert int(rows["q12_gdn_mma_fused_d128"][6]) == chunked_mma.fused_smem(128) and int(rows["q12_kv_write"][6]) == 0
    assert rows["q12_kv_write"][9] == "-" and rows["q12_attn_wgmma_d128"][9] != "-"  # HGMMA/groups where there are MMAs


def test_ptxas_report_parser():
    log = """ptxas info    : Compiling entry function 'k1' for 'sm_90'
ptxas info    : Function properties for k1
ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 200 registers, used 1 barriers, 1024 bytes smem
"""
    (r,) = parse_ptxas_report(log)
    assert (r.name, r.registers, r.spill_stores, r.spill_loads, r.stack_frame, r.static_smem) == ("k1", 200, 8, 4, 16, 1024)


@pytest.mark.parametrize("command,says", [
    ([], "q12drv COMMAND --help"), (["demo"], "h_state_ptrs"), (["doctor"], "registers, spills"),
    (["sass"], "warpgroup MMAs"), (["inspect"], "PASS/FAIL/SKIP"), (["diff"], "regions and fields that differ"),
    (["render"], "guard band")])
def test_help_teaches(command, says, capsys):
    """Every command's help says what it does and shows an example run of it."""
    with pytest.raises(SystemExit) as info:
        main([*command, "--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and says in out, out
    examples = out.split("example", 1)[1]
    assert f"\n  {' '.join(['q12drv', *command])} " in examples, out
    assert "-D" not in out and "variant" not in out  # the kernels have no build options a user sets


def test_help_through_python_m():
    res = subprocess.run([sys.executable, "-m", "q12drv", "demo", "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "h_state_ptrs" in res.stdout and "--driver" in res.stdout


def test_version(capsys):
    import q12drv

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"q12drv {q12drv.__version__}"


_NO_GPU = """
import q12drv.core.driver.cuda as cuda
from q12drv.core.errors import DriverUnavailableError

def _unavailable(self, *a, **k):
    raise DriverUnavailableError("libcuda.so.1 cannot be loaded (simulated)")

cuda.CudaDriver.__init__ = _unavailable  # a machine without a usable GPU, wherever the test runs
import q12drv
"""


def test_auto_falling_back_to_the_emulator_says_so_once():
    code = _NO_GPU + """
a = q12drv.open_device("auto")
b = q12drv.open_device()
print(repr(a))
a.close(); b.close()
"""
    env = {k: v for k, v in __import__("os").environ.items() if k != "Q12DRV_DRIVER"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("driver 'auto' found no usable CUDA GPU") == 1, res.stderr
    assert "simulated" in res.stderr and res.stderr.count("\n") == 1
    assert "driver=emu (auto fell back: libcuda.so.1 cannot be loaded (simulated))" in res.stdout


def test_choosing_the_emulator_is_silent():
    code = _NO_GPU + """
q12drv.open_device("emu").close()
q12drv.open_device().close()  # Q12DRV_DRIVER=emu
print(repr(q12drv.open_device("emu")))
"""
    env = {**__import__("os").environ, "Q12DRV_DRIVER": "emu"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert "fell back" not in res.stdout


def test_emulator_timings_are_labelled(capsys):
    from q12drv.core.driver import TIMING_NOTE
    from q12drv.tools.soak import run_soak

    assert main(["demo", "--driver", "emu", "--no-kernels"]) == 0
    timed = [line for line in capsys.readouterr().out.splitlines() if " us" in line or " ms" in line]
    assert timed and all(TIMING_NOTE in line for line in timed)
    from q12drv import open_device

    with open_device("emu", deferred=True) as dev:
        assert TIMING_NOTE in run_soak(dev, 3, layers=1).summary()


def test_an_unexpected_failure_is_one_line_unless_the_traceback_is_asked_for(monkeypatch, capsys, tmp_path):
    import q12drv.tools.inspect as inspect_mod

    def broken(*a, **k):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(inspect_mod, "inspect_dump", broken)
    assert main(["inspect", str(tmp_path / "x.npz")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error: RuntimeError: boom second line" in err
    assert "Q12DRV_TRACEBACK=1" in err and "Traceback" not in err
    monkeypatch.setenv("Q12DRV_TRACEBACK", "1")
    with pytest.raises(RuntimeError, match="boom"):
        main(["inspect", str(tmp_path / "x.npz")])


@pytest.mark.slow  # compiles every kernel once more (about 20 s on two cores)
def test_build_fills_the_cache_a_launch_reads(tmp_path, monkeypatch, capsys):
    """After ``q12drv build`` a kernel's load is a cache hit: the same key as a launch's."""
    from q12drv.core.nvrtc import compile_source
    from q12drv.kernels import kv_write
    from q12drv.kernels.registry import compile_defines

    monkeypatch.setenv("Q12DRV_CACHE_DIR", str(tmp_path / "cubin"))
    assert main(["build"]) == 0
    out = capsys.readouterr().out
    assert "kv_write.cu" in out and "compiled in" in out
    assert compile_source(kv_write.SOURCE, arch="sm_90", defines=compile_defines(kv_write.SOURCE)).cached
    assert main(["build"]) == 0 and "cached already" in capsys.readouterr().out
