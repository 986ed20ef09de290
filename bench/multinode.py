"""Two simulated nodes joined by a rate-limited link: step time and the bytes that cross it per step.

    sudo .venv/bin/python bench/multinode.py            # small GPT, every row (5-9 min on 2 cores)
    sudo .venv/bin/python bench/multinode.py --large    # bench/peers.py's large GPT (much longer)
    sudo .venv/bin/python bench/multinode.py --quick    # tiny GPT, 2 steps: a smoke test
    sudo .venv/bin/python bench/multinode.py --rate 500mbit

The network: two network namespaces, ``zs_node0`` and ``zs_node1``, joined by a veth pair (``zs_veth0`` at
10.77.0.1/24, ``zs_veth1`` at 10.77.0.2/24), each end shaped by a token-bucket filter (``tc ... tbf rate
RATE``; this kernel has no ``netem``). Two ranks run in each namespace (W = 4) with the launcher's variables
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE=2, GROUP_RANK), MASTER_ADDR=10.77.0.1 and
GLOO_SOCKET_IFNAME naming the namespace's veth end, so gloo binds every rank to its node's veth address.
Packets between the two ranks of one namespace are addressed to that namespace's own address and stay on its
loopback; only traffic between namespaces crosses the veth pair, and ``link_check`` measures both (a TCP
stream across the link at about RATE, one inside a namespace that adds nothing to the veth counters).

Per row, one fresh set of four interpreters: build, warm up, barrier, read the veth's counters
(``/proc/net/dev`` inside each namespace), time the steps, barrier, read the counters again. The bytes that
crossed the link are the transmitted bytes of both veth ends (each packet counted once; Ethernet, IP and TCP
headers and acknowledgements included). Step time is the slowest rank's, median over the timed steps. The
formula column is the payload that must cross per step, in units of Ψ (the model's fp32 parameter bytes), for
2 nodes of 2 ranks: zeroshard's direct exchange sends each remote rank its 1/W, so a collective over all four
ranks moves 2Ψ across; an all-reduce of each 1/S shard between the S-groups of the two nodes moves 2Ψ.
Stage-3 rows release every unit after its forward (``stage3_max_reuse_distance`` 0, as FSDP2 reshards after
forward), so plain stage 3 moves 6Ψ, MiCS (S = 2) 2Ψ and hpZ (secondary partition of 2) 4Ψ; ZeRO++ (hpZ with
int8 weights and gradients, core/quantize.py [Note: quantized collectives]) sends hpZ's 4Ψ as int8 with a
4-byte scale per 256 values, 4Ψ x 1.016/4 = 1.02Ψ.

Must run as root; without root or where ``ip netns`` fails it prints why and exits 0 without results. The
namespaces are removed on every exit (finally, atexit, SIGTERM/SIGINT/SIGHUP). Raw results:
``bench/results/multinode.json`` (``multinode_quick.json`` for --quick); ``make benchmarks-page`` puts the
table into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# First: common sets OMP_NUM_THREADS and MALLOC_MMAP_THRESHOLD_ before torch is imported.
from common import CLIP, LR, ROOT, WEIGHT_DECAY, build_gpt, ds_config, peak_rss, tokens_for

# isort: split
import torch
import torch.distributed as dist

from zeroshard.core.quantize import BLOCK, packed_bytes

RESULTS = ROOT / "bench" / "results"
NODES = ("zs_node0", "zs_node1")
VETHS = ("zs_veth0", "zs_veth1")
ADDRS = ("10.77.0.1", "10.77.0.2")
PER_NODE = 2
WORLD = PER_NODE * len(NODES)

SIZES: dict[str, dict[str, Any]] = {
    # bench/peers.py's small GPT (10.3M parameters, Ψ = 41 MB), 2 x 64 tokens per rank per step: at 1 Gbit/s
    # the link, not the two shared cores, decides a stage-3 step.
    "small": {
        "model": {"vocab_size": 8192, "block_size": 128, "n_layer": 4, "n_head": 6, "n_embd": 384},
        "micro_batch": 2,
        "seq_len": 64,
        "warmup": 1,
        "steps": 4,
    },
    "large": {
        "model": {"vocab_size": 16384, "block_size": 128, "n_layer": 12, "n_head": 16, "n_embd": 1024},
        "micro_batch": 1,
        "seq_len": 32,
        "warmup": 1,
        "steps": 3,
    },
    "quick": {
        "model": {"vocab_size": 256, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32},
        "micro_batch": 2,
        "seq_len": 32,
        "warmup": 1,
        "steps": 2,
    },
}


# The bytes of an fp32 value sent as blockwise int8, per byte of fp32 (core/quantize.py's packets).
INT8_PER_FP32 = packed_bytes(BLOCK) / (4 * BLOCK)


@dataclass(frozen=True)
class Row:
    """One row of the table: what trains, and what must cross the link per step by formula."""

    label: str
    runner: str
    """``ddp``, ``fsdp2``, ``hsdp`` (torch) or ``zeroshard``."""
    zero: dict[str, Any] = field(default_factory=dict)
    """zeroshard's ``zero_optimization`` block (stage-3 rows also get ``LEAN``)."""
    key: str = ""
    """The config key whose effect the row shows (MiCS, hpZ), reported as in effect or not."""
    formula_psi: float | None = None
    """Payload crossing the link per step in units of Ψ for 2 nodes of 2 ranks (module docstring)."""
    plain: str = ""
    """The row of the same stage without ``key``, which the measured fraction is taken of."""


ROWS: dict[str, Row] = {
    "ddp": Row("DDP", "ddp"),
    "fsdp2": Row("FSDP2, full shard over 4", "fsdp2"),
    "fsdp2-hsdp": Row("FSDP2 HSDP (shard 2, replicate 2)", "hsdp", formula_psi=2),
    "zeroshard-stage3": Row("zeroshard stage 3", "zeroshard", {"stage": 3}, formula_psi=6),
    "zeroshard-stage3-mics2": Row(
        "zeroshard stage 3, mics_shard_size 2",
        "zeroshard",
        {"stage": 3, "mics_shard_size": 2},
        "mics_shard_size",
        2,
        "zeroshard-stage3",
    ),
    "zeroshard-stage3-hpz2": Row(
        "zeroshard stage 3, zero_hpz_partition_size 2",
        "zeroshard",
        {"stage": 3, "zero_hpz_partition_size": 2},
        "zero_hpz_partition_size",
        4,
        "zeroshard-stage3",
    ),
    "zeroshard-stage3-zeropp": Row(
        "zeroshard stage 3, ZeRO++ (hpZ 2, qwZ, qgZ)",
        "zeroshard",
        {
            "stage": 3,
            "zero_hpz_partition_size": 2,
            "zero_quantized_weights": True,
            "zero_quantized_gradients": True,
        },
        "zero_quantized_weights",
        4 * INT8_PER_FP32,
        "zeroshard-stage3",
    ),
    "zeroshard-stage2": Row("zeroshard stage 2", "zeroshard", {"stage": 2}, formula_psi=4),
    "zeroshard-stage2-mics2": Row(
        "zeroshard stage 2, mics_shard_size 2",
        "zeroshard",
        {"stage": 2, "mics_shard_size": 2},
        "mics_shard_size",
        2,
        "zeroshard-stage2",
    ),
}


def lean(model: dict[str, Any]) -> dict[str, Any]:
    """Stage 3 released after each unit's forward and prefetching one unit, as FSDP2 with resharding."""
    return {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": int(0.9 * model["n_embd"] ** 2)}


# ------------------------------------------------------------------------------------------ one rank


def link_counters(ifname: str) -> tuple[int, int]:
    """(received, transmitted) bytes of ``ifname`` in this process's network namespace."""
    for line in Path("/proc/self/net/dev").read_text().splitlines()[2:]:
        name, _, rest = line.partition(":")
        if name.strip() == ifname:
            fields = rest.split()
            return int(fields[0]), int(fields[8])
    raise RuntimeError(f"rank {os.environ.get('RANK')}: no interface {ifname!r} in /proc/self/net/dev")


def _torch_row(runner: str, model: torch.nn.Module) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    if runner == "ddp":
        return DDP(model), torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    # HSDP: a (replicate, shard) mesh, ranks [[0, 1], [2, 3]]: shard inside a node, replicate across.
    if runner == "hsdp":
        mesh = init_device_mesh("cpu", (len(NODES), PER_NODE), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (WORLD,))
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


def _zeroshard_row(row: Row, run: dict[str, Any], model: torch.nn.Module) -> tuple[Any, bool | None]:
    """The engine, and whether ``row.key`` took effect (False when zeroshard warns it has none)."""
    import zeroshard

    zero = {**row.zero, **(lean(run["model"]) if row.zero["stage"] == 3 else {})}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, _, _, _ = zeroshard.initialize(
            model=model, model_parameters=model.parameters(), config=ds_config(zero, run["micro_batch"])
        )
    said = [str(w.message) for w in caught]
    effect = not any(row.key in m and "no effect" in m for m in said) if row.key else None
    return engine, effect


def _engine_counts(engine: Any) -> dict[str, int | None]:
    """zeroshard's own count of the bytes it moved and of those it sent across nodes (None: no engine, or
    no cross-node count in this version)."""
    cross = getattr(engine, "cross_node_bytes", None)
    return {
        "zeroshard_counted_bytes": None if engine is None else engine.communication_bytes(),
        "zeroshard_cross_node_bytes": None if cross is None else cross(),
    }


def _delta(before: int | None, after: int | None) -> int | None:
    return None if before is None or after is None else after - before


def worker(run: dict[str, Any]) -> dict[str, Any]:
    """Build the row's system, warm up, time the steps between two reads of the link's counters.

    Collective: every rank of the world runs it.
    """
    t_start = time.perf_counter()
    rank, row = dist.get_rank(), ROWS[run["row"]]
    model = build_gpt(run["model"])
    n_params = sum(p.numel() for p in model.parameters())
    engine, effect = _zeroshard_row(row, run, model) if row.runner == "zeroshard" else (None, None)
    if engine is None:
        fwd, opt = _torch_row(row.runner, model)
    n = run["warmup"] + run["steps"]
    tokens = tokens_for(rank, n, run["micro_batch"], run["model"], run["seq_len"])

    def step(i: int) -> float:
        x, y = tokens[i, :, :-1], tokens[i, :, 1:]
        if engine is not None:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        else:
            loss = fwd(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
        return float(loss.item())

    init_s = time.perf_counter() - t_start
    losses = [step(i) for i in range(run["warmup"])]
    warmup_s = time.perf_counter() - t_start - init_s
    ifname = os.environ["GLOO_SOCKET_IFNAME"]
    dist.barrier()
    before = link_counters(ifname)
    counted = _engine_counts(engine)
    times = []
    for i in range(run["warmup"], n):
        t0 = time.perf_counter()
        losses.append(step(i))
        times.append(time.perf_counter() - t0)
    dist.barrier()
    after = link_counters(ifname)
    later = _engine_counts(engine)
    return {
        "rank": rank,
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "times": times,
        "losses": losses,
        "num_parameters": n_params,
        "rx_bytes": after[0] - before[0],
        "tx_bytes": after[1] - before[1],
        **{k: _delta(v, later[k]) for k, v in counted.items()},
        "key_in_effect": effect,
        "peak_rss_bytes": peak_rss(),
        "init_s": init_s,
        "warmup_s": warmup_s,
    }


def rank_main(spec_file: str, out_file: str) -> None:
    """One rank: join the world through MASTER_ADDR/MASTER_PORT, run the row, write the result.

    Collective: every rank of the world runs it.
    """
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=300))
    try:
        result = worker(json.loads(Path(spec_file).read_text()))
        dist.barrier()  # leave together: a gloo group torn down under a peer can abort the exit
        Path(out_file).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ the network


def ip(*args: str) -> None:
    """Run ``ip ARGS`` (or ``tc`` via ``ip netns exec``); a failure raises with ip's own message."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")


def rate_bits(rate: str) -> int:
    """``1gbit`` -> 10**9: tc's bit-rate units (``bit``, ``kbit``, ``mbit``, ``gbit``; SI multiples)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)", rate.strip().lower())
    if m is None:
        raise ValueError(f"--rate {rate!r}: expected a number and bit, kbit, mbit or gbit (e.g. 1gbit)")
    return int(float(m[1]) * {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[m[2]])


class Network:
    """The two namespaces and the shaped veth pair; ``close`` removes them and the processes in them.

    ``close`` is idempotent and safe to call from a signal handler, atexit and a finally block alike.
    """

    def __init__(self, rate: str) -> None:
        self.rate = rate
        # At least 1 ms of traffic (and 64 KiB) in the bucket: with 4 KiB a 1 Gbit/s link carried 0.7-0.85.
        self.burst = max(rate_bits(rate) // 8 // 1000, 65536)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.up = False

    def open(self) -> None:
        """Create the namespaces, the veth pair, the addresses and the shaping."""
        existing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        if any(ns in existing for ns in NODES):
            raise RuntimeError(
                f"namespace {' or '.join(NODES)} exists already (another run, or one killed by SIGKILL): "
                f"remove with `ip netns del {NODES[0]}; ip netns del {NODES[1]}`"
            )
        self.up = True
        for ns in NODES:
            ip("netns", "add", ns)
        ip(
            "link",
            "add",
            VETHS[0],
            "netns",
            NODES[0],
            "type",
            "veth",
            "peer",
            "name",
            VETHS[1],
            "netns",
            NODES[1],
        )
        for ns, veth, addr in zip(NODES, VETHS, ADDRS, strict=True):
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "link", "set", veth, "up")
            tbf = ["tc", "qdisc", "add", "dev", veth, "root", "tbf", "rate", self.rate]
            ip("netns", "exec", ns, *tbf, "burst", str(self.burst), "latency", "50ms")

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        self.procs.clear()
        if not self.up:
            return
        self.up = False
        # Deleting one end deletes the pair; a namespace goes once no process is left in it.
        subprocess.run(["ip", "-n", NODES[0], "link", "del", VETHS[0]], capture_output=True)
        for ns in NODES:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def start(self, node: int, argv: list[str], env: dict[str, str], log: Any) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", NODES[node], *argv], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        self.procs.append(proc)
        return proc


def _stream(net: Network, node: int, to: str, nbytes: int) -> tuple[float, int]:
    """Send ``nbytes`` over TCP from namespace ``node`` to ``to``:5999; (seconds, node's veth tx bytes)."""
    server = (
        "import socket;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
        f"s.bind(('{to}',5999));s.listen(1);print('ready',flush=True);c,_=s.accept();n=0\n"
        f"while n<{nbytes}:\n b=c.recv(1<<20)\n if not b: break\n n+=len(b)\nc.sendall(b'k')"
    )
    target = ADDRS.index(to)
    srv = net.start(target, [sys.executable, "-c", server], dict(os.environ), subprocess.PIPE)
    assert srv.stdout is not None
    srv.stdout.readline()  # bound and listening
    ns_read = ["ip", "netns", "exec", NODES[node], "cat", f"/sys/class/net/{VETHS[node]}/statistics/tx_bytes"]
    tx0 = int(subprocess.run(ns_read, capture_output=True, text=True, check=True).stdout)
    client = (
        f"import socket,time;c=socket.create_connection(('{to}',5999));b=b'x'*(1<<20);t=time.perf_counter()\n"
        f"for _ in range({nbytes >> 20}): c.sendall(b)\nc.recv(1);print(time.perf_counter()-t)"
    )
    out = subprocess.run(
        ["ip", "netns", "exec", NODES[node], sys.executable, "-c", client], capture_output=True
    )
    srv.wait(timeout=60)
    tx1 = int(subprocess.run(ns_read, capture_output=True, text=True, check=True).stdout)
    return float(out.stdout), tx1 - tx0


def link_check(net: Network, mib: int) -> dict[str, Any]:
    """A TCP stream across the link (rate-limited) and one inside node 0 (must not touch the veth)."""
    nbytes = mib << 20
    cross_s, cross_tx = _stream(net, 0, ADDRS[1], nbytes)
    local_s, local_tx = _stream(net, 0, ADDRS[0], nbytes)
    return {
        "bytes": nbytes,
        "across_gbit_per_s": nbytes * 8 / cross_s / 1e9,
        "across_veth_tx_bytes": cross_tx,
        "inside_node_gbit_per_s": nbytes * 8 / local_s / 1e9,
        "inside_node_veth_tx_bytes": local_tx,
    }


# ------------------------------------------------------------------------------------------ the parent


def run_row(net: Network, name: str, size: dict[str, Any], port: int, timeout: float) -> list[dict[str, Any]]:
    """Row ``name`` on four fresh interpreters, two per namespace; per-rank results in rank order.

    A rank that fails takes the others down at once, and the tail of its output is raised here.
    """
    with tempfile.TemporaryDirectory(prefix="multinode-") as tmp:
        spec = Path(tmp, "spec.json")
        spec.write_text(json.dumps({**size, "row": name}))
        outs = [Path(tmp, f"out{r}.json") for r in range(WORLD)]
        logs = [open(Path(tmp, f"rank{r}.log"), "w+b") for r in range(WORLD)]
        procs = []
        for r in range(WORLD):
            node = r // PER_NODE
            env = {
                **os.environ,
                **dict(RANK=str(r), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(r % PER_NODE)),
                **dict(LOCAL_WORLD_SIZE=str(PER_NODE), GROUP_RANK=str(node), MASTER_ADDR=ADDRS[0]),
                **dict(MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=VETHS[node]),
            }
            argv = [sys.executable, str(Path(__file__).resolve()), "--rank", str(spec), str(outs[r])]
            procs.append(net.start(node, argv, env, logs[r]))
        deadline, failed = time.monotonic() + timeout, None
        while failed is None and not all(p.poll() == 0 for p in procs):
            bad = next((r for r, p in enumerate(procs) if p.poll() not in (None, 0)), None)
            if bad is not None:
                failed = (bad, f"rank {bad} exited with {procs[bad].returncode}")
            elif time.monotonic() > deadline:
                failed = (0, f"timed out after {timeout:.0f} s")
            time.sleep(0.2)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            net.procs.remove(p)
        tails = []
        for log in logs:
            log.seek(0)
            tails.append(log.read()[-4000:].decode(errors="replace"))
            log.close()
        if failed is not None:
            raise RuntimeError(f"{name}: {failed[1]}; rank {failed[0]}'s output ends:\n{tails[failed[0]]}")
        return [json.loads(o.read_text()) for o in outs]


def _per_step(per_rank: list[dict[str, Any]], key: str, steps: int) -> float | None:
    values = [r[key] for r in per_rank]
    return None if None in values else sum(values) / steps


def summarise(name: str, per_rank: list[dict[str, Any]], steps: int, psi: int) -> dict[str, Any]:
    """One row's figures: the slowest rank per step, both veth ends' counters, the largest peak RSS."""
    row = ROWS[name]
    step = [max(ts) for ts in zip(*(r["times"] for r in per_rank), strict=True)]
    node_leads = [r for r in per_rank if r["local_rank"] == 0]  # one reading per namespace
    return {
        "label": row.label,
        "median_step_s": statistics.median(step),
        "min_step_s": min(step),
        "max_step_s": max(step),
        "cross_node_bytes_per_step": sum(r["tx_bytes"] for r in node_leads) / steps,
        "cross_node_rx_bytes_per_step": sum(r["rx_bytes"] for r in node_leads) / steps,
        "formula_psi": row.formula_psi,
        "formula_bytes_per_step": None if row.formula_psi is None else row.formula_psi * psi,
        "plain": row.plain or None,
        "key": row.key or None,
        "key_in_effect": per_rank[0]["key_in_effect"],
        # zeroshard's accounting: rank 0's volume, and what all ranks sent across nodes.
        "zeroshard_counted_bytes_per_step": _per_step(per_rank[:1], "zeroshard_counted_bytes", steps),
        "zeroshard_cross_node_bytes_per_step": _per_step(per_rank, "zeroshard_cross_node_bytes", steps),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in per_rank),
        "init_s": max(r["init_s"] for r in per_rank),
        "warmup_s": max(r["warmup_s"] for r in per_rank),
        "losses": [r["losses"] for r in per_rank],
    }


def compare(rows: dict[str, dict[str, Any]]) -> None:
    """Add the ratios between rows: step time to HSDP's, crossed bytes to the plain row's, losses to DDP's."""
    hsdp = rows.get("fsdp2-hsdp")
    ddp = rows.get("ddp")
    for row in rows.values():
        row["step_ratio_to_hsdp"] = row["median_step_s"] / hsdp["median_step_s"] if hsdp else None
        plain = rows.get(row["plain"] or "")
        row["fraction_of_plain_measured"] = (
            row["cross_node_bytes_per_step"] / plain["cross_node_bytes_per_step"] if plain else None
        )
        row["fraction_of_plain_formula"] = (
            row["formula_psi"] / plain["formula_psi"] if plain and row["formula_psi"] else None
        )
        row["max_abs_loss_diff_vs_ddp"] = (
            max(
                abs(a - b)
                for x, y in zip(row["losses"], ddp["losses"], strict=True)
                for a, b in zip(x, y, strict=True)
            )
            if ddp
            else None
        )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny GPT, 2 steps (smoke test)")
    parser.add_argument("--large", action="store_true", help="bench/peers.py's large GPT (168M parameters)")
    parser.add_argument("--rate", default="1gbit", help="the link's rate, in tc's units (default 1gbit)")
    parser.add_argument("--only", nargs="+", choices=list(ROWS), help="run only these rows")
    parser.add_argument("--out", type=Path, help="JSON output (default bench/results/multinode[_quick].json)")
    parser.add_argument("--rank", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    return parser.parse_args()


def why_not_here() -> str | None:
    """Why the network cannot be built here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, tc)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"`ip netns list` failed: {probe.stderr.strip()}"


def measure(net: Network, size_name: str, rows: list[str]) -> dict[str, Any]:
    """The link check and every row, in order; the JSON document."""
    size = SIZES[size_name]
    started = time.time()
    load_before = os.getloadavg()
    check = link_check(net, 16 if size_name == "quick" else 64)
    print(
        f"link: {check['across_gbit_per_s']:.2f} Gbit/s across (rate {net.rate}), "
        f"{check['inside_node_gbit_per_s']:.1f} Gbit/s inside a node with "
        f"{check['inside_node_veth_tx_bytes']} bytes on the veth",
        flush=True,
    )
    timeout = {"quick": 180, "small": 600, "large": 3600}[size_name]
    results: dict[str, dict[str, Any]] = {}
    psi = 0
    for i, name in enumerate(rows):
        t0 = time.time()
        per_rank = run_row(net, name, size, 29400 + i, timeout)
        psi = 4 * per_rank[0]["num_parameters"]
        results[name] = summarise(name, per_rank, size["steps"], psi)
        r = results[name]
        print(
            f"{name:>24}: {r['median_step_s']:.2f} s/step, "
            f"{r['cross_node_bytes_per_step'] / 1e6:.1f} MB/step across, {time.time() - t0:.0f} s wall "
            f"(in the ranks: {r['init_s']:.0f} s to build, {r['warmup_s']:.0f} s warm-up)",
            flush=True,
        )
    compare(results)
    return {
        "command": "bench/multinode.py" + {"quick": " --quick", "large": " --large", "small": ""}[size_name],
        "size": size_name,
        "settings": {**size, "world_size": WORLD, "nodes": len(NODES), "ranks_per_node": PER_NODE},
        "link": {"rate": net.rate, "rate_bits_per_s": rate_bits(net.rate), "burst_bytes": net.burst, **check},
        "num_parameters": psi // 4,
        "psi_bytes": psi,
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "wall_s": time.time() - started,
        "rows": results,
    }


def main() -> None:
    args = parse_args()
    if args.rank:  # one rank of a row (run_row)
        rank_main(*args.rank)
        return
    rate_bits(args.rate)  # a bad --rate fails before anything is built
    why = why_not_here()
    if why is not None:
        print(f"bench/multinode.py: skipped: {why}")
        return
    net = Network(args.rate)
    atexit.register(net.close)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        net.close()
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    size_name = "quick" if args.quick else "large" if args.large else "small"
    try:
        try:
            net.open()
        except RuntimeError as e:
            print(f"bench/multinode.py: skipped: cannot build the network: {e}")
            return
        doc = measure(net, size_name, args.only or list(ROWS))
    finally:
        net.close()
    sys.path.insert(0, str(ROOT / "tools"))
    import benchmark_tables

    print("\n" + benchmark_tables.multinode(lambda _: doc))
    out = args.out or RESULTS / ("multinode_quick.json" if args.quick else "multinode.json")
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
