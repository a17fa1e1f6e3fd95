"""bench/gdn_report.py's merge of partial GDN grid runs: the latest run of a cell wins, every row keeps the run
that measured it, and the report counts the targets over the merged rows. Random times each run."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import gdn_report  # noqa: E402

CELLS = [("fwd", 16, 32, "1x8192"), ("fwd", 2, 8, "1x32768"), ("bwd", 16, 32, "8x4096")]


def run(date, commit, cells, rng):
    rows = []
    for pass_, h_qk, h_v, seqlens in cells:
        ours = float(rng.uniform(0.1, 2.0))
        rows.append({"pass": pass_, "h_qk": h_qk, "h_v": h_v, "seqlens": seqlens,
                     "ours_kernel_ms": ours, "ours_host_ms": ours, "ours_rel_err": 3e-3,
                     "fla_kernel_ms": ours * float(rng.uniform(1.0, 2.0)), "fla_host_ms": None, "fla_rel_err": None,
                     "flashqla_kernel_ms": ours * float(rng.uniform(0.4, 0.9)), "flashqla_host_ms": None,
                     "flashqla_rel_err": None})
    return {"date": date, "commit": commit, "gpu": "NVIDIA H200", "versions": {"fla": "0.6.0"}, "rows": rows}


def test_the_latest_run_of_a_cell_wins_and_rows_keep_their_run(rng):
    first = run("2026-12-01T10:00", "aaa", CELLS[:2], rng)
    second = run("2026-12-02T10:00", "bbb", CELLS[1:], rng)
    merged = gdn_report.merge([first, second])
    assert [gdn_report.cell_of(r) for r in merged["rows"]] == CELLS
    by_cell = {gdn_report.cell_of(r): r for r in merged["rows"]}
    assert by_cell[CELLS[0]]["ours_kernel_ms"] == first["rows"][0]["ours_kernel_ms"]
    assert by_cell[CELLS[0]]["run"] == "2026-12-01T10:00 aaa"
    for cell, row in zip(CELLS[1:], second["rows"]):
        assert by_cell[cell]["ours_kernel_ms"] == row["ours_kernel_ms"]
        assert by_cell[cell]["run"] == "2026-12-02T10:00 bbb"
    assert merged["commit"] == "bbb"
    assert "run" not in first["rows"][0], "merge must not tag its inputs"


def test_a_row_merged_again_keeps_its_first_run(rng):
    earlier = gdn_report.merge([run("2026-12-01T10:00", "aaa", CELLS[:1], rng)])
    later = run("2026-12-02T10:00", "bbb", CELLS[1:2], rng)
    merged = gdn_report.merge([earlier, later])
    assert [r["run"] for r in merged["rows"]] == ["2026-12-01T10:00 aaa", "2026-12-02T10:00 bbb"]


def test_the_report_names_the_runs_and_counts_targets_over_all_rows(rng, tmp_path):
    first = run("2026-12-01T10:00", "aaa", CELLS[:2], rng)
    second = run("2026-12-02T10:00", "bbb", CELLS[2:], rng)
    merged = gdn_report.merge([first, second])
    gdn_report.write(merged, str(tmp_path))
    text = (tmp_path / "gdn-h200.md").read_text()
    assert "Rows from 2 runs: 2026-12-01T10:00 aaa (2 cells); 2026-12-02T10:00 bbb (1 cells)." in text
    below = [r for r in merged["rows"] if r["flashqla_kernel_ms"] / r["ours_kernel_ms"] < 1.25]
    assert f"Kernel-time target 1.25x over FlashQLA: met on {3 - len(below)} of 3 measured cells" in text
    assert sum(line.startswith("| fwd") or line.startswith("| bwd") for line in text.splitlines()) == 3


def test_one_run_has_no_runs_line_and_nothing_to_merge_is_an_error(rng, tmp_path):
    gdn_report.write(gdn_report.merge([run("2026-12-01T10:00", "aaa", CELLS, rng)]), str(tmp_path))
    assert "Rows from" not in (tmp_path / "gdn-h200.md").read_text()
    with pytest.raises(ValueError):
        gdn_report.merge([])


def test_busy_time_is_the_union_of_the_intervals(rng):
    # Against a count of the unit steps some interval covers, on random integer intervals that overlap, nest,
    # touch and repeat.
    for _ in range(200):
        starts = rng.integers(0, 100, size=int(rng.integers(1, 12)))
        intervals = [(int(s), int(s + rng.integers(0, 30))) for s in starts]
        covered = {t for start, end in intervals for t in range(start, end)}
        assert gdn_report.busy_time(intervals) == len(covered)
    assert gdn_report.busy_time([]) == 0


def test_a_cell_outside_the_grid_parses_to_its_sequences(rng):
    for _ in range(20):
        h_qk = int(rng.integers(1, 17))
        h_v = h_qk * int(rng.integers(1, 5))
        lengths = [int(n) for n in rng.integers(1, 40000, size=int(rng.integers(1, 4)))]
        counts = [int(c) for c in rng.integers(1, 9, size=len(lengths))]
        text = ",".join(f"{n}*{c}" if c > 1 else str(n) for n, c in zip(lengths, counts))
        pass_ = str(rng.choice(["fwd", "bwd"]))
        cell = gdn_report.parse_cell(f"{pass_}:{h_qk}/{h_v}:{text}")
        assert cell == (pass_, h_qk, h_v, text, [n for n, c in zip(lengths, counts) for _ in range(c)])


@pytest.mark.parametrize("spec, rule", [
    ("fwd:2/4", "PASS:HQK/HV:LENGTHS"),
    ("both:2/4:8192", "fwd or bwd"),
    ("fwd:2:8192", "HQK/HV"),
    ("fwd:4/6:8192", "multiple of HQK"),
    ("bwd:0/4:8192", "positive"),
    ("fwd:2/4:8192*x", "LENGTH*COUNT"),
    ("fwd:2/4:4096,0", "positive"),
    ("fwd:2/4:4096*0", "positive"),
])
def test_a_malformed_cell_is_refused_naming_the_rule(spec, rule):
    with pytest.raises(ValueError, match=rule.replace("*", r"\*")) as refusal:
        gdn_report.parse_cell(spec)
    assert "--cell" in str(refusal.value)
