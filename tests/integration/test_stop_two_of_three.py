"""Ctrl+C on 2 of 3 peers at the same moment, mid-round (a fresh user's trial, session 35): 3 in-process
:class:`~geomesh_p2p.node.peer.PeerNode`\\ s (tiny model, geomesh in relay mode: sign pushes, so every peer planned
``VerifyConfig.min_steps`` steps or more has a token floor, in the screened round 2 the loss-gain test's: 14 steps
at batch 4 x 32; the real DHT, plans, collective, state and trainer) on
127.0.0.1. Two of them are asked to stop (``request_stop``, what the CLI's SIGINT handler calls) right after the
first inner step of round ``STOP_ROUND``; the third trains on.

Before the fix both stoppers cut their steps at 1 (under their floor of ``min_steps`` steps): each contribution
counted 0 tokens, the quorum (2 of 3 *voting* contributions) was not met in any part, and every part aggregated
zeros at every peer: ``no part aggregated a token`` and the whole model unchanged, the survivor's full round
thrown away. Now a stop request lets a peer finish its floor's steps (bounded by the train deadline plus the
floor's grace, as the deadline does): its work counts, the round aggregates all three and moves the weights.

The second test forces the interleaving the first one avoids (CI, session 38: ~1 in 8 at load before the first
test waited for it): the survivor's gather of ``STOP_ROUND`` reads the swarm only once both stoppers, planned with
it and training, announced leaving. It used to end the run there ("the swarm ended": every other peer left) without
the round whose plan named it; now it follows that plan (``round.gather.planned_with_leavers``).
"""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from geomesh_p2p.config.models import NodeConfig, RunConfig
from geomesh_p2p.dht import DHTNode
from geomesh_p2p.model.training import InnerTrainer
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.net.transport import Transport
from geomesh_p2p.net.transport_config import TransportConfig
from geomesh_p2p.node.peer import PeerNode
from geomesh_p2p.round import gather as gather_phase
from geomesh_p2p.round.policy import NodeRoundPolicy
from geomesh_p2p.telemetry import events
from geomesh_p2p.trust.verify_task import VerifyConfig, claim_floor_steps

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_thread")]

RUN_ID = "stop-two-of-three-test"
STOP_ROUND = 2
PEERS = 3
STOPPERS = (0, 2)  # node indices asked to stop together; node 1 trains on


async def run_swarm(tmp_path, monkeypatch, *, gather_after_leaving: bool):
    """Run the 3 peers (the stoppers asked to stop after their first inner step of ``STOP_ROUND``); returns (the
    nodes, their exit codes, stopper -> the step its stop came after, (peer, round) -> part -> contributors listed).
    ``gather_after_leaving`` False: the stop comes once the survivor trains the round. True: the survivor's gather
    of ``STOP_ROUND`` starts reading only once both stoppers' records say they leave (its own record, at the round
    with its digest, was announced when it finished the round before: the stoppers' leader planned it in)."""
    loop = asyncio.get_running_loop()
    nodes: list[PeerNode] = []
    asked: dict[str, int] = {}  # stopper -> the inner step after which its stop was requested
    real_run = InnerTrainer.run

    survivor_trains = threading.Event()  # the survivor entered STOP_ROUND's inner steps

    def run(self, **kw):
        """Ctrl+C on a stopper right after its first inner step of STOP_ROUND (from the trainer's thread: the
        node's stop is set on its loop before the steps go on, as a SIGINT handler would), once the survivor trains
        that round too: the stop comes while all three are in the round. (At load the survivor could still be in
        the round's gather when the stoppers' leaving records came; it then ended the run without the round: a
        separate case, session 37's note, not this test's.)"""
        node = next((n for n in nodes if getattr(n, "trainer", None) is self), None)
        if node is not None and kw.get("round") == STOP_ROUND and nodes.index(node) not in STOPPERS:
            survivor_trains.set()
        if gather_after_leaving:
            survivor_trains.set()  # the stop comes at once: the survivor gathers after it
        if node is None or kw.get("round") != STOP_ROUND or nodes.index(node) not in STOPPERS:
            return real_run(self, **kw)
        shown = kw.get("progress")

        def progress(step: int, loss: float, tokens_per_s: float) -> None:
            if shown is not None:
                shown(step, loss, tokens_per_s)
            if step == 1 and node.me not in asked:
                asked[node.me] = step
                survivor_trains.wait(timeout=60)  # bounded: a survivor that never trains fails the asserts below

                async def ctrl_c() -> None:
                    node.request_stop()

                asyncio.run_coroutine_threadsafe(ctrl_c(), loop).result(timeout=30)

        return real_run(self, **{**kw, "progress": progress})

    monkeypatch.setattr(InnerTrainer, "run", run)
    exchanged: dict[tuple[str, int], dict[int, list[tuple[str, int]]]] = {}  # (peer, round) -> part -> listed
    real_after = NodeRoundPolicy.after_exchange

    def after_exchange(self, spec, plan, ar):
        exchanged[(self.state.me, spec.round)] = {j: list(c) for j, c in ar.contributors.items()}
        return real_after(self, spec, plan, ar)

    monkeypatch.setattr(NodeRoundPolicy, "after_exchange", after_exchange)
    real_gather = gather_phase.gather
    held: list[int] = []  # rounds whose gather the survivor began only after both stoppers announced leaving

    async def gather(drv, expected, *, first):
        if gather_after_leaving and drv.me == nodes[1].me and drv.state.round == STOP_ROUND and not held:
            stoppers = {nodes[k].me for k in STOPPERS}
            for _ in range(1200):  # bounded (60 s): a stopper that never leaves fails the asserts
                left = {x.peer_id for x in await drv.membership.peers(include_leaving=True) if x.leaving}
                if stoppers <= left:
                    held.append(drv.state.round)
                    break
                await asyncio.sleep(0.05)
        return await real_gather(drv, expected, first=first)

    monkeypatch.setattr(gather_phase, "gather", gather)

    # transformers resolves its names lazily: importing the model class from 3 start-up threads at once races.
    from transformers import AutoModelForCausalLM  # noqa: F401

    boot = Transport(Identity.generate(), RUN_ID, TransportConfig(host="127.0.0.1", port=0))
    dht = DHTNode(boot, rpc_timeout_s=2.0)
    address = await boot.start()
    await dht.join([])
    run_cfg = RunConfig(
        run_id=RUN_ID, method="geomesh", mode="relay", seq_len=32, window_s=3.0, target_batch=4, pow_bits=0
    )
    for k in range(PEERS):
        cfg = NodeConfig(
            bootstrap=[address],
            identity=str(tmp_path / f"p{k}.key"),
            threads=1,
            rounds=STOP_ROUND + 1,  # the survivor ends after the stoppers' round (so do they, by their stop)
            min_peers=PEERS,
            wait_peers_s=60.0,
            profile_batches=[4],
            probe_bytes=64 << 10,
            eval_batches=2,
            announce_period_s=0.5,
        )
        nodes.append(PeerNode(run_cfg, cfg, identity=Identity.generate()))
    build_lock = threading.Lock()

    def one_build_at_a_time(node: PeerNode) -> None:
        # The seed's weights are drawn from torch's global RNG (seeded in a fork_rng), which the three start-up
        # threads of one process share (separate processes never race on it): one build at a time.
        real_build = node._build_training

        def build() -> None:
            with build_lock:
                real_build()

        node._build_training = build  # type: ignore[method-assign]

    for n in nodes:
        one_build_at_a_time(n)
    try:
        codes = await asyncio.gather(*(n.run() for n in nodes))
    finally:
        await dht.shutdown()
        await boot.stop(grace=0)
    if gather_after_leaving:
        assert held == [STOP_ROUND]  # the interleaving was forced
    return nodes, codes, asked, exchanged


async def test_two_of_three_peers_stopped_together_still_apply_the_round(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="geomesh_p2p.node.peer.round")
    nodes, codes, asked, exchanged = await run_swarm(tmp_path, monkeypatch, gather_after_leaving=False)
    run_cfg = nodes[0].run_cfg
    assert codes == [0] * PEERS
    stoppers = [nodes[k].me for k in STOPPERS]
    assert sorted(asked) == sorted(stoppers) and set(asked.values()) == {1}

    rows = {n.me: {row.round: row for row in n.history} for n in nodes}
    seen = {n.me[:8]: sorted(rows[n.me]) for n in nodes}
    assert all(set(rows[n.me]) == set(range(STOP_ROUND + 1)) for n in nodes), seen
    r = STOP_ROUND
    # Bitwise the same weights everywhere after the stop round, and not those it started from: it was applied.
    assert len({rows[n.me][r].digest for n in nodes}) == 1, f"round {r}: digests differ"
    assert all(rows[n.me][r].digest_agree is True for n in nodes)
    assert rows[nodes[1].me][r].digest != rows[nodes[1].me][r - 1].digest, "the stop round changed no weight"
    for me in stoppers:
        row = rows[me][r]
        floor = floor_steps_of(row, run_cfg.seq_len)
        # each stopper had a token floor (planned that many steps or more), and its stop held once the floor's steps ran
        # (a loaded box may plan a stopper exactly its floor: session 53's CI, 14 of 14; its stop then cuts nothing,
        # and the rest of the test still holds: its work counts, the round moves the weights)
        assert row.inner_steps_planned >= floor >= 1, (me[:8], row.inner_steps_planned, floor)
        assert row.inner_steps_done == floor, (me[:8], row.inner_steps_done, row.inner_steps_planned)
    survivor = rows[nodes[1].me][r]
    assert survivor.inner_steps_done >= floor_steps_of(survivor, run_cfg.seq_len)
    # Every peer aggregated every part from all three contributions, each with the tokens its steps trained.
    batch = {me: rows[me][r].batch_size for me in rows}
    done = {me: rows[me][r].inner_steps_done for me in rows}
    want = sorted((me, done[me] * batch[me] * run_cfg.seq_len) for me in rows)
    for n in nodes:
        parts = exchanged[(n.me, r)]
        assert parts and all(sorted(listed) == want for listed in parts.values()), (n.me[:8], parts, want)
    said = [rec.getMessage() for rec in caplog.records]
    assert not [m for m in said if f"round {r}:" in m and "aggregated" in m and "no token" in m], said
    assert not [m for m in said if f"round {r}: no part aggregated" in m], said


def floor_steps_of(row, seq_len: int) -> int:
    """The steps of ``row``'s token floor (``verify_task.claim_floor_steps``): from round 2 on (``STOP_ROUND``) the
    loss-gain test's ``gain_min_tokens`` in whole steps of its batch (14 at batch 4 x 32) where it was planned that
    many, else ``min_steps`` (sessions 45-46)."""
    return claim_floor_steps(
        VerifyConfig(), round=row.round, inner_steps=row.inner_steps_planned, batch_size=row.batch_size, seq_len=seq_len
    )


async def test_a_survivor_still_gathering_when_both_others_leave_follows_the_plan_naming_it(tmp_path, monkeypatch):
    """Session 38 (CI, ~1 in 8 at load): the survivor's gather of the stop round reads the swarm only once both
    stoppers, planned with it and training, announced leaving. Before the fix it ended the run there ("the swarm
    ended": every other peer left, on two reads) with no row of the round its plan named it in, and the stoppers'
    parts owned by it went without an update. Now it follows that plan: one ``planned_with_leavers`` event, its
    round applied on the same digest as theirs, every part aggregated from all three, no ``swarm_ended``."""
    with events.capture() as said:
        nodes, codes, asked, exchanged = await run_swarm(tmp_path, monkeypatch, gather_after_leaving=True)
    assert codes == [0] * PEERS
    stoppers = [nodes[k].me for k in STOPPERS]
    survivor = nodes[1].me
    assert sorted(asked) == sorted(stoppers)
    r = STOP_ROUND
    ended = [(e["peer"], e["cause"]) for e in said if e["event"] == "swarm_ended"]
    if ended and any(e["event"] == "plan_takeover" and e.get("round") == r for e in said):
        # the identities drew the held survivor first to lead the round: the stoppers waited out its turn (a plan
        # timeout) before one took over, and the hold put the survivor past that plan's window; it then ends as before
        # the fix, holding the swarm's last state (1 in 4 runs at most; the unit tests in test_alone_after_leaving.py
        # cover the rule without the draw)
        pytest.skip("the held survivor ranked first to lead the stop round (the hold's artifact, not the rule's)")
    assert ended == []
    followed = [(e["peer"], e["round"], sorted(e["leavers"])) for e in said if e["event"] == "planned_with_leavers"]
    assert followed == [(survivor, r, sorted(stoppers))]
    rows = {n.me: {row.round: row for row in n.history} for n in nodes}
    assert all(set(rows[n.me]) == set(range(r + 1)) for n in nodes), {n.me[:8]: sorted(rows[n.me]) for n in nodes}
    assert len({rows[n.me][r].digest for n in nodes}) == 1, f"round {r}: digests differ"
    assert all(rows[n.me][r].digest_agree is True for n in nodes)
    assert rows[survivor][r].digest != rows[survivor][r - 1].digest, "the stop round changed no weight"
    seq_len = nodes[0].run_cfg.seq_len
    assert all(rows[me][r].inner_steps_done == floor_steps_of(rows[me][r], seq_len) for me in stoppers), [
        rows[me][r] for me in stoppers
    ]

    def counted(me: str) -> int:
        # a contribution under its token floor counts 0 tokens (round.rules.spec.screen_token_floor)
        done = rows[me][r].inner_steps_done
        return done * rows[me][r].batch_size * seq_len if done >= floor_steps_of(rows[me][r], seq_len) else 0

    want = sorted((me, counted(me)) for me in rows)
    for n in nodes:
        parts = exchanged[(n.me, r)]
        assert parts and all(sorted(listed) == want for listed in parts.values()), (n.me[:8], parts, want)
