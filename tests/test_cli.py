"""The `zeroshard` command: the parser, `estimate`, `check-config` and `report`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from zeroshard.cli.estimate import format_bytes, parse_count
from zeroshard.cli.main import build_parser, main
from zeroshard.version import __version__


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    status = main(argv)
    out, err = capsys.readouterr()
    return status, out, err


def test_subcommands_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    help_text = build_parser().format_help()
    for command in ("launch", "estimate", "report", "check-config"):
        assert command in help_text
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"zeroshard {__version__}"
    with pytest.raises(SystemExit) as exit_:
        main([])  # a subcommand is required: argparse's usage error
    assert exit_.value.code == 2


# -- estimate ------------------------------------------------------------------------------------------------


def test_counts_and_gigabytes_are_written_as_people_write_them() -> None:
    assert [parse_count(t) for t in ("7e9", "7B", "1.3b", "125M", "350_000_000", "2k")] == [
        7 * 10**9,
        7 * 10**9,
        13 * 10**8,
        125 * 10**6,
        350 * 10**6,
        2000,
    ]
    for bad in ("seven", "0", "1.5", "7X"):
        with pytest.raises(Exception, match="count"):
            parse_count(bad)
    assert [format_bytes(b) for b in (112 * 10**9, 38_500_000_000, 26_250_000_000, 0, 16_000_000)] == [
        "112",
        "38.5",
        "26.25",
        "0",
        "0.016",
    ]


def test_estimate_prints_the_zero_papers_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(["estimate", "--params", "7e9", "--gpus-per-node", "8", "--nodes", "1"], capsys)
    assert status == 0
    rows = {tuple(line.split()[:2]): line.split() for line in out.splitlines() if line[:1].isdigit()}
    # Columns: stage, offload, params, grads, optimizer, per GPU, CPU/node, NVMe/node.
    assert [rows[(str(s), "none")][5] for s in range(4)] == ["112", "38.5", "26.25", "14"]
    assert rows[("2", "optimizer-cpu")][5:] == ["14", "112", "0"]
    assert "bf16 mixed-precision Adam, 8 GPUs" in out and "GB = 1e9 bytes" in out
    assert "--largest-layer" in out  # stage 3's gathered layer is not counted without it


def test_estimate_with_hybrid_sharding_and_hpz(capsys: pytest.CaptureFixture[str]) -> None:
    """16 GPUs on 2 nodes: MiCS over a node is the 8-GPU estimate; hpZ adds 1/8 of the 16-bit parameters."""
    base = ["estimate", "--params", "7e9", "--gpus-per-node", "8", "--nodes", "2"]
    for extra, stage3 in ((["--mics-shard-size", "8"], "14"), (["--hpz-partition-size", "8"], "8.75")):
        status, out, _ = run([*base, *extra], capsys)
        rows = {tuple(line.split()[:2]): line.split() for line in out.splitlines() if line[:1].isdigit()}
        assert status == 0 and rows[("3", "none")][5] == stage3, out
    status, _, err = run([*base, "--mics-shard-size", "3"], capsys)
    assert status == 1 and "mics_shard_size: 3 is not allowed with 16 ranks" in err


def test_estimate_from_a_hugging_face_config_with_a_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_positions": 1024}
        )
    )
    png = tmp_path / "memory.png"
    status, out, err = run(
        ["estimate", "--model", str(config), "--gpus-per-node", "2", "--dtype", "fp32", "--plot", str(png)],
        capsys,
    )
    assert status == 0, err
    assert "gpt2-style model, 124,439,808 parameters, largest layer 38,597,376" in out
    assert "layer" in out.splitlines()[2]  # the gathered-layer column appears when the layer is known
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_estimate_json_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(["estimate", "--params", "1B", "--offload", "none", "--json"], capsys)
    data: dict[str, Any] = json.loads(out)
    assert status == 0 and data["num_parameters"] == 10**9 and len(data["rows"]) == 4
    assert data["rows"][0]["per_gpu"] == 16 * 10**9
    status, _, err = run(["estimate", "--params", "1B", "--gpus-per-node", "0"], capsys)
    assert (
        status == 1
        and err
        == "zeroshard estimate: error: gpus_per_node: 0 is not allowed; expected a whole number >= 1\n"
    )
    status, _, err = run(["estimate", "--model", str(tmp_path / "missing.json")], capsys)
    assert status == 1 and "cannot read the model config" in err and "Traceback" not in err


# -- check-config --------------------------------------------------------------------------------------------


def write(tmp_path: Path, config: dict[str, Any] | str) -> str:
    path = tmp_path / "ds_config.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return str(path)


def test_check_config_prints_the_resolved_config_and_warnings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(
        tmp_path,
        {
            "train_batch_size": 32,
            "gradient_accumulation_steps": 2,
            "aio": {"thread_count": 2},
            "zero_optimization": {"stage": 2},
        },
    )
    status, out, err = run(["check-config", path, "--world-size", "4"], capsys)
    assert status == 0
    resolved = json.loads(out)
    # The batch triad resolved for world size 4, and defaults filled in.
    assert (resolved["train_micro_batch_size_per_gpu"], resolved["world_size"]) == (4, 4)
    assert resolved["zero_optimization"]["stage"] == 2 and resolved["gradient_clipping"] == 1.0
    assert "warning: aio.thread_count is deprecated" in err
    assert err.rstrip().endswith(f"{path}: valid for world size 4 (1 warning)")


def test_check_config_quiet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, {"train_micro_batch_size_per_gpu": 2})
    status, out, err = run(["check-config", "-q", path], capsys)
    assert (status, out) == (0, "") and "valid for world size 1 (0 warnings)" in err


@pytest.mark.parametrize(
    ("config", "argv", "message"),
    [
        # The triad does not divide: the equation is in the message.
        (
            {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4},
            ["--world-size", "4"],
            "train_batch_size",
        ),
        ({"train_batch_size": 8, "zero_optimization": {"stage": 5}}, [], "zero_optimization.stage"),
        ({"train_batch_size": 8, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, [], "bf16"),
        ({"train_batch_size": 8, "zero_optimisation": {"stage": 1}}, [], "zero_optimization"),  # did you mean
        ('{"train_batch_size": 8]', [], "is not valid JSON: line 1"),
        ({"train_batch_size": 8}, ["--world-size", "0"], "world_size: 0 is not allowed"),
    ],
)
def test_check_config_errors_exit_1_with_the_message(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    config: dict[str, Any] | str,
    argv: list[str],
    message: str,
) -> None:
    path = write(tmp_path, config)
    status, out, err = run(["check-config", path, *argv], capsys)
    assert (status, out) == (1, "")
    assert err.startswith("zeroshard check-config: error: ") and message in err
    assert "Traceback" not in err


def test_check_config_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run(["check-config", str(tmp_path / "nope.json")], capsys)
    assert status == 1 and "config file not found" in err


def test_check_config_resolves_auto_from_the_model_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(
        tmp_path,
        {
            "train_batch_size": 8,
            "bf16": {"enabled": "auto"},
            "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
        },
    )
    status, out, _ = run(["check-config", path, "--hidden-size", "64", "--model-dtype", "bf16"], capsys)
    resolved = json.loads(out)
    assert status == 0 and resolved["bf16"]["enabled"] is True
    assert resolved["zero_optimization"]["reduce_bucket_size"] == 64 * 64


# -- report --------------------------------------------------------------------------------------------------


def test_report_lists_versions_backends_and_resources(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(["report"], capsys)
    assert status == 0
    for needle in (
        "zeroshard",
        "torch",
        "python",
        "gloo",
        "nccl",
        "CUDA available",
        "CPUs",
        "RAM",
        "disk free",
        "os.preadv / os.pwritev",
        "tensorboard",
        "wandb",
        "NVMe devices",
    ):
        assert needle in out, needle
    status, out, _ = run(["report", "--json"], capsys)
    data = json.loads(out)
    assert data["versions"]["zeroshard"] == __version__
    assert data["torch.distributed backends"]["gloo"] == "yes"
