"""Time to fail: a dead, frozen, hung or elsewhere-engaged peer makes the others raise a named error in time.

Each sub-case runs two fresh gloo ranks at world size 2 that build an engine, train two steps and then
disagree: one rank is killed (SIGKILL) during training, a save or a stage-3 ``full_state_dict``, is stopped
(SIGSTOP: a process that closes no connection, as a vanished host), sleeps (a hang), or calls a collective
API the other does not (``if rank == 0: engine.save_checkpoint(...)``). The surviving rank must raise
``zeroshard.CollectiveError`` naming itself, the API, the step and the rank that did not arrive, with the
last-collectives table, within the bound [Note: liveness] in zeroshard/watchdog/monitor.py promises for that
case (heartbeat window 3 s and collective timeout 30 s here, 4 s for the hang).

A killed rank cannot run the next sub-case, so the ranks are not spawned per test function as elsewhere:
one spawned process per test function forks the two ranks of every sub-case (a fork costs milliseconds,
a spawn seconds of imports).
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import signal
import tempfile
import time
import traceback
from typing import Any

import pytest

WINDOW = 3.0  # ZEROSHARD_HEARTBEAT_TIMEOUT_S in these tests
TIMEOUT = 30.0  # ZEROSHARD_COLLECTIVE_TIMEOUT_S, except for the hang
HANG_TIMEOUT = 4.0


def _engine(rank: int, stage: int) -> Any:
    import zeroshard
    from tests.models import batch, make_model

    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zeroshard.initialize(model=make_model(), config=cfg)
    for step in range(2):
        _train_step(engine, rank, step)
    del batch
    return engine


def _train_step(engine: Any, rank: int, step: int) -> None:
    from tests.models import batch

    loss = engine(*batch(step, 0, rank))
    engine.backward(loss)
    engine.step()


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _act(rank: int, case: str, engine: Any, root: str) -> None:
    """What rank ``rank`` does in ``case`` after two steps (rank 1 is the odd one out)."""
    import zeroshard
    import zeroshard.checkpoint.save as save_module

    what = case.split(":")[0]
    victim = rank == (0 if what == "stop0-train" else 1)
    if what == "kill-train":
        if victim:
            _die()
        for step in range(2, 10):
            _train_step(engine, rank, step)
    elif what == "kill-save":
        if victim:
            original = save_module.write_tensors

            def write_then_die(*args: Any, **kwargs: Any) -> Any:
                original(*args, **kwargs)
                _die()

            save_module.write_tensors = write_then_die  # type: ignore[assignment]
        engine.save_checkpoint(root)
    elif what == "kill-full_state_dict":
        if victim:
            engine.gatherer.hold_all = _die
        engine.full_state_dict()
    elif what in ("stop-train", "stop0-train"):
        if victim:
            os.kill(os.getpid(), signal.SIGSTOP)
        for step in range(2, 10):
            _train_step(engine, rank, step)
    elif what == "hang-save":
        if victim:
            time.sleep(60)
        engine.save_checkpoint(root)
    elif what.startswith("alone-"):  # rank 0 alone calls the API, rank 1 trains on
        if victim:
            for step in range(2, 40):
                _train_step(engine, rank, step)
        elif what == "alone-save":
            engine.save_checkpoint(root)
        elif what == "alone-full_state_dict":
            engine.full_state_dict()
        elif what == "alone-GatheredParameters":
            with zeroshard.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=0):
                pass
    elif what == "save-vs-full_state_dict":
        engine.full_state_dict() if victim else engine.save_checkpoint(root)
    elif what == "save-vs-shutdown":
        zeroshard.shutdown_distributed() if victim else engine.save_checkpoint(root)
    else:
        raise ValueError(case)


def _rank_main(rank: int, case: str, tmp: str) -> None:
    """One forked rank of one sub-case: writes ``{tmp}/{rank}.json`` with its error and time to fail."""
    import torch.distributed as dist

    import zeroshard

    os.environ["ZEROSHARD_HEARTBEAT_TIMEOUT_S"] = str(WINDOW)
    os.environ["ZEROSHARD_COLLECTIVE_TIMEOUT_S"] = str(HANG_TIMEOUT if case.startswith("hang") else TIMEOUT)
    out: dict[str, Any] = {"rank": rank, "error": None, "type": None}
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{tmp}/rendezvous",
            rank=rank,
            world_size=2,
            timeout=datetime.timedelta(seconds=60),
        )
        engine = _engine(rank, int(case.split(":")[1]))
        start = time.monotonic()
        try:
            _act(rank, case, engine, os.path.join(tmp, "ckpt"))
        except zeroshard.CollectiveError as err:
            out.update(error=str(err), type="CollectiveError")
        out["seconds"] = time.monotonic() - start
    except BaseException:
        out.update(error=traceback.format_exc(), type="unexpected")
    with open(os.path.join(tmp, f"{rank}.json.tmp"), "w") as f:
        json.dump(out, f)
    os.rename(os.path.join(tmp, f"{rank}.json.tmp"), os.path.join(tmp, f"{rank}.json"))
    os._exit(0)


def _server(cases: list[str], results: Any) -> None:
    """Spawned once per test: fork the two ranks of each sub-case in turn, collect what they wrote."""
    import torch

    import zeroshard  # noqa: F401 (imported once, before the forks)

    torch.set_num_threads(1)
    collected: dict[str, Any] = {}
    for case in cases:
        with tempfile.TemporaryDirectory() as tmp:
            pids = []
            for rank in range(2):
                pid = os.fork()
                if pid == 0:
                    try:
                        _rank_main(rank, case, tmp)
                    finally:
                        os._exit(1)
                pids.append(pid)
            # Rank 0 reports; so does rank 1 where it is alive and must fail too (the API cases).
            wanted = ["0.json", "1.json"] if case.startswith(("alone", "save-vs")) else ["0.json"]
            wanted = ["1.json"] if case.startswith("stop0") else wanted
            deadline = time.monotonic() + 45
            while time.monotonic() < deadline and not all(
                os.path.exists(os.path.join(tmp, w)) for w in wanted
            ):
                time.sleep(0.05)
            for pid in pids:  # stopped, hung or still waiting: done with
                for sig in (signal.SIGKILL, signal.SIGCONT):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
                os.waitpid(pid, 0)
            collected[case] = {}
            for rank in range(2):
                path = os.path.join(tmp, f"{rank}.json")
                if os.path.exists(path):
                    with open(path) as f:
                        collected[case][rank] = json.load(f)
    results.put(collected)


def run_cases(cases: list[str]) -> dict[str, dict[int, dict[str, Any]]]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    server = ctx.Process(target=_server, args=(cases, results), daemon=True)
    server.start()
    try:
        collected = results.get(timeout=50 * len(cases))
    finally:
        server.join(timeout=10)
        if server.is_alive():
            server.kill()
    return {case: {int(r): v for r, v in ranks.items()} for case, ranks in collected.items()}


def _check(case: str, report: dict[str, Any] | None, api: str, bound: float, *also: str) -> None:
    """The survivor's error names itself, the API, the step, the other rank as not arrived; in time."""
    assert report is not None, f"{case}: the surviving rank reported nothing (it hung or crashed)"
    me = report["rank"]
    assert report["type"] == "CollectiveError", (
        f"{case}: rank {me} raised no CollectiveError:\n{report['error']}"
    )
    msg = report["error"]
    for part in (f"rank {me}: {api}", "(step 2)", *also):
        assert part in msg, f"{case}: {part!r} is not in rank {me}'s error:\n{msg}"
    assert report["seconds"] < bound, (
        f"{case}: rank {me} failed after {report['seconds']:.1f}s > {bound}s:\n{msg}"
    )


@pytest.mark.timeout(240)
def test_dead_and_frozen_peers_fail_the_survivor_within_seconds() -> None:
    cases = [
        "kill-train:2",
        "kill-train:3",
        "kill-save:2",
        "kill-save:3",
        "kill-full_state_dict:3",
        "stop-train:2",
        "stop0-train:2",
    ]
    got = run_cases(cases)
    died = (
        "ranks that did not arrive: [1]",
        "rank(s) [1] showed no heartbeat",
        "last collectives of each rank",
    )
    # A killed peer closes its connections: a few heartbeats (3 x 0.3 s + 0.5 s) name it.
    _check("kill-train:2", got["kill-train:2"].get(0), "engine.backward", 6, *died)
    _check("kill-train:3", got["kill-train:3"].get(0), "engine.", 6, *died)
    _check("kill-save:2", got["kill-save:2"].get(0), "save_checkpoint", 6, *died)
    _check("kill-save:3", got["kill-save:3"].get(0), "save_checkpoint", 6, *died)
    _check("kill-full_state_dict:3", got["kill-full_state_dict:3"].get(0), "full_state_dict", 6, *died)
    # A stopped peer closes nothing: the heartbeat window (3 s) after the grace (0.6 s) names it.
    _check(
        "stop-train:2",
        got["stop-train:2"].get(0),
        "engine.backward",
        WINDOW + 5,
        "rank(s) [1] are dead: no heartbeat for 3s",
        "ranks that did not arrive: [1]",
    )
    # Rank 0 stopped: the store it hosts stops answering; 5 s of silence name it.
    _check(
        "stop0-train:2",
        got["stop0-train:2"].get(1),
        "engine.backward",
        5 + 5,
        "rank 0, which hosts the heartbeat store, has not answered",
        "ranks that did not arrive: [0]",
    )


@pytest.mark.timeout(240)
def test_hung_peer_and_one_rank_only_calls_are_named() -> None:
    cases = [
        "hang-save:2",
        "alone-save:3",
        "alone-full_state_dict:3",
        "alone-GatheredParameters:3",
        "alone-save:2",
        "save-vs-full_state_dict:3",
        "save-vs-shutdown:2",
    ]
    got = run_cases(cases)
    # A live peer that never arrives: the collective timeout (4 s here), no sooner.
    hang = got["hang-save:2"].get(0)
    _check(
        "hang-save:2",
        hang,
        "save_checkpoint",
        HANG_TIMEOUT + 5,
        f"did not complete within {datetime.timedelta(seconds=HANG_TIMEOUT)}",
        "ranks that did not arrive: [1]",
        "rank 1: outside any collective API",
        "last collectives of each rank",
    )
    assert hang is not None and hang["seconds"] >= HANG_TIMEOUT * 0.95
    # One rank calls an API, the other trains on: both named, long before the 30 s timeout.
    for case, api in [
        ("alone-save:3", "save_checkpoint"),
        ("alone-full_state_dict:3", "full_state_dict"),
        ("alone-GatheredParameters:3", "GatheredParameters"),
        ("alone-save:2", "save_checkpoint"),
    ]:
        _check(
            case,
            got[case].get(0),
            api,
            8,
            "engine.forward" if case.endswith(":3") else "engine.backward",
            "ranks that did not arrive: [1]",
            "called different collective APIs",
            "last collectives of each rank",
        )
        peer = got[case].get(1)
        assert peer is not None and peer["type"] == "CollectiveError", f"{case}: rank 1: {peer}"
        assert "rank 1: engine." in peer["error"], peer["error"]
    # Both ranks in some API, different ones: the entry check names both at once, on both ranks.
    for case, mine, theirs in [
        ("save-vs-full_state_dict:3", "save_checkpoint (step 2)", "full_state_dict (step 2)"),
        ("save-vs-shutdown:2", "save_checkpoint (step 2)", "shutdown"),
    ]:
        for rank in range(2):
            report = got[case].get(rank)
            assert report is not None and report["type"] == "CollectiveError", f"{case}: {report}"
            msg = report["error"]
            assert f"ranks [0] entered {mine}" in msg and f"ranks [1] entered {theirs}" in msg, msg
            assert report["seconds"] < 5, f"{case}: {report['seconds']:.1f}s"


def test_records_judgement_and_table_without_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    from zeroshard.watchdog.heartbeat import HEARTBEAT_ENV, heartbeat_window
    from zeroshard.watchdog.monitor import LivenessMonitor
    from zeroshard.watchdog.verdicts import judge, last_collectives

    for raw, expected in [("30", 30.0), ("0", 0.0), ("2.5", 2.5)]:
        monkeypatch.setenv(HEARTBEAT_ENV, raw)
        assert heartbeat_window() == expected
    for raw in ("-1", "nan", "inf", "soon"):
        monkeypatch.setenv(HEARTBEAT_ENV, raw)
        with pytest.raises(ValueError, match=HEARTBEAT_ENV):
            heartbeat_window()

    # Rank 0 waits in save_checkpoint on group 0; what rank 1 published decides.
    me = LivenessMonitor()
    with me.api("engine.step", 1):
        for _ in range(3):
            me.note("0", "all_reduce", "step checks")
    with me.api("save_checkpoint", 2):
        me.note("0", "agree", "save_checkpoint entry check")
        token = me.block("0", 4, "save_checkpoint entry check", (0, 1), None)
    assert me.ring[-1] == ("0", 4, "agree: save_checkpoint entry check", "save_checkpoint", 2)

    def peer(seq: dict[str, int], ring: list[Any], blocked: dict[str, Any] | None) -> dict[int, Any]:
        return {
            1: {"seq": seq, "ring": ring, "apis": [], "last_api": None, "blocked": blocked, "failed": None}
        }

    waiting = {"key": "1", "seq": 7, "what": "parameter all_gather", "api": "engine.forward", "step": 2}
    # Rank 1 trains on (blocked on a gather rank 0 never launched): a desync, named.
    why = judge(me, token, peer({"0": 3, "1": 7}, [], {**waiting, "for_s": 1.0}), grace=0.5)
    assert why is not None and "rank 1 is in engine.forward (step 2)" in why
    # ... but not before it has waited the grace, nor when it waits on something rank 0 did launch.
    assert judge(me, token, peer({"0": 3, "1": 7}, [], {**waiting, "for_s": 0.1}), grace=0.5) is None
    me.seq["1"] = 7
    assert judge(me, token, peer({"0": 3, "1": 7}, [], {**waiting, "for_s": 1.0}), grace=0.5) is None
    # Rank 1 launched collective #4 on group 0 from another API: a desync at the same sequence number.
    ring = [["0", 4, "reduce_scatter: gradients", "engine.backward", 2]]
    blocked = {"key": "0", "seq": 4, "what": "gradients", "api": "engine.backward", "step": 2, "for_s": 1.0}
    why = judge(me, token, peer({"0": 4}, ring, blocked), grace=0.5)
    assert why is not None and "in engine.backward" in why and "this rank in save_checkpoint" in why
    # A peer that failed is named at once.
    failed = peer({"0": 3}, [], None)
    failed[1]["failed"] = "rank 1: boom"
    assert judge(me, token, failed, grace=0.5) == "rank 1 failed: rank 1: boom"

    # Both ranks launched exchange #2 on group 2 in the same API, moving different units: their tagged
    # messages never pair, so it is named; not for a collective that is not an exchange, whose
    # description may differ while it still completes.
    with me.api("engine.forward", 3):
        me.note("2", "all_gather", "parameter all_gather of unit 0 (a.weight, ...)")
        me.note("2", "all_gather", "parameter all_gather of unit 1 (extra.weight, ...)")
        exchange = me.block("2", 2, "parameter all_gather of unit 1", (0, 1), None, exchange=True)
        other = me.block("2", 2, "parameter all_gather of unit 1", (0, 1), None, exchange=False)
    theirs = [["2", 2, "parameter all_gather of unit 2 (b.weight, ...)", "engine.forward", 3]]
    blocked = {"key": "2", "seq": 2, "what": "b", "api": "engine.forward", "step": 3, "for_s": 1.0}
    why = judge(me, exchange, peer({"2": 2}, theirs, blocked), grace=0.5)
    assert why is not None and "as 'parameter all_gather of unit 2 (b.weight, ...)'" in why, why
    assert "this rank as 'parameter all_gather of unit 1 (extra.weight, ...)'" in why
    assert "same modules" in why
    assert judge(me, other, peer({"2": 2}, theirs, blocked), grace=0.5) is None
    same = [["2", 2, "parameter all_gather of unit 1 (extra.weight, ...)", "engine.forward", 3]]
    assert judge(me, exchange, peer({"2": 2}, same, blocked), grace=0.5) is None

    table = last_collectives({0: {"ring": list(me.ring)}, 1: {"ring": ring}})
    lines = table.splitlines()
    assert lines[1].split("|")[0].strip() == "rank 0" and lines[1].split("|")[1].strip() == "rank 1"
    assert "#4 g0 save_checkpoint: agree: save_checkpo" in lines[-3]
    assert "#4 g0 engine.backward: reduce_scatter: grad" in lines[-1]
