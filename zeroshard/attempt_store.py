"""A fresh key-value store for each torchrun attempt, so that a restarted job joins its process group.

[Note: a store per attempt]
By default torchrun's agent shares its own TCPStore with the workers (``TORCHELASTIC_USE_AGENT_STORE=True``):
``env://`` makes every worker a client of the agent's store, and the process group keeps its keys there
(``default_pg/...``: gloo's and NCCL's addresses of each rank). The agent outlives its workers, and so do
those keys. After ``--max-restarts`` restarts a worker group, the new workers write the same keys again,
but a worker that reads one before its peer has rewritten it gets the dead worker's address: gloo's
``connectFullMesh`` fails with "Connection refused", or the group hangs. With plain torch on this
machine, 2 of 3 restarts of a two-process job whose rank 1 was SIGKILLed failed that way.

zeroshard keeps no key in the agent's store but one: rank 0 of each attempt opens a TCPStore of its own on a
free port (as torchrun does itself with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) and publishes its address
in the agent's store; the process group lives in that fresh store, which dies with the attempt. The other
ranks read the address and connect. The key survives the attempt, so they may read the dead attempt's
address first: nothing listens there any more (torchrun stops every worker before it restarts any), the
connection is refused, and they read the key again until rank 0 has published the new one, within
``timeout``. The agent's restart count is not part of the key on purpose: on several nodes the agents count
differently (only the agent whose worker failed counts a restart; the others restart for the new round).

Used by :func:`zeroshard.dist.init_distributed` for ``env://`` under torchrun's agent store; a script that
calls ``torch.distributed.init_process_group`` itself does not get it (``zeroshard launch`` sets
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for such scripts).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time

from torch._C._distributed_c10d import Store, TCPStore

logger = logging.getLogger(__name__)

AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
_KEY = "zeroshard/attempt-store/{run_id}/{world}"
# How long one connection attempt to a published address may take before the key is read again.
_CONNECT = datetime.timedelta(seconds=2)


def under_agent_store() -> bool:
    """True in a worker that torchrun started with its agent's store shared (torchrun's default)."""
    return os.environ.get(AGENT_STORE_ENV) == "True"


def attempt_store(rank: int, world_size: int, timeout: datetime.timedelta) -> Store:
    """This attempt's own store for the process group ([Note: a store per attempt]).

    Collective: call on every rank of the attempt (rank 0 opens the store the others connect to).

    Raises:
        RuntimeError: naming the rank and the address, when no store of this attempt answers within
            ``timeout``.
    """
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = TCPStore(addr, port, world_size, is_master=False, timeout=timeout)
    key = _KEY.format(run_id=os.environ.get("TORCHELASTIC_RUN_ID", "none"), world=world_size)
    if rank == 0:
        own = TCPStore("0.0.0.0", 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        agent.set(key, f"{_reachable_address(addr, port)}:{own.port}")
        return own
    deadline = time.monotonic() + timeout.total_seconds()
    tried = ""
    while True:
        published = agent.get(key).decode()  # waits (up to ``timeout``) until some rank 0 published one
        host, _, own_port = published.rpartition(":")
        try:
            store = TCPStore(host, int(own_port), world_size, is_master=False, timeout=_CONNECT)
        except (RuntimeError, TimeoutError) as err:  # DistNetworkError/DistStoreError: a dead attempt's
            tried = f"{published} ({err})"
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"rank {rank}: no process-group store of this torchrun attempt answered within "
                    f"{timeout.total_seconds():.0f} s; last address read from the agent's store "
                    f"({addr}:{port}, key {key!r}): {tried}"
                ) from err
            time.sleep(0.05)  # a poll of the agent's store, bounded by the deadline above
            continue
        store.set_timeout(timeout)
        return store


def _reachable_address(addr: str, port: int) -> str:
    """This host's address on the route to the agent's store: the other nodes reach it the same way."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((addr, port))  # UDP: no packet is sent, the kernel picks the interface
            return str(probe.getsockname()[0])
    except OSError:
        return socket.getfqdn()
