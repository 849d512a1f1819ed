"""q12drv.tools.sass: the machine code of the kernels, and the check that ptxas kept their warpgroup MMAs asynchronous
(a serialised build compiles without spills, runs correctly and is several times slower: only the SASS shows it)."""

import pytest

from q12drv.tools import sass
from q12drv.tools.cli import main
from q12drv.core.errors import Q12Error
from q12drv.kernels import attention_wgmma
from q12drv.kernels.gdn import chunked_wgmma
from q12drv.kernels.registry import compile_defines
from q12drv.core.nvrtc import compile_source


def _sass_lines(ops):
    return "".join(f"        /*{16 * i:04x}*/                   {op} ;\n" for i, op in enumerate(ops))


PIPELINED = ["WARPGROUP.ARRIVE", "HGMMA.64x64x16.F32.BF16 R88, R152, gdesc[UR16], RZ, !UPT",
             "HGMMA.64x64x16.F32.BF16 R88, R156, gdesc[UR16], R88",
             "HGMMA.64x64x16.F32.BF16 R88, R180, gdesc[UR16], R88, gsb0", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "EXIT"]
SERIALISED = ["WARPGROUP.ARRIVE", "HGMMA.64x64x16.F32.BF16 R152, R88, gdesc[UR16], RZ, !UPT, gsb0",
              "WARPGROUP.DEPBAR.LE gsb0, 0x0", "WARPGROUP.ARRIVE", "HGMMA.64x64x16.F32.BF16 R152, R92, gdesc[UR16], R152, gsb0",
              "WARPGROUP.DEPBAR.LE gsb0, 0x0", "EXIT"]


def test_summary_counts_instructions_groups_and_waits():
    w = sass.wgmma_summary("k", _sass_lines(PIPELINED) + "        /* 0x000fe200078e00ff */\n")
    assert (w.instructions, w.hgmma, w.groups, w.waits, w.serialised) == (6, 3, 1, 1, False)
    w = sass.wgmma_summary("k", _sass_lines(SERIALISED))
    assert (w.hgmma, w.groups, w.waits, w.serialised) == (2, 2, 2, True)
    # no MMA, or a single one, is never "serialised"
    assert not sass.wgmma_summary("k", _sass_lines(["EXIT"])).serialised
    assert not sass.wgmma_summary("k", _sass_lines(SERIALISED[:3])).serialised


def test_disassemble_splits_every_entry_and_says_when_nvdisasm_is_missing(monkeypatch, kernel_build):
    img = kernel_build("expand_meta.cu")
    code = sass.disassemble(img.image)
    assert set(code) == {"q12_expand_meta", "q12_expand_meta_tail"}
    assert all(sass.wgmma_summary(e, t).instructions > 100 for e, t in code.items())
    with pytest.raises(Q12Error, match="failed"):
        sass.disassemble(b"not a cubin")
    monkeypatch.setattr(sass, "find_nvdisasm", lambda: None)
    with pytest.raises(sass.NvdisasmNotFound, match="pip install nvidia-cuda-nvdisasm"):
        sass.disassemble(img.image)


def test_find_nvdisasm_looks_on_path_then_cuda_home(monkeypatch, tmp_path):
    tool = tmp_path / "bin" / "nvdisasm"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.setattr(sass.shutil, "which", lambda name: None)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert sass.find_nvdisasm() == str(tool)
    monkeypatch.setattr(sass.shutil, "which", lambda name: "/opt/x/nvdisasm")
    assert sass.find_nvdisasm() == "/opt/x/nvdisasm"


@pytest.mark.parametrize("source,entries", [(chunked_wgmma.SOURCE, [e for e in chunked_wgmma.ENTRIES
                                                                     if "precompute" not in e]),
                                            (attention_wgmma.SOURCE, attention_wgmma.ENTRIES)])
def test_shipped_wgmma_kernels_keep_their_mma_pipelined(source, entries, kernel_build, disassembled):
    """Every warpgroup-MMA kernel as shipped: its MMAs grouped (ptxas did not fall back to one wait per MMA). A
    change that leaves an MMA in flight where ptxas cannot follow it (across the sequential loop's back edge)
    fails here, without a GPU."""
    assert sass.find_nvdisasm(), "nvdisasm missing: pip install '.[test]' (nvidia-cuda-nvdisasm)"
    code = disassembled(kernel_build(source).image)
    for entry in entries:
        w = sass.wgmma_summary(entry, code[entry])
        assert w.hgmma > 0 and not w.serialised, w
        assert w.groups < w.hgmma / 2, w


def test_the_resource_report_changes_no_instruction(kernel_build, disassembled):
    """The tests read the SASS of the build compiled with ptxas's resource report (conftest's kernel_build, shared
    with the doctor and the no-spill tests): it is the shipped build's, instruction for instruction."""
    source = "kv_write.cu"
    shipped = compile_source(source, defines=compile_defines(source), use_cache=False)
    assert sass.disassemble(shipped.image) == disassembled(kernel_build(source).image)


def test_sass_command(capsys):
    assert main(["sass", "expand_meta.cu", "q12_expand_meta", "--summary"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("// q12_expand_meta: ") and "0 HGMMA in 0 groups" in out and "tail" not in out
    assert main(["sass", "kv_write.cu"]) == 0
    out = capsys.readouterr().out
    assert "// ==== q12_kv_write (kv_write.cu, sm_90)" in out and "EXIT" in out
    # bad sources and entries: tests/test_reliability_inputs.py's CLI matrix


def test_sass_command_without_nvdisasm_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setattr(sass, "find_nvdisasm", lambda: None)
    assert main(["sass", "kv_write.cu"]) == 2
    assert "nvdisasm not found" in capsys.readouterr().err
