"""bench/gdn_ab.py's comparison of GDN runs with a baseline module and with a change: the change of the median
kernel times (against numpy's medians), whether the errors stayed equal, which kernels moved, and the cells one
side lacks. Random times each run."""

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import gdn_ab  # noqa: E402

CELLS = [("fwd", 16, 32, "1x32768"), ("fwd", 2, 8, "1x8192"), ("bwd", 2, 4, "8x4096")]
KERNELS = ("prepare_kernel", "state_forward_hopper_kernel", "start_kernel")


def run(cells, kernels_ms, rel_err=3.3e-3):
    """One --ours-only run: per cell the given per-kernel times, their sum as the kernel time."""
    rows = []
    for cell, by_kernel in zip(cells, kernels_ms):
        pass_, h_qk, h_v, seqlens = cell
        rows.append({"pass": pass_, "h_qk": h_qk, "h_v": h_v, "seqlens": seqlens,
                     "ours_kernel_ms": sum(by_kernel.values()), "ours_host_ms": sum(by_kernel.values()),
                     "ours_rel_err": rel_err, "ours_kernels_ms": by_kernel})
    return {"date": "2026-12-03T10:00", "commit": "x", "gpu": "NVIDIA H200", "versions": {}, "rows": rows}


def draw(rng, n):
    return [{k: float(rng.uniform(0.01, 1.0)) for k in KERNELS} for _ in range(n)]


def test_the_change_is_the_ratio_of_the_median_kernel_times(rng):
    base = [run(CELLS, draw(rng, 3)) for _ in range(3)]
    new = [run(CELLS, draw(rng, 3)) for _ in range(2)]
    compared, one_side = gdn_ab.compare(base, new)
    assert one_side == []
    assert [row["cell"] for row in compared] == ["fwd 16/32 1x32768", "fwd 2/8 1x8192", "bwd 2/4 8x4096"]
    for i, row in enumerate(compared):
        base_ms = [r["rows"][i]["ours_kernel_ms"] for r in base]
        new_ms = [r["rows"][i]["ours_kernel_ms"] for r in new]
        assert row["base_kernel_ms"] == base_ms and row["new_kernel_ms"] == new_ms
        assert np.isclose(row["change"], np.median(new_ms) / np.median(base_ms) - 1, rtol=1e-12)
        assert row["errors_equal"]


def test_errors_that_differ_in_any_run_are_flagged(rng):
    base = [run(CELLS[:1], draw(rng, 1)) for _ in range(2)]
    new = [run(CELLS[:1], draw(rng, 1)), run(CELLS[:1], draw(rng, 1), rel_err=3.3e-3 * (1 + 1e-9))]
    (row,), _ = gdn_ab.compare(base, new)
    assert not row["errors_equal"]
    assert row["rel_err"] == {"base": [3.3e-3], "new": sorted([3.3e-3, 3.3e-3 * (1 + 1e-9)])}
    assert "3.30000e-03 -> 3.30000e-03 / 3.30000e-03" in gdn_ab.markdown([row], [], {"base": "b", "new": "n"})


def test_each_sides_errors_are_kept_where_a_change_moves_them(rng):
    base_err, new_err = float(rng.uniform(3e-3, 4e-3)), float(rng.uniform(3e-3, 4e-3))
    (row,), _ = gdn_ab.compare([run(CELLS[:1], draw(rng, 1), base_err) for _ in range(2)],
                               [run(CELLS[:1], draw(rng, 1), new_err) for _ in range(3)])
    assert not row["errors_equal"]
    assert row["rel_err"] == {"base": [base_err], "new": [new_err]}
    assert f"{base_err:.5e} -> {new_err:.5e}" in gdn_ab.markdown([row], [], {"base": "b", "new": "n"})


def test_only_kernels_that_moved_are_listed_with_their_fastest_runs(rng):
    times = draw(rng, 1)[0]
    faster = dict(times, prepare_kernel=times["prepare_kernel"] * float(rng.uniform(0.5, 0.95)))
    faster["start_kernel"] = times["start_kernel"] * (1 + float(rng.uniform(-0.009, 0.009)))  # within 1%
    renamed = {("state_forward_produced_kernel" if k == "state_forward_hopper_kernel" else k): v
               for k, v in faster.items()}
    slower_twin = {k: v * 1.5 for k, v in renamed.items()}  # a second, slower new run: the fastest counts
    (row,), _ = gdn_ab.compare([run(CELLS[:1], [times])], [run(CELLS[:1], [renamed]), run(CELLS[:1], [slower_twin])])
    moved = row["kernels_moved"]
    assert set(moved) == {"prepare_kernel", "state_forward_hopper_kernel", "state_forward_produced_kernel"}
    assert moved["prepare_kernel"] == {"base": times["prepare_kernel"], "new": renamed["prepare_kernel"]}
    assert moved["state_forward_hopper_kernel"]["new"] is None
    assert moved["state_forward_produced_kernel"]["base"] is None


def test_cells_measured_on_one_side_are_named_not_compared(rng):
    base = [run(CELLS, draw(rng, 3))]
    new = [run(CELLS[:2], draw(rng, 2))]  # the new run stopped at its time limit
    compared, one_side = gdn_ab.compare(base, new)
    assert [row["cell"] for row in compared] == ["fwd 16/32 1x32768", "fwd 2/8 1x8192"]
    assert one_side == [{"cell": "bwd 2/4 8x4096", "side": "base"}]


def test_main_writes_the_comparison_and_every_run(rng, tmp_path):
    paths = {}
    for side, n in (("base", 2), ("new", 2)):
        paths[side] = []
        for i in range(n):
            path = tmp_path / f"{side}-{i}.json"
            path.write_text(json.dumps(run(CELLS, draw(rng, 3))))
            paths[side].append(str(path))
    out = tmp_path / "out"
    assert gdn_ab.main(["--base", *paths["base"], "--new", *paths["new"], "--out", str(out),
                        "--label-new", "d7e9b69"]) == 0
    written = json.loads((out / "gdn-ab.json").read_text())
    assert len(written["base_runs"]) == 2 and len(written["new_runs"]) == 2
    assert [row["cell"] for row in written["cells"]] == [row["cell"] for row in gdn_ab.compare(
        written["base_runs"], written["new_runs"])[0]]
    text = (out / "gdn-ab.md").read_text()
    assert "against d7e9b69 (new)" in text
    for row in written["cells"]:
        assert f"| {row['cell']} |" in text and f"{row['change']:+.1%}" in text
