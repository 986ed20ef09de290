"""bench/peers.py --quick end to end: every system runs, agrees with the single-process loss, and the JSON
holds finite figures; bench/report.py's table gives a system that did not run a row saying why. No timing
assertions: the machine is shared."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import report  # noqa: E402  (bench/ is not a package)

EXPECTED = (
    ["ddp", "torch-zero1", "fsdp2-noreshard", "fsdp2"]
    + [f"zeroshard-stage{s}" for s in range(4)]
    + ["zeroshard-stage3-lean", "zeroshard-stage2-nvme-opt", "zeroshard-stage3-nvme-opt-param"]
)
NVME = ["zeroshard-stage2-nvme-opt", "zeroshard-stage3-nvme-opt-param"]


@pytest.mark.integration
def test_peers_quick(tmp_path: Path) -> None:
    out = tmp_path / "peers_quick.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "peers.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    size = json.loads(out.read_text())["sizes"]["quick"]
    summary = size["summary"]
    assert sorted(summary) == sorted(EXPECTED)
    assert size["did_not_run"] == {}
    for name, row in summary.items():
        for key, value in row.items():
            if isinstance(value, (int, float)):
                assert math.isfinite(value), (name, key, value)
        assert row["median_s"] > 0 and row["model_state_bytes"] > 0, name
        # Same model, data and optimizer as the single-process reference: fp32 reduction-order noise only.
        assert row["max_abs_loss_diff"] < 1e-4, (name, row["max_abs_loss_diff"])
        # The NVMe rows really moved state to files, and keep less in memory than the same stage without.
        if name in NVME:
            stage = name[: len("zeroshard-stageN")]
            assert row["offloaded_bytes"] > 0, name
            assert row["model_state_bytes"] < summary[stage]["model_state_bytes"], name
    assert report.table(size).count("\n") == len(summary) + 1


def test_table_row_for_a_system_that_did_not_run() -> None:
    ran = {
        "stage": 0,
        "median_s": 1.0,
        "min_s": 0.9,
        "max_s": 1.1,
        "step_ratio_to_ddp": 1.0,
        "step_ratio_to_ddp_per_round": [1.0],
        "peak_rss_above_baseline_bytes": 2**20,
        "peak_rss_ratio_to_ddp": 1.0,
        "model_state_bytes": 2**20,
        "model_state_ratio_to_ddp": 1.0,
        "zero_formula_bytes": 2**20,
        "comm_bytes_per_step": 2**20,
        "comm_source": "formula",
        "max_abs_loss_diff": 0.0,
    }
    why = "DeepSpeed's async_io op does not load here: no libaio | headers"
    size = {"summary": {"ddp": ran, "deepspeed-stage3-nvme-opt": {"stage": 3, "did_not_run": why}}}
    lines = report.table(size).splitlines()
    assert len(lines) == 4
    assert "did not run: DeepSpeed's async_io op does not load here: no libaio \\| headers" in lines[3]
    # Every row has the header's number of cells (escaped pipes are not cell separators).
    cells = [line.replace("\\|", "").count("|") for line in lines]
    assert cells == [cells[0]] * 4, cells


@pytest.mark.integration
def test_step_time_quick(tmp_path: Path) -> None:
    """bench/step_time.py --quick end to end on the tiny MLP: rows for DDP and zeroshard stage 2, finite
    figures, and the step's scalar checks in one control collective. No timing assertions."""
    out = tmp_path / "step_time_quick.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "step_time.py"),
            "--quick",
            "--models",
            "mlp",
            "--only",
            "zeroshard-stage2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=280,  # two interpreter pairs; ~15 s on a quiet machine
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    summary = result["summary"]["mlp"]
    assert sorted(summary) == ["ddp", "zeroshard-stage2"]
    for name, row in summary.items():
        assert row["median_s"] > 0 and math.isfinite(row["ratio_to_ddp"]), name
        assert row["model_state_bytes"] > 0 and math.isfinite(row["final_loss"]), name
    calls = summary["zeroshard-stage2"]["comm_calls_per_step_by_op"]
    assert calls == {"reduce_scatter": 1, "all_gather": 1, "control": 1}, calls
    assert result["table_markdown"].count("\n") == 1 + len(summary)


PROFILE_ARGS = ("--stage", "3", "--lean", "--quick", "--steps", "2")


@pytest.mark.integration
@pytest.mark.timeout(320)
def test_activation_memory_and_memory_profile_quick(tmp_path: Path) -> None:
    """bench/activation_memory.py and bench/memory_profile.py --quick run and write their figures."""
    out = tmp_path / "activation.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "activation_memory.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["seq_len"], r["checkpointing"]) for r in rows] == [
        (32, False),
        (32, True),
        (64, False),
        (64, True),
    ]
    assert all(r["peak_gathered_bytes"] > 0 and r["model_state_bytes"] > 0 for r in rows)
    out = tmp_path / "profile.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "memory_profile.py"), *PROFILE_ARGS, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rank0 = json.loads(out.read_text())["per_rank"][0][0]
    assert [p["phase"] for p in rank0["phases"]][-3:] == ["1 forward", "1 backward", "1 step"]
    assert rank0["breakdown"]["total"] > 0


def test_soak_summary_and_table() -> None:
    """bench/soak.py arithmetic on made-up samples: growth counts from the first sample after a save."""
    # bench/soak.py imports bench/common.py as `common`; tests/ds_scripts has a `common` of its own, which
    # test_deepspeed_compat puts in sys.modules when it is collected.
    other = sys.modules.pop("common", None)
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import soak
    finally:
        sys.path.remove(str(ROOT / "bench"))
        sys.modules.pop("common", None)
        if other is not None:
            sys.modules["common"] = other

    def samples(rss: list[int], fds: list[int]) -> dict[str, object]:
        rows = [
            {"step": 10 * i, "rss": r * soak.MIB, "fds": f, "threads": 4}
            for i, (r, f) in enumerate(zip(rss, fds, strict=True))
        ]
        return {"samples": rows}

    per_rank = [
        samples([300, 320, 321, 320, 322], [15, 15, 16, 15, 15]),
        samples([300, 310, 310, 310, 310], [9] * 5),
    ]
    summary = soak.summarize(per_rank)
    assert summary["rank0"]["rss_growth_after_first_save_mib"] == 2.0
    assert summary["rank0"]["rss_max_minus_min_after_first_save_mib"] == 2.0
    assert summary["rank0"]["fds_range_after_first_save"] == [15, 16]
    assert summary["rank1"]["rss_growth_after_first_save_mib"] == 0.0
    assert summary["rank1"]["threads_range_after_first_save"] == [4, 4]
    lines = soak.table(per_rank).splitlines()
    assert len(lines) == 2 + 5 and lines[3] == "| 10 | 320.0 | 310.0 | 15 | 9 | 4 | 4 |"


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_soak_quick(tmp_path: Path) -> None:
    """bench/soak.py --quick end to end: 40 steps and 4 saves at W=2; keep_last leaves 2 tags; descriptors
    and threads do not grow from save to save (an open file or a thread left behind per save would)."""
    out = tmp_path / "soak_quick.json"
    cmd = [sys.executable, str(ROOT / "bench" / "soak.py"), "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["settings"]["steps"] == 40 and doc["settings"]["save_every"] == 10
    for rank in doc["ranks"]:
        assert [s["step"] for s in rank["samples"]] == [0, 10, 20, 30, 40]
        assert len(rank["kept_tags"]) == 2, rank["kept_tags"]
        assert math.isfinite(rank["last_loss"]) and rank["last_loss"] < rank["first_loss"]
    for name, row in doc["summary"].items():
        assert row["fds_range_after_first_save"][0] == row["fds_range_after_first_save"][1], (name, row)
        assert row["threads_range_after_first_save"][0] == row["threads_range_after_first_save"][1], (
            name,
            row,
        )
    assert doc["table_markdown"].count("\n") == 1 + 5


MULTINODE_ROWS = ["ddp", "fsdp2-hsdp", "zeroshard-stage3", "zeroshard-stage3-mics2"]


@pytest.mark.integration
@pytest.mark.timeout(600)
@pytest.mark.skipif(os.geteuid() != 0, reason="bench/multinode.py builds network namespaces: needs root")
def test_multinode_quick(tmp_path: Path) -> None:
    """bench/multinode.py --quick on one row of each kind: the link is shaped (a stream across it runs at
    about --rate, one inside a namespace leaves the veth alone), every row's ranks send bytes across it, MiCS
    less than plain stage 3, losses equal DDP's; nothing is left behind. No step-time assertions."""
    out = tmp_path / "multinode_quick.json"
    cmd = [sys.executable, str(ROOT / "bench" / "multinode.py"), "--quick", "--rate", "200mbit"]
    proc = subprocess.run(
        [*cmd, "--only", *MULTINODE_ROWS, "--out", str(out)], capture_output=True, text=True, timeout=580
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    link = doc["link"]
    assert link["rate_bits_per_s"] == 200e6 and link["across_gbit_per_s"] < 0.25, link
    assert link["inside_node_veth_tx_bytes"] < 2**16 < link["across_veth_tx_bytes"], link
    rows = doc["rows"]
    assert list(rows) == MULTINODE_ROWS
    for name, row in rows.items():
        assert row["median_step_s"] > 0 and row["cross_node_bytes_per_step"] > 0, name
        assert row["max_abs_loss_diff_vs_ddp"] < 1e-4, (name, row["max_abs_loss_diff_vs_ddp"])
    mics = rows["zeroshard-stage3-mics2"]
    assert mics["key_in_effect"] is True
    assert mics["cross_node_bytes_per_step"] < rows["zeroshard-stage3"]["cross_node_bytes_per_step"]
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "zs_node" not in names, names


@pytest.mark.integration
def test_gpu_scripts_run_their_cpu_check(tmp_path: Path) -> None:
    """bench/gpu.py and bench/gpu_largest.py run only on a lent GPU machine, in one try: ``--device cpu
    --quick`` takes every path of both on a CPU (the figures mean nothing), so a script that would fail there
    fails here first."""
    rows = tmp_path / "rows.json"
    largest = tmp_path / "largest.json"
    for script, out, extra in (
        ("gpu.py", rows, ["--rows", "zero2_offload,zero3_offload_param,zero3_offload_all"]),
        ("gpu_largest.py", largest, ["--budget-s", "40"]),
    ):
        proc = subprocess.run(
            [
                sys.executable,
                str(ROOT / "bench" / script),
                "--quick",
                "--device",
                "cpu",
                "--out",
                str(out),
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    done = {r["row"]: r for r in json.loads(rows.read_text())["results"]}
    assert sorted(done) == ["zero2_offload", "zero3_offload_all", "zero3_offload_param"], done
    assert all("error" not in r and r["median_s"] > 0 for r in done.values()), done
    assert json.loads(largest.read_text())
