"""bench/update_results.py: a gpu_compare run's rows replace RESULTS.md's, matched by name and comparator."""

from bench.update_results import format_row, update

HEAD = ["| row | q12drv (us) | comparator | comparator (us) | ratio | goal | met | measured (UTC) | machine | commit "
        "| note |", "|---|--:|---|--:|--:|---|---|---|---|---|---|"]
OLD = [
    "| kv 64k: vs floor | 75.3 | floor: 268 MB at 4.23 TB/s | 63.5 | 1.187 | <= 1.33 | yes | 2026-12-02 02:56 | H200 "
    "| 387c90b |  |",
    "| attn D128 | 500.0 | FA2 | 480.0 | 1.042 | <= 1 | NO | 2026-12-02 02:56 | H200 | 387c90b |  |",
    "| attn D128 | 500.0 | cuDNN | 260.0 | 1.923 | <= 1.25 | NO | 2026-12-02 02:56 | H200 | 387c90b | kept |",
    "| gdn 8x2048: default | - | mma two-pass | - | - | - | - | not measured yet | - | - | |",
]
RUN = {"meta": {"date_utc": "2026-12-05T02:04:56+00:00", "commit": "abc1234", "dirty": False},
       "table": [
           {"name": "kv 64k: vs floor", "q12drv_us": 74.0, "comparator": "floor: 201 MB at 4.23 TB/s",
            "comparator_us": 47.6, "ratio": 1.5546, "goal": "<= 1.33", "met": False, "note": "3.6 TB/s"},
           {"name": "attn D128", "q12drv_us": 1234.5, "comparator": "FA2", "comparator_us": 1000.0, "ratio": 1.2345,
            "goal": "<= 1", "met": False, "note": ""},
           {"name": "gdn 8x2048: default (chunked two_pass wgmma wide)", "q12drv_us": 414.6,
            "comparator": "mma two-pass", "comparator_us": 687.5, "ratio": 0.603, "goal": None, "met": None,
            "note": "info"},
           {"name": "new row", "q12drv_us": 1.0, "comparator": "x", "comparator_us": 1.0, "ratio": 1.0, "goal": None,
            "met": None, "note": ""},
       ]}


def test_measured_rows_replace_theirs_and_the_rest_stay():
    lines, replaced, unplaced = update(HEAD + OLD, RUN, "H200")
    assert lines[:2] == HEAD and len(lines) == len(HEAD + OLD)
    # a floor whose byte count changed: the one row of that name
    assert lines[2] == ("| kv 64k: vs floor | 74.0 | floor: 201 MB at 4.23 TB/s | 47.6 | 1.555 | <= 1.33 | NO | "
                        "2026-12-05 02:04 | H200 | abc1234 | 3.6 TB/s |")
    # two rows of one name: the comparator decides; thousands separated
    assert lines[3].startswith("| attn D128 | 1,234.5 | FA2 | 1,000.0 | 1.234 |") and lines[4] == OLD[2]
    # what a default resolved to is dropped from the name where the file has the name without it
    assert lines[5].startswith("| gdn 8x2048: default | 414.6 | mma two-pass | 687.5 | 0.603 | - | - |")
    assert len(replaced) == 3 and unplaced == ["new row | x"]
    # a name with one row in the file but two in the run: each comparator finds its own row or none, never another's
    two = dict(RUN, table=[dict(RUN["table"][0], comparator="floor: x"), dict(RUN["table"][0], comparator="floor: y")])
    lines2, replaced2, unplaced2 = update(HEAD + OLD, two, "H200")
    assert lines2 == HEAD + OLD and not replaced2 and len(unplaced2) == 2
    lines, _, _ = update(HEAD + OLD, RUN, "H200", commit="def5678")  # the tree measured, where the run says another
    assert lines[2].endswith("| H200 | def5678 | 3.6 TB/s |")


def test_a_dirty_tree_is_marked_and_pipes_in_text_are_kept_out_of_the_cells():
    row = {"name": "a|b", "q12drv_us": None, "comparator": "c", "comparator_us": 2.0, "ratio": None, "goal": None,
           "met": None, "note": "x|y"}
    assert format_row(row, "2026-12-05 02:04", "H200", "abc1234+") == \
        "| a/b | - | c | 2.0 | - | - | - | 2026-12-05 02:04 | H200 | abc1234+ | x/y |"
