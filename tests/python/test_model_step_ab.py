"""bench/model_step_ab.py's comparison of training-step runs with a baseline binary and with a change: the change of
the medians (against numpy's), tokens/s and MFU at the medians recomputed here from their definitions, the loss and
memory checks, the refusal of runs of another shape, and the files it writes. Random times each run."""

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import model_step_ab  # noqa: E402


def run(rng, loss=12.6205, memory=73.71, seq_len=4096):
    """One model_step_benchmark --json output with random times."""
    forward, backward = float(rng.uniform(100, 200)), float(rng.uniform(150, 250))
    return {"gpu": "NVIDIA H200", "config": "qwen3.5-0.8b", "tokens": 8 * seq_len, "sequences": 8,
            "seq_len": seq_len, "recompute": False, "loss_chunk": 4096, "step_ms": forward + backward,
            "forward_ms": forward, "backward_ms": backward, "training_gflop_per_token": 5.062742016,
            "peak_tflops": 989.0, "memory_used_gib": memory, "loss": loss}


def test_changes_are_ratios_of_medians(rng):
    base = [run(rng) for _ in range(int(rng.integers(1, 5)))]
    new = [run(rng) for _ in range(int(rng.integers(1, 5)))]
    result = model_step_ab.compare(base, new)
    for key in ("step_ms", "forward_ms", "backward_ms"):
        expected = np.median([r[key] for r in new]) / np.median([r[key] for r in base]) - 1
        assert result["times"][key]["change"] == pytest.approx(expected, rel=1e-12)
    for side, runs in (("base", base), ("new", new)):
        tokens_per_s = 8 * 4096 / (np.median([r["step_ms"] for r in runs]) / 1e3)
        assert result["tokens_per_s"][side] == pytest.approx(tokens_per_s, rel=1e-12)
        assert result["mfu"][side] == pytest.approx(5.062742016e9 * tokens_per_s / 989e12, rel=1e-12)
    assert result["loss_equal"]


def test_a_loss_that_moved_is_reported(rng):
    base = [run(rng), run(rng)]
    new = [run(rng, loss=12.6205 + float(rng.uniform(1e-9, 1e-3)))]
    result = model_step_ab.compare(base, new)
    assert not result["loss_equal"]
    assert "not the same in every run" in model_step_ab.markdown(result, {"base": "a", "new": "b"})


def test_runs_of_another_shape_are_refused_by_name(rng):
    with pytest.raises(ValueError, match="seq_len"):
        model_step_ab.compare([run(rng)], [run(rng, seq_len=2048)])
    with pytest.raises(ValueError, match="at least one run"):
        model_step_ab.compare([run(rng)], [])


def test_writes_the_comparison_and_every_run(rng, tmp_path):
    paths = {}
    for side in ("base", "new"):
        paths[side] = []
        for i in range(2):
            path = tmp_path / f"{side}-{i}.json"
            path.write_text(json.dumps(run(rng)))
            paths[side].append(str(path))
    out = tmp_path / "out"
    assert model_step_ab.main(["--base", *paths["base"], "--new", *paths["new"], "--out", str(out)]) == 0
    written = json.loads((out / "model-step-ab.json").read_text())
    assert len(written["base_runs"]) == 2 and len(written["new_runs"]) == 2
    assert (out / "model-step-ab.md").read_text().startswith("# Training step A/B")
    other = tmp_path / "other.json"
    other.write_text(json.dumps(run(rng, seq_len=1024)))
    assert model_step_ab.main(["--base", *paths["base"], "--new", str(other), "--out", str(out)]) == 2
