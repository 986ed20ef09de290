"""bench/cpu_adam.py --quick end to end: every variant runs, throughput is finite, numerics match torch AdamW
foreach. DeepSpeedCPUAdam runs only where bench/.venv-peers exists. No timing assertions: the machine is
shared."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LOCAL = ["torch-adamw-loop", "torch-adamw-foreach", "torch-adamw-fused", "zeroshard-DeepSpeedAdam"]
DEEPSPEED = "deepspeed-cpu-adam"
HAS_PEERS = (ROOT / "bench" / ".venv-peers" / "bin" / "python").exists()


@pytest.mark.integration
# Generous: DeepSpeed builds its C++ op on the first run in a fresh cache (a minute or more); ~15 s after.
@pytest.mark.timeout(300)
def test_cpu_adam_quick(tmp_path: Path) -> None:
    out = tmp_path / "cpu_adam_quick.json"
    # Without bench/.venv-peers the script still runs; its DeepSpeed rows say why they are empty.
    cmd = [sys.executable, str(ROOT / "bench" / "cpu_adam.py"), "--quick", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    expected = LOCAL + ([DEEPSPEED] if HAS_PEERS else [])
    cases = {(r["threads"], r["tensors"]) for r in doc["summary"]}
    assert cases == {(t, n) for t in doc["settings"]["threads"] for n in doc["settings"]["tensors"]}
    for case in cases:
        rows = {r["variant"]: r for r in doc["summary"] if (r["threads"], r["tensors"]) == case}
        if not HAS_PEERS:
            assert "not found" in rows.pop(DEEPSPEED)["error"]
        assert sorted(rows) == sorted(expected), case
        for name, row in rows.items():
            assert "error" not in row, (case, name, row)
            assert math.isfinite(row["params_per_s"]) and row["params_per_s"] > 0, (case, name)
            # fp32 rounding order only: a few ulps of the largest parameter after four steps.
            assert row["max_rel_diff"] <= 1e-6, (case, name, row["max_rel_diff"])
            if HAS_PEERS:
                assert math.isfinite(row["x_deepspeed"]), (case, name)
    assert doc["table_markdown"].count("\n") == len(doc["summary"]) + 1
