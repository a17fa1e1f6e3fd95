"""bench/gpu/kernel_profile.py over an ncu CSV written here: launches in order with their units converted, kernels
grouped by name without template arguments or anonymous namespaces, segments opened by a kernel. Random times each
run; the expected sums are the generator's own."""

import csv
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "gpu"))
import kernel_profile  # noqa: E402

FIELDS = ["ID", "Process ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value"]
UNITS = {"ns": 1e3, "us": 1.0, "nsecond": 1e3, "usecond": 1.0}  # how many of the unit make a microsecond


def write_csv(path, launches):
    """launches: (name, microseconds, unit); ncu's own lines and another metric's rows around them."""
    with open(path, "w", newline="") as f:
        f.write("==PROF== Connected to process 1\n")
        writer = csv.writer(f, quoting=csv.QUOTE_ALL)
        writer.writerow(FIELDS)
        for i, (name, us, unit) in enumerate(launches):
            value = us * UNITS[unit]
            writer.writerow([i, 1, name, "gpu__time_duration.sum", unit, f"{value:,.3f}"])
            writer.writerow([i, 1, name, "sm__cycles_elapsed.avg", "cycle", "12"])


def test_launches_segments_and_groups(tmp_path, rng):
    names = ["void model::<unnamed>::embedding_forward_kernel<1>(Matrix)",
             "void unnamed>::rms_kernel<16, 1>(Matrix, float)",
             "nvjet_sm90_tst_64x8_64x16_1x2_h_bz_TNT",
             "void model::elementwise_kernel<1, 2, 1, model::<unnamed>::Add>(Operands<2, 1>)"]
    launches, segments = [], []
    for _ in range(3):  # three steps, each opened by the embedding kernel
        step = [(names[0], float(rng.uniform(1, 5)), "ns")]
        step += [(names[int(rng.integers(1, 4))], float(rng.uniform(1, 100)), str(rng.choice(list(UNITS))))
                 for _ in range(int(rng.integers(2, 9)))]
        launches += step
        segments.append(step)
    path = tmp_path / "ncu.csv"
    write_csv(path, launches)

    rows = kernel_profile.launches(path)
    assert [name for name, _ in rows] == [name for name, _, _ in launches]
    for (_, got), (_, us, _) in zip(rows, launches):
        assert abs(got - us) <= 1e-3 * us + 1e-3

    parts = kernel_profile.segments(rows, "embedding_forward")
    assert [len(p) for p in parts] == [len(s) for s in segments]

    assert kernel_profile.short_name(names[0]) == "model::embedding_forward_kernel"
    assert kernel_profile.short_name(names[1]) == "rms_kernel"
    assert kernel_profile.short_name(names[3]) == "model::elementwise_kernel"
    table = kernel_profile.table(parts[1], top=10, markdown=True)
    total = sum(us for _, us, _ in segments[1])
    last = table.splitlines()[-1].split()  # "total T us in N launches"
    assert last[0] == "total" and int(last[4]) == len(segments[1])
    assert abs(float(last[1]) - total) <= 0.05 + 1e-3 * total
    add = sum(us for name, us, _ in segments[1] if "Add" in name)
    row = [line for line in table.splitlines() if line.startswith("| model::elementwise_kernel |")]
    assert len(row) == (1 if add > 0 else 0)
    if row:
        assert abs(float(row[0].split("|")[2]) - add) <= 0.05 + 1e-3 * add
