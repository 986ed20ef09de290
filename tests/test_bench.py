"""bench/peers.py --quick end to end: every system runs, agrees with the single-process loss, and the JSON
holds finite figures. No timing assertions: the machine is shared."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXPECTED = ["ddp", "torch-zero1", "fsdp2-noreshard", "fsdp2"] + [f"zeroshard-stage{s}" for s in range(4)]


def test_peers_quick(tmp_path: Path) -> None:
    out = tmp_path / "peers_quick.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "peers.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    summary = json.loads(out.read_text())["sizes"]["quick"]["summary"]
    assert sorted(summary) == sorted(EXPECTED)
    for name, row in summary.items():
        for key, value in row.items():
            if isinstance(value, (int, float)):
                assert math.isfinite(value), (name, key, value)
        assert row["median_s"] > 0 and row["model_state_bytes"] > 0, name
        # Same model, data and optimizer as the single-process reference: fp32 reduction-order noise only.
        assert row["max_abs_loss_diff"] < 1e-4, (name, row["max_abs_loss_diff"])
