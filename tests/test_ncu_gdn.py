"""tools/ncu_gdn.py without a GPU: its reading of ncu's source page (a small page written here) and the plans of
the builds it profiles."""

from __future__ import annotations

import csv

import pytest

from tools import ncu_gdn as gdn_ncu

COLUMNS = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_wait"]


def _page(path, launches):
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        for name, rows in launches:
            w.writerow(["Kernel Name", name, ""])
            w.writerow(COLUMNS)
            for i, (sass, samples, executed) in enumerate(rows):
                w.writerow([hex(0x1000 + 16 * i), f"      {sass}", str(samples), str(executed), "0"])
    return path


def test_phases_split_each_launch_at_its_barriers(tmp_path):
    page = _page(tmp_path / "source.csv", [
        ("k_a", [("LDC R1, c[0x0][0x28]", 10, 100), ("IMAD R2, R1, 0x4, RZ", 20, 100),
                 ("BAR.SYNC.DEFER_BLOCKING 0x0", 10, 100),
                 ("@!P0 FFMA R3, R2, R2, R3", 50, 300), ("SYNCS.PHASECHK.TRANS64 P0, [R4], R5", 0, 100),
                 ("STS [R6], R3", 1, 100), ("EXIT", 9, 200)]),
        ("k_a", [("LDC R1, c[0x0][0x28]", 5, 10), ("EXIT", 5, 10)]),   # a second launch of the same entry
    ])
    launches = gdn_ncu.read_source_page(page)
    assert [(name, len(rows)) for name, rows in launches] == [("k_a", 7), ("k_a", 2)]
    first = gdn_ncu.phases(launches[0][1])
    assert [(a, b) for a, b, *_ in first] == [(0, 2), (3, 4), (5, 6)]
    assert [round(s, 3) for _, _, s, _, _ in first] == [0.4, 0.5, 0.1]
    assert [round(e, 3) for _, _, _, e, _ in first] == [0.3, 0.4, 0.3]
    assert first[1][4] == [("FFMA", 1), ("SYNCS", 1)]   # the predicate guard is not the opcode
    # phases under min_share of the samples are left out; a launch is summed on its own
    assert [(a, b) for a, b, *_ in gdn_ncu.phases(launches[0][1], min_share=0.2)] == [(0, 2), (3, 4)]
    assert [round(s, 3) for _, _, s, _, _ in gdn_ncu.phases(launches[1][1])] == [1.0]
    lines = []
    gdn_ncu.print_phases(page, out=lines.append)
    assert lines[0].startswith("== k_a: 7 instructions") and "50.0% samples" in lines[2]


def test_phases_flag_reads_a_kept_page_and_refuses_a_missing_one(tmp_path, capsys):
    page = _page(tmp_path / "source.csv", [("k_b", [("FADD R1, R2, R3", 3, 30), ("EXIT", 1, 10)])])
    assert gdn_ncu.main(["--phases", str(page)]) == 0
    assert "== k_b: 2 instructions" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        gdn_ncu.main(["--phases", str(tmp_path / "missing.csv")])
    assert "no such file" in capsys.readouterr().err


def test_each_build_is_the_plan_of_its_kernels():
    from types import SimpleNamespace

    from q12drv.kernels.gdn import GdnShape

    h200, shape = SimpleNamespace(arch="sm_90", sm_count=132), GdnShape(16, 32, 128)
    seq = {form: gdn_ncu.form_plan(form, shape, 8, 2048, h200).kernels[-1].entry for form in gdn_ncu.FORMS}
    assert seq == {"fused": "q12_gdn_mma_fused_d128", "mma": "q12_gdn_mma_sequential_1stage_d128",
                   "wgmma-2stage": "q12_gdn_wgmma_sequential_2stage_d128", "wide": "q12_gdn_wgmma_sequential_wide_d128",
                   "overlapped": "q12_gdn_wgmma_overlapped_sequential_d128",
                   "default": "q12_gdn_wgmma_sequential_wide_d128"}
    assert set(gdn_ncu.DEFAULT_FORMS) <= set(gdn_ncu.FORMS)
    with pytest.raises(SystemExit):
        gdn_ncu.main(["--cases", "4x4096"])
