"""Where `zeroshard launch` runs: DeepSpeed hostfiles, include/exclude specs and the Slurm environment.

Pure functions over text and environment mappings, so they are tested without processes. Every error is a
`ValueError` whose message names the file and line, or the flag and the part of the spec, that is wrong.

[Note: hostfile]
DeepSpeed's format: one host per line, `hostname slots=N`, where N is how many processes (GPUs) it runs;
`#` starts a comment; blank lines are skipped. Hosts keep their order: the first is node 0 and its
address is the rendezvous (master) address.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "SlurmTopology",
    "expand_nodelist",
    "parse_host_spec",
    "parse_hostfile",
    "read_hostfile",
    "select_slots",
    "slurm_topology",
]

_HOST = re.compile(r"^[A-Za-z0-9_.:\-\[\]]+$")


def parse_hostfile(text: str, source: str = "hostfile") -> dict[str, int]:
    """Parses DeepSpeed's hostfile format (see [Note: hostfile]).

    Args:
        text: The file's contents.
        source: How to name the file in messages (its path).

    Returns:
        Slots per host, in file order.

    Raises:
        ValueError: On the first bad line: "hostfile F, line 3: ..." with what is wrong and what to write.
    """
    hosts: dict[str, int] = {}
    first_line: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}, line {number}"
        fields = line.split()
        if len(fields) != 2 or not fields[1].startswith("slots="):
            raise ValueError(f"{where}: {line!r} is not 'hostname slots=N' (e.g. 'worker-1 slots=8')")
        host, count = fields[0], fields[1].removeprefix("slots=")
        if not _HOST.match(host):
            raise ValueError(f"{where}: {host!r} is not a host name or address")
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"{where}: slots={count!r} is not allowed; expected a whole number >= 1")
        if host in hosts:
            raise ValueError(
                f"{where}: host {host!r} is already listed on line {first_line[host]}; list each host once"
            )
        hosts[host] = int(count)
        first_line[host] = number
    if not hosts:
        raise ValueError(f"{source}: no hosts (expected lines of 'hostname slots=N')")
    return hosts


def read_hostfile(path: str | os.PathLike[str]) -> dict[str, int]:
    """Reads and parses a hostfile; a missing file is a `ValueError` naming the path."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as err:
        raise ValueError(f"cannot read hostfile {file}: {err.strerror or err}") from None
    return parse_hostfile(text, source=f"hostfile {file}")


def parse_host_spec(spec: str, flag: str = "--include") -> dict[str, list[int] | None]:
    """Parses an include/exclude spec, DeepSpeed's `host1:0,1@host2` (`@` between hosts, `:` before slots).

    Returns:
        Host to its listed slots, or None for the whole host.

    Raises:
        ValueError: When a part is empty, a slot is not a whole number, or a host appears twice.
    """
    selected: dict[str, list[int] | None] = {}
    for part in spec.split("@"):
        host, _, slots = part.strip().partition(":")
        if not host:
            raise ValueError(f"{flag} {spec!r}: empty host in {part!r}; write host1:0,1@host2")
        if host in selected:
            raise ValueError(f"{flag} {spec!r}: host {host!r} appears twice")
        if not _:
            selected[host] = None
            continue
        values = [s.strip() for s in slots.split(",")]
        if not all(v.isdigit() for v in values):
            raise ValueError(f"{flag} {spec!r}: slots {slots!r} of {host!r} are not whole numbers like 0,1")
        selected[host] = sorted({int(v) for v in values})
    return selected


def select_slots(
    hosts: Mapping[str, int], include: str | None = None, exclude: str | None = None
) -> dict[str, list[int]]:
    """Applies an include or exclude spec to the hosts' slots, as DeepSpeed's launcher does.

    With `include`, only the listed hosts (and, where given, slots) remain; with `exclude`, the listed slots
    (or whole hosts) are removed. Hosts left without slots are dropped; host order is kept.

    Raises:
        ValueError: When both specs are given, a spec names a host or slot that does not exist, or nothing
            is left.
    """
    if include and exclude:
        raise ValueError("--include and --exclude cannot be used together; use one of them")
    slots = {host: list(range(count)) for host, count in hosts.items()}
    flag, spec = ("--include", include) if include else ("--exclude", exclude)
    if not spec:
        return slots
    selected = parse_host_spec(spec, flag)
    for host, wanted in selected.items():
        if host not in slots:
            raise ValueError(f"{flag}: host {host!r} is not in the hostfile (hosts: {', '.join(slots)})")
        missing = [s for s in wanted or [] if s not in slots[host]]
        if missing:
            raise ValueError(
                f"{flag}: {host!r} has no slot {missing[0]} (slots={hosts[host]}, so 0..{hosts[host] - 1})"
            )
    result: dict[str, list[int]] = {}
    for host, available in slots.items():
        if include:
            if host in selected:
                result[host] = selected[host] or available
        elif host not in selected:
            result[host] = available
        elif (removed := selected[host]) is not None and (kept := [s for s in available if s not in removed]):
            result[host] = kept
    if not result:
        raise ValueError(f"{flag} {spec!r} leaves no slot to run on")
    return result


def expand_nodelist(nodelist: str) -> list[str]:
    """Expands a Slurm node list: "gpu[01-03,07],login1" -> gpu01, gpu02, gpu03, gpu07, login1.

    Raises:
        ValueError: On unbalanced brackets or a bad range.
    """
    items: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(nodelist):
        depth += (ch == "[") - (ch == "]")
        if depth < 0 or depth > 1:
            raise ValueError(f"Slurm node list {nodelist!r}: unbalanced brackets")
        if ch == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"Slurm node list {nodelist!r}: unbalanced brackets")
    items.append(nodelist[start:])
    return [name for item in items if item.strip() for name in _expand_one(item.strip(), nodelist)]


def _expand_one(item: str, whole: str) -> list[str]:
    if "[" not in item:
        return [item]
    prefix, rest = item.split("[", 1)
    ranges, suffix = rest.split("]", 1)
    values: list[str] = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"Slurm node list {whole!r}: bad range {part!r}")
        width = len(low)
        values += [str(v).zfill(width) for v in range(int(low), int(high or low) + 1)]
    return [prefix + value + tail for value in values for tail in _expand_one(suffix, whole)]


@dataclass(frozen=True)
class SlurmTopology:
    """The nodes of a Slurm job, read from the variables Slurm exports to each task."""

    nnodes: int
    node_rank: int
    master_addr: str
    """The job's first node."""
    master_port: int
    """29500 plus the job id modulo 10000, so concurrent jobs on shared nodes rarely collide."""
    gpus_on_node: int | None
    """SLURM_GPUS_ON_NODE, when Slurm allocated GPUs."""


def slurm_topology(env: Mapping[str, str]) -> SlurmTopology | None:
    """Reads the Slurm job's topology from `env`; None outside a Slurm job (no SLURM_JOB_ID).

    Uses SLURM_JOB_NUM_NODES (or SLURM_NNODES), SLURM_NODEID and SLURM_JOB_NODELIST (or SLURM_NODELIST).

    Raises:
        ValueError: When one of them is missing or malformed (the message names the variable).
    """
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job:
        return None

    def need(*names: str) -> str:
        for name in names:
            if env.get(name):
                return env[name]
        raise ValueError(
            f"Slurm job {job}: {' / '.join(names)} is not set; run zeroshard launch inside srun/sbatch"
        )

    def integer(*names: str) -> int:
        value = need(*names)
        if not value.isdigit():
            raise ValueError(f"Slurm: {names[0]}={value!r} is not a whole number")
        return int(value)

    nnodes = integer("SLURM_JOB_NUM_NODES", "SLURM_NNODES")
    node_rank = integer("SLURM_NODEID")
    nodes = expand_nodelist(need("SLURM_JOB_NODELIST", "SLURM_NODELIST"))
    if node_rank >= nnodes:
        raise ValueError(f"Slurm: SLURM_NODEID({node_rank}) >= SLURM_JOB_NUM_NODES({nnodes})")
    gpus = env.get("SLURM_GPUS_ON_NODE")
    port = 29500 + int(job) % 10000 if job.isdigit() else 29500
    return SlurmTopology(nnodes, node_rank, nodes[0], port, int(gpus) if gpus and gpus.isdigit() else None)
