"""What a node says of its run when it ends (lifecycle step 5 of :mod:`geomesh_p2p.node.peer`): the closing
line ("done", or a WARNING and an exit code when the swarm ended without it) and the summary JSON.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Collection, Optional


from geomesh_p2p.net.swarm_time import swarm_time
from geomesh_p2p.round.driver import LEAVING_ANNOUNCE_WAIT_S  # the shutdown bound (peer.py)
from geomesh_p2p.telemetry import events
from geomesh_p2p.telemetry.looplag import gc_clock
from geomesh_p2p.telemetry.metrics import json_safe
from geomesh_p2p.util.aio import wait_event
from geomesh_p2p.util.backoff import Backoff

if TYPE_CHECKING:
    from geomesh_p2p.node.peer import PeerNode

log = logging.getLogger("geomesh_p2p.node.peer")

__all__ = [
    "LEAVING_ANNOUNCE_WAIT_S",
    "EXIT_NOT_SYNCED",
    "FINAL_STATE_LINGER_S",
    "catching_up",
    "log_swarm_ended",
    "log_done",
    "serve_final_state",
    "summary",
    "write_summary",
]

#: Exit code of a peer whose run ended on a state that is not the swarm's (the swarm ended while it was behind,
#: or its last rounds were trained on a state the others never had): docs/round.md, "A stalled peer and a swarm that ended".
EXIT_NOT_SYNCED = 3


def disowned(node: PeerNode) -> bool:
    """Whether this peer's run ended left alone on a state that is NOT the swarm's (``SwarmEnded`` cause ``"alone"``,
    not synced): its records then carry no digest (a leaving record holding no state of the run), so a bootstrap
    does not keep the round of that fork as the run's (``dht.progress.disowned_rise``; fresh user 48: a peer that
    ended so at round 215 left the bootstrap saying the run was at round 215, and the restarted peers adopted it)."""
    d = getattr(node, "_round_driver", None)
    ended = getattr(d, "ended", None)
    return ended is not None and not ended.synced and ended.cause == "alone"


def log_swarm_ended(node: PeerNode, ended) -> int:
    """The closing line of a run the swarm ended before its ``--rounds`` / target (``RoundDriver.ended``,
    a :class:`~geomesh_p2p.round.driver.SwarmEnded`), never "done": an INFO "stopped early" when this peer holds
    the swarm's last state, else a WARNING "not done". Returns the exit code:
    0 when this peer holds the swarm's last state (the run's result is here and sound; it only did not
    reach its own goal), :data:`EXIT_NOT_SYNCED` when it does not (its state is not the swarm's: a script
    must not take its checkpoint or perplexity for the run's)."""
    code = 0 if ended.synced else EXIT_NOT_SYNCED
    # A synced peer's result is sound (the swarm ended first): INFO, worded as an early stop, so exit 0 does not
    # read like a failure. A peer off the swarm's state keeps the WARNING "not done".
    level, fmt = (
        (
            logging.INFO,
            "stopped early, holding the swarm's last state: %s; %d round(s) trained here, at round %d; exit %d",
        )
        if ended.synced
        else (logging.WARNING, "not done: %s; %d round(s) trained here, now at round %d; exit %d")
    )
    events.emit(
        log,
        level,
        "run_not_done",
        fmt,
        ended.why,
        len(node.history),
        node.round,
        code,
        peer=node.me,
        round=node.round,
        rounds_trained=len(node.history),
        synced=ended.synced,
        cause=ended.cause,
        exit_code=code,
    )
    return code


# ------------------------------------------------------------------ the round driver's ports


def log_done(node: PeerNode) -> None:
    """One closing line: why the node stops, rounds trained here, the last perplexity."""
    h = node.history
    why = (
        "stop requested"
        if node._stop.is_set()
        else f"target eval perplexity {node.cfg.target_ppl:g} reached"
        if node._reached_target()
        else f"--rounds {node.cfg.rounds} reached"
    )
    ppl, at = last_eval(node)
    # a state adopted after the last evaluation here (a restarted peer that caught up, a sparse --eval-every) was not
    # measured: say which state the figure is (fresh-user 38: a restart printed its old checkpoint's as the swarm's)
    older = f" of round {at}'s state (round {node.round}'s was not evaluated here)" if at != node.round else ""
    log.info(
        "done (%s): %d round(s) trained here, now at round %d, eval perplexity %.2f%s (from %.2f)",
        why,
        len(h),
        node.round,
        ppl if ppl is not None else float("nan"),
        older,
        node.initial_ppl if node.initial_ppl is not None else float("nan"),
    )


def last_eval(node: PeerNode) -> tuple[Optional[float], Optional[int]]:
    """The newest eval perplexity this node measured and the round whose start state it measured (a row of round r
    measured the state after it, ``eval_round`` + 1 for a background evaluation; the initial one, the state it
    started at): (None, None) before any."""
    for r in reversed(node.history):
        if r.eval_ppl is not None:
            return r.eval_ppl, (r.eval_round if r.eval_round is not None else r.round) + 1
    return node.initial_ppl, node.initial_round


def summary(node: PeerNode) -> dict:
    h = node.history
    return {
        "peer_id": node.me,
        "rounds": len(h),
        "last_round": node.round,
        "initial_eval_ppl": node.initial_ppl,
        "final_eval_ppl": last_eval(node)[0],
        "time_to_target_s": node.time_to_target,
        "straggler_idle_pct": (sum(r.straggler_idle_s for r in h) / max(1e-9, sum(r.round_s for r in h)) * 100)
        if h
        else 0.0,
        "network_idle_pct": (sum(r.network_idle_s for r in h) / max(1e-9, sum(r.round_s for r in h)) * 100)
        if h
        else 0.0,
        "bytes_sent": sum(r.bytes_sent for r in h),
        "bytes_received": sum(r.bytes_received for r in h),
        # the weights digest after each round's outer step (= the digest round r+1 starts from)
        "digests_after_round": {r.round: r.digest for r in h},
        "digest_mismatches": sum(1 for r in h if r.digest_agree is False),
        # bytes/s: what this peer announced last (stated by a flag, else measured) and the probe's figures
        "links": {
            "upload_bps": node.cfg.upload_bps or (node.ema.upload_bps if node.ema else None),
            "download_bps": node.cfg.download_bps or (node.ema.download_bps if node.ema else None),
            "stated": {"upload": node.cfg.upload_bps is not None, "download": node.cfg.download_bps is not None},
            "probe": None
            if node.links.probe_result is None
            else {
                "address": node.links.probe_result.address,
                "rtt_s": node.links.probe_result.rtt_s,
                "upload_bps": node.links.probe_result.upload_bps,
                "download_bps": node.links.probe_result.download_bps,
            },
        },
        "rows": [json.loads(r.to_json()) for r in h],
        # Python's cyclic collector in this process since its loop-lag monitor started (issue 27: a full collection
        # over the unfrozen start-up heap held the GIL for 234-600 ms)
        "gc": {
            "seconds": round(gc_clock.now_s(), 4),
            "collections": list(gc_clock.collections),
            "frozen": gc.get_freeze_count(),
        },
    }


def write_summary(node: PeerNode, path: str) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")

    # strict JSON: an infinite perplexity (weights a hostile update blew up) is written as null
    tmp.write_text(json.dumps(json_safe(node.summary()), indent=1, allow_nan=False))
    os.replace(tmp, p)


async def serve_last_parts(node: PeerNode, max_linger_s: float) -> float:
    """Before the server stops: keep serving the last round's owned parts to participants still pulling
    them (a slow link, a uniform-H method's slow peer), until each has been handed them or the round's
    exchange deadline passed (at most ``max_linger_s`` seconds), with one INFO line when it waits and one
    more if some never pulled. Returns the grace (seconds) the server's stop gives calls still in flight:
    a result handed out is still on the wire (rs10: a 2.8 MB relay result on a 4.64 Mbit/s link was cut
    by the 0.5 s grace), so until that deadline, at least 0.5 s. A second Ctrl+C ends the wait."""
    collective = node.collective
    plan = getattr(node._round_driver, "last_plan", None)
    if collective is None or plan is None or not hasattr(collective, "linger"):
        return 0.5
    until = min(float(plan.exchange_deadline), swarm_time() + max_linger_s)
    left = collective.unserved()
    if left and until > swarm_time():
        readers = sorted({p for ps in left.values() for p in ps})
        events.emit(
            log,
            logging.INFO,
            "serving_last_parts",
            "round %d: %d peer(s) still pulling this peer's %d part(s) (%s); serving them for at most %.0f s",
            plan.round,
            len(readers),
            len(left),
            ", ".join(p[:10] for p in readers[:5]),
            until - swarm_time(),
            peer=node.me,
            round=plan.round,
            readers=readers,
            wait_s=until - swarm_time(),
        )
        left = await collective.linger(until)
        if left:
            log.info(
                "round %d: %d peer(s) did not pull this peer's parts by the exchange deadline; stopping",
                plan.round,
                len({p for ps in left.values() for p in ps}),
            )
    return max(0.5, until - swarm_time())


#: The longest a peer whose run ended waits for peers still downloading its last state (:func:`serve_final_state`)
FINAL_STATE_LINGER_S = 30.0


def catching_up(
    records, me: str, round: int, start: Optional[tuple[int, str]] = None, participants: Collection[str] = ()
) -> list[str]:
    """The peers of ``records`` (:class:`~geomesh_p2p.schema.peer.PeerRecord`) that wait for the state of
    ``round``: live, syncing (no digest) and announcing that round (a peer planned out of the last round
    announces the round after it while it waits for it), ``me`` left out. With ``start`` (the round before
    ``round`` and the digest its plan started from: ``RoundPlan.start_digest``), also the live peers announcing
    that state, less that plan's ``participants`` (one still there finishes the round itself, or was killed: no
    30 s linger for its record): a peer planned out of that round whose wait for its end passed before this peer finished it (a
    loaded machine, what planned it out) announces it between two catch-ups, and will download this one
    (session 48: when every participant read the record then, none served it, and it ended exit 3)."""
    return sorted(
        x.peer_id
        for x in records
        if x.peer_id != me
        and not x.leaving
        and (
            (x.weights_digest is None and x.round == round)
            or (
                start is not None
                and x.peer_id not in participants
                and x.weights_digest is not None
                and (x.round, x.weights_digest) == start
            )
        )
    )


def final_plan_start(node: PeerNode) -> tuple[Optional[tuple[int, str]], list[str]]:
    """(round, start digest) of the plan of the round before ``node.round`` that this peer followed (the last round
    it finished), and its participants; (None, []) without one: the state a peer planned out of that round holds."""
    plan = getattr(getattr(node, "_round_driver", None), "last_plan", None)
    if plan is None or plan.round != node.round - 1 or not plan.start_digest:
        return None, []
    return (plan.round, plan.start_digest), list(plan.participants())


async def serve_final_state(
    node: PeerNode, max_linger_s: float = FINAL_STATE_LINGER_S, poll_s: float = 1.0
) -> list[str]:
    """Before the server stops at the end of a run this peer finished (its ``--rounds`` or target reached, no stop
    asked): keep serving its state to the peers that are still catching up to it (:func:`catching_up`), until
    each announces a state (or leaves) or ``max_linger_s`` seconds passed, reading the records with a backoff from
    ``poll_s`` to 4 x ``poll_s`` seconds; one INFO line when it waits. A peer planned out of the last round waits for that round to end before it
    downloads: when every participant exited at once, it found no donor (session 27: three of nine peers planned
    out of round 2 then ran a round 2 of their own; now they end "not synced", and with this wait they get the
    state). Returns the peers still catching up when it stopped waiting. Never raises: a failed read ends it."""
    if node._stop.is_set():
        return []  # Ctrl+C: the user wants the process gone
    deadline = time.monotonic() + max_linger_s
    backoff = Backoff(poll_s, 4 * poll_s)
    said = False
    waiting: list[str] = []
    try:
        while True:
            start, participants = final_plan_start(node)
            waiting = catching_up(await node.peers(include_leaving=True), node.me, node.round, start, participants)
            if not waiting or time.monotonic() >= deadline:
                break
            if not said:
                said = True
                events.emit(
                    log,
                    logging.INFO,
                    "serving_final_state",
                    "round %d: %d peer(s) still catching up to this peer's last state (%s); serving it for at most "
                    "%.0f s",
                    node.round,
                    len(waiting),
                    ", ".join(p[:10] for p in waiting[:5]),
                    max_linger_s,
                    peer=node.me,
                    round=node.round,
                    readers=waiting,
                )
            if await wait_event(node._stop, min(backoff.next(), max(0.0, deadline - time.monotonic()))):
                return waiting
    except (asyncio.CancelledError, KeyboardInterrupt):
        raise
    except Exception as e:  # the DHT may be gone already: stop waiting
        log.debug("reading who still catches up failed: %r", e)
    if said and waiting:
        log.info(
            "round %d: %d peer(s) did not catch up to this peer's last state in time; stopping",
            node.round,
            len(waiting),
        )
    return waiting


def leaving_unsaid(node: PeerNode) -> bool:
    """Whether ``node``'s shutdown must announce that it leaves (its store bounded by ``LEAVING_ANNOUNCE_WAIT_S``):
    what its announcer stored decides, not the node's flag (``PeerAnnouncer.said_leaving``, fresh user 52), unless
    the end of its rounds already waited ``LEAVING_ANNOUNCE_WAIT_S`` for a stop's leaving store the DHT never took
    (``RoundDriver.leaving_wait_expired``; red team 52c: a Ctrl-C with the DHT gone waited that long, then for a second
    store without a bound here)."""
    a, drv = node.announcer, node._round_driver
    return a is not None and not a.said_leaving and not (drv is not None and drv.leaving_wait_expired)
