"""``python -m benchmarks.host_time`` writes its record (a small batch: the
figures themselves are the committed results', not asserted here)."""

import json

from benchmarks.host_time import CONTROL_PARTS, PLANNER_PARTS, SLOT_PARTS, main

PNG_MAGIC = b"\x89PNG"


def test_host_time_benchmark_writes_json_md_and_png(tmp_path):
    main(["--batch", "8", "--steps", "20", "--warmup", "5", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    measurement = results["measurement"]
    assert set(measurement["parts"]) == set(SLOT_PARTS) | set(PLANNER_PARTS) | set(CONTROL_PARTS)
    assert measurement["planner_python_ms"]["median"] > 0
    assert measurement["goodput_python_ms"]["median"] > 0
    assert measurement["retrievals"] > 0 and measurement["planner_tensor_ops_per_step"] > 0
    assert results["commit"] and results["machine"]["cpu_model"]
    assert "batch 8" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "results.png").read_bytes().startswith(PNG_MAGIC)
