"""q12drv.kernels.registry: a kernel module's host/device contract defines reach every build of its source."""

import pytest

from q12drv.kernels import registry
from q12drv.kernels.meta import meta_defines


@pytest.fixture
def scratch_source(monkeypatch):
    """A registration that leaves the registry as it found it."""
    for table in ("SOURCES", "ENTRIES", "CONTRACTS"):
        monkeypatch.setattr(registry, table, dict(getattr(registry, table)))
    return "probe_contracts.cu"


def test_contract_defines_follow_the_metadata_defines(scratch_source):
    registry.register(scratch_source, ("q12_probe",), defines={"Q12_PROBE_THREADS": 128, "Q12_PROBE_TILE": 64})
    assert registry.compile_defines(scratch_source) == (*meta_defines(), "Q12_PROBE_THREADS=128", "Q12_PROBE_TILE=64")
    assert registry.compile_defines("unregistered.cu") == tuple(meta_defines())


@pytest.mark.parametrize("defines", [{"PROBE_THREADS": 128}, {"Q12_probe": 1}, {"Q12_PROBE_X": 1.5},
                                     {"Q12_PROBE_X": True}, {"Q12_PROBE_X": "128"}])
def test_a_contract_is_a_q12_name_and_an_int(scratch_source, defines):
    with pytest.raises(ValueError, match="Q12_<KERNEL>_<FIELD>=<int>"):
        registry.register(scratch_source, ("q12_probe",), defines=defines)
    assert scratch_source not in registry.SOURCES


def test_prepared_builds_with_the_contract_defines(scratch_source, monkeypatch, emu):
    registry.register(scratch_source, ("q12_probe",), defines={"Q12_PROBE_THREADS": 128})
    seen = {}

    class _Module:
        def kernel(self, name):
            seen["entry"] = name
            return type("K", (), {"prepare": lambda self: "launch"})()

    def load_module(device, source, *, defines, struct_types):
        seen["source"], seen["defines"] = source, defines
        return _Module()

    monkeypatch.setattr(registry, "load_module", load_module)
    assert registry.prepared(emu, "q12_probe") == "launch"
    assert seen == {"source": scratch_source, "defines": registry.compile_defines(scratch_source),
                    "entry": "q12_probe"}


#: (source, contract define) of every kernel module that declares contracts.
_CONTRACTS = [(source, define) for source, defines in registry.CONTRACTS.items() for define in defines]


def test_the_small_kernels_declare_their_contracts():
    from q12drv.kernels import kv_write, rope

    for mod in (rope, kv_write):
        assert registry.CONTRACTS[mod.SOURCE] == tuple(f"{k}={v}" for k, v in mod.CONTRACTS.items())


@pytest.mark.parametrize("source,define", _CONTRACTS, ids=[d.split("=")[0] for _, d in _CONTRACTS])
def test_a_wrong_or_missing_contract_define_does_not_compile(source, define):
    """Every contract define is checked by its source: another value (twice the host's, or 1 for a 0 flag) fails a
    static_assert, and leaving it out stops at the source's #error."""
    from q12drv.core.errors import NvrtcError
    from q12drv.core.nvrtc import compile_source

    name, value = define.split("=")
    others = [d for d in registry.compile_defines(source) if d != define]
    with pytest.raises(NvrtcError, match="static assertion failed"):
        compile_source(source, defines=[*others, f"{name}={2 * int(value) or 1}"], use_cache=False)
    with pytest.raises(NvrtcError, match="compile through q12drv"):
        compile_source(source, defines=others, use_cache=False)
