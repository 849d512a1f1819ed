"""The NVRTC toolchain: cache keys over every header, the NVRTC log in errors, the metadata mirror
checked at compile time, signatures parsed from the source, arguments packed by their C types."""

import ctypes
import shutil

import pytest

from q12drv import NvrtcError, open_device
from q12drv.core.driver import register_emulator
from q12drv.kernels.meta import Q12MetaC, Q12TailC, meta_defines
from q12drv.core.launch import load_module, parse_signatures
from q12drv.core.nvrtc import compile_source, cuda_src_dir

PROBE = '#include "common/q12_meta.cuh"\nextern "C" __global__ void q12_probe(Q12Meta m, int* out) { out[0] = m.batch_size; }\n'


@pytest.fixture
def src(tmp_path, monkeypatch):
    d = tmp_path / "cuda_src"
    shutil.copytree(cuda_src_dir(), d)
    (d / "probe.cu").write_text(PROBE)
    monkeypatch.setenv("Q12DRV_CUDA_SRC", str(d))
    monkeypatch.setenv("Q12DRV_CACHE_DIR", str(tmp_path / "cache"))
    return d


def test_cache_hit_and_header_change_recompiles(src):
    first = compile_source("probe.cu", defines=meta_defines())
    again = compile_source("probe.cu", defines=meta_defines())
    assert not first.cached and again.cached and again.image == first.image
    (src / "common/q12_meta.cuh").write_text((src / "common/q12_meta.cuh").read_text() + "\n// edited\n")
    edited = compile_source("probe.cu", defines=meta_defines())
    assert not edited.cached and edited.key != first.key
    other_arch = compile_source("probe.cu", arch="sm_80", defines=meta_defines())
    assert other_arch.key != edited.key


def test_compile_error_carries_the_log(src):
    (src / "broken.cu").write_text('extern "C" __global__ void k(int* p) { p[0] = undefined_name; }\n')
    with pytest.raises(NvrtcError) as info:
        compile_source("broken.cu", use_cache=False)
    assert "undefined_name" in info.value.log and "broken.cu" in str(info.value)


def test_a_drifted_mirror_does_not_compile(src):
    defines = [d if not d.startswith("Q12_META_OFF_KV_LENS=") else "Q12_META_OFF_KV_LENS=48" for d in meta_defines()]
    with pytest.raises(NvrtcError, match="kv_lens offset differs"):
        compile_source("probe.cu", defines=defines, use_cache=False)
    size = [d if not d.startswith("Q12_META_SIZE=") else "Q12_META_SIZE=72" for d in meta_defines()]
    with pytest.raises(NvrtcError, match="sizeof"):
        compile_source("probe.cu", defines=size, use_cache=False)
    with pytest.raises(NvrtcError, match="compile through q12drv"):
        compile_source("probe.cu", use_cache=False)


def test_signatures_are_parsed_from_the_source():
    sigs = parse_signatures(
        'extern "C" __global__ void a(Q12Meta m, const unsigned long long* __restrict__ p, int n, unsigned int u, '
        'long long s, float f) {}\nextern "C" __global__ void b() {}', {"Q12Meta": Q12MetaC})
    assert [(name, t) for name, t in sigs["a"]] == [
        ("m", Q12MetaC), ("p", ctypes.c_uint64), ("n", ctypes.c_int32), ("u", ctypes.c_uint32),
        ("s", ctypes.c_int64), ("f", ctypes.c_float)]
    assert sigs["b"] == ()
    # __launch_bounds__ before or after the return type (both are valid CUDA)
    bounds = parse_signatures('extern "C" __global__ __launch_bounds__(128, 2) void d(int n) {}\n'
                              'extern "C" __global__ void __launch_bounds__(NW * 32, 1) e(float x) {}\n'
                              'extern "C" __global__ __launch_bounds__((WG + 1) * 128, 1) void f(int k) {}')
    assert bounds == {"d": (("n", ctypes.c_int32),), "e": (("x", ctypes.c_float),), "f": (("k", ctypes.c_int32),)}
    # a by-value struct behind const __grid_constant__ (expand_meta.cu's tail)
    tail = parse_signatures('extern "C" __global__ void g(Q12Meta m, const __grid_constant__ Q12Tail tail) {}',
                            {"Q12Meta": Q12MetaC, "Q12Tail": Q12TailC})
    assert tail == {"g": (("m", Q12MetaC), ("tail", Q12TailC))}
    with pytest.raises(ValueError, match="cannot pack"):
        parse_signatures('extern "C" __global__ void c(double2 x) {}')


def test_launch_arguments_are_typed_and_range_checked(src):
    register_emulator("q12_probe", lambda args, mem, grid, block: None)
    with open_device("emu") as dev:
        mod = load_module(dev, "probe.cu", defines=tuple(meta_defines()), struct_types={"Q12Meta": Q12MetaC})
        assert load_module(dev, "probe.cu", defines=tuple(meta_defines()), struct_types={"Q12Meta": Q12MetaC}) is mod
        launch = mod.kernel("q12_probe").prepare(out=0x1000)
        assert launch.args.out == 0x1000
        with pytest.raises(OverflowError, match="out=-1"):
            launch.set(out=-1)
        with pytest.raises(TypeError, match="no parameter 'outt'"):
            launch.set(outt=1)
        with pytest.raises(KeyError, match="no extern"):
            mod.kernel("missing")


def test_an_entry_family_declares_its_parameters_once_in_a_macro():
    header = "#define FAMILY_PARAMS const Q12Meta m, \\\n    const float* __restrict__ x, int n\n"
    src = ('#include "family.cuh"\n'
           'extern "C" __global__ void __launch_bounds__(128) f_d64(FAMILY_PARAMS) { body<64>(m, x, n); }\n'
           'extern "C" __global__ void __launch_bounds__(128) f_d128(FAMILY_PARAMS) { body<128>(m, x, n); }\n')
    sigs = parse_signatures(src, {"Q12Meta": Q12MetaC}, (header,))
    assert sigs["f_d64"] == sigs["f_d128"] == (("m", Q12MetaC), ("x", ctypes.c_uint64), ("n", ctypes.c_int32))
