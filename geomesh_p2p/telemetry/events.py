"""Structured events: one call logs the human line as before and records a JSON event (issue 15).

Tests and tools assert on what happened (a refusal and its reason, a take-over, a failed checkpoint)
through these records instead of the wording of log lines, which stays free to change for the people
reading it. A call site makes one call::

    events.emit(log, logging.WARNING, "peer_refused", "refusing peer %s: %s", pid, why, peer=pid, reason=why)

which logs ``"refusing peer ...: ..."`` on ``log`` at that level exactly as ``log.warning`` did, and
hands ``{"event": "peer_refused", "t": <unix s>, "level": "WARNING", "message": <the line>, "peer": ...,
"reason": ...}`` to every sink of the process:

* :func:`open_json_sink` (a peer started with ``--log-json PATH``): appends one JSON line per event to
  :func:`events_path` ``(PATH)`` = ``PATH`` with ``.events`` before its suffix (``peer0.jsonl`` ->
  ``peer0.events.jsonl``). Not ``PATH`` itself: every reader of the round log (tests, the demo,
  the benchmarks) takes each of its lines for a round row. :func:`read` loads such a file.
* :func:`capture` (in-process tests): a list that receives the event dicts while the ``with`` lasts.

Sinks are process-wide (a deployed peer is one process); the events of several in-process nodes go
to the same sinks, so events that concern a peer name it (``peer=``). Emitting never blocks on a
file: the JSON sink's writes run in its own thread (issue 13: no file writes on the event loop).

Kinds emitted (besides ``event``, ``t``, ``level``, ``message``). ``peer`` is the full PeerID of the node
that emits unless the row says otherwise; rounds are ints, ``*_s`` seconds, ``*_bytes`` bytes, digests
full hex strings, parts ``[start, end)`` element ranges of the flat ``[P]`` parameter vector.

============================ ================================ ==========================================
kind                         where                            fields
============================ ================================ ==========================================
``adversary_acted``          adversary.AdversaryNode._note    peer, attack, round, action, key
``call_refused``             transport.Transport._admit       peer, method, caller_address, code, reason
                             (once per caller IP/code/reason)
``checkpoint_failed``        node.checkpoints (a write)       round, final, error (type), detail
``checkpoint_of_held_round`` node.checkpoints (final)         round (the counter), held_round (the weights')
``clock_jump``               dht.join._measure_clock (a       peer, change_s, offset_s (seconds; the new
                             confirmed jump; WARNING)         swarm time minus this machine's clock)
``contributing_nothing``     round.steps, round.train         peer, round, reason (``loss_not_finite`` |
                                                              ``update_not_finite`` | ``out_of_memory``),
                                                              detail (if any)
``device_reprobed``          node.device_probe (planned out)  batch, tokens_per_s (measured),
                                                              was_tokens_per_s, announced_tokens_per_s
``digest_mismatch``          round.finish.check_digest        peer, round, digest, majority_digest,
                                                              agree, total, behind
``dht_join_retry``           dht.join.DHTJoin.join,           peer, attempt, attempts, wait_s
                             dht.preflight.check_bootstraps
``early_steps_discarded``    round.planning.discard_early     peer, round, started_leader,
                                                              followed_leader (None: no plan)
``empty_swarm``              node._on_empty_swarm             peer, run_id, round, bootstrap, peers,
                                                              seen_ago_s, action (``wait`` | ``resume``
                                                              | ``seed``)
``empty_swarm_waiting``      node._on_empty_swarm             peer, run_id
``eval_not_finite``          training.InnerTrainer.evaluate   peer, loss (nats/token; NaN or huge)
``idle_parts_unchanged``     round.rules.outer                peer, round, idle (ranges), idle_elements,
                                                              elements
``inner_state_fresh``        node.joining.resume_inner_state  peer, round, reason (``missing``: an older
                             (INFO when missing, else         checkpoint; else the mismatch)
                             WARNING)
``inner_state_not_saved``    node.checkpoints (once)          round, reason (a multi-rank peer)
``inner_state_resumed``      node.joining.resume_inner_state  peer, round, global_step
``leaving_announced``        round.finish.announce, node      peer, round, reason (``stop`` | ``rounds``
                             shutdown, round.driver (stop)    | ``target_ppl`` | ``shutdown``)
``link_reprobed``            node.links (planned              upload_bps, download_bps, was_upload_bps,
                             out)                             was_download_bps (bytes/s)
``no_live_donor``            round.rules.state_sync (WARNING:  peer, round (the swarm's state asked),
                             every donor left and refused)    donors (PeerIDs that left and refused)
``older_state_adopted``      round.rules.state_sync (once         peer, round (the older state's), digest,
                             per pair of states; WARNING)     held_round, held_digest (the state it
                                                              leaves), live (PeerIDs live at the time),
                                                              discarded_rounds (the rounds it held past
                                                              the older state's)
``older_state_declined``     round.rules.state_sync (once         peer, round (the older state's), digest,
                             per pair of states)              held_round, held_digest, reason
``out_of_memory``            training.InnerTrainer (a micro-  peer, micro_batch, new_micro_batch (the
                             batch halved; steps stopped at   cap from now on), round (steps stopped)
                             micro-batch 1; WARNING)
``outer_step_skipped``       round.rules.outer                peer, round, skipped (ranges), not_finite
                                                              (ranges of them), parts, elements
``owner_unreachable``        collective.client (pull)         peer, round, part, owner, error
``part_closed``              collective.owner._close          round, part, reason, absent (PeerIDs)
``partition_lost``           round.resync.log_dropped         peer, round, digest, discarded_rounds,
                                                              side (PeerIDs), tokens, own_tokens
``peer_record_dropped``      dht.announce (once per record,   subkey (the record's PeerID), reason;
                             the first 3 of a read)           incompatible: differs (list)
``peer_records_dropped``     dht.announce.live_peers (a read  dropped (reason -> count)
                             that dropped more than 3; once
                             per set of reasons)
``plan_refused``             round.plans.PlanStore.read       peer, round, leader, reason
``plan_last_resort``         round.planning.last_resort (once peer, round, candidates (PeerIDs it defers
                             per round and state)             to), attempts (without a plan so far)
``plan_takeover``            round.plans.obtain_plan          peer, round, turn, delay_s, after_s,
                                                              last_resort (bool)
``plan_stalled``             round.planning.agree (WARNING:   peer, round, stalled_s
                             not running through the plan's
                             agreement; no take-over)
``planned_out``              round.planning.wait_out          peer, round, leader, reason
                                                              (``not_in_plan`` | ``weights_differ`` |
                                                              ``refused``: a plan others may follow)
``planned_with_leavers``     round.gather (a gather with      peer, round, leavers (PeerIDs that announced
                             nobody else in step; INFO, once  leaving during the round whose plan names
                             per round and state)             them and this peer)
``profile_batch``            profile.profile_training         batch, tokens_per_s, step_s, steps,
                                                              peak_bytes, extra_bytes, budget_bytes
``pull_refused``             collective.owner (pull handler)  peer, round, sender, code, reason
``push_refused``             collective.owner (push handler)  peer, round, part (None: not parsed),
                                                              sender, code, reason
``record_not_admitted``      admission (once per record)      peer (the record's), reason
``record_not_dialled``       round.rules.state_sync (a vote   peer, subject (the record's PeerID),
                             of addresses; once per record    reason
                             and reason; INFO)
``rejoin_resync``            round.gather.rejoin (a start-up  peer, round, digest (the state re-synced
                             gather; once per state)          to), held_round, held_digest
``residual_zeroed``          round.exchange.drop_feedback     peer, round
``resumed_behind_swarm``     node._warn_if_resumed_behind     peer, round (resumed at), swarm_round (the
                                                              newest known: the bootstrap's or the leaving
                                                              peers' records'), bootstrap, bootstrap_round
``resumed_from_checkpoint``  node._resume_from                peer, round, digest
``resumed_tie``              round.tie.resumed_tie (a resumed  peer, round, digest, others (PeerIDs live on
                             peer held, peers it trained with  other states), winner_round, winner_digest,
                             live on other states; once per    won
                             tie)
``round_alone_skipped``      round.planning.agree (a plan of  peer, round, leader, left (the PeerIDs
                             this peer alone, the others      gathered that announced leaving)
                             left since the gather)
``run_not_done``             node (a swarm that ended)        peer, round, rounds_trained, synced,
                                                              cause, exit_code
``serving_last_parts``       node.PeerNode._serve_last_parts  peer, round, readers (PeerIDs still pulling),
                                                              wait_s (the most it waits)
``serving_final_state``      node.report.serve_final_state    peer, round, readers (PeerIDs still catching up)
``stalled_round_not_blamed`` round.exchange.exchange          peer, round, stalled_s, window_s
``state_downloaded``         round.rules.state_sync               peer, round, donors (addresses), digest,
                                                              vote (``standing`` | ``fresh`` | ``solo``)
``state_piece_failed``       state_sync.download_state        round, piece, donor (address), outcome
                                                              (``failed`` | ``stalled``), error; INFO for a
                                                              donor that moved on past the round (asked
                                                              again), WARNING otherwise or on the last try
``state_refused``            round.rules.state_sync (vote, once)  peer, round, digest, identities, backing,
                                                              total
``sync_wait_capped``         round.gather.sync_deadline       peer, round, syncing_peer (on probation, no
                                                              grant left), wait_s, misses, retry_round
``swarm_ended``              round.resync.end_run             peer, round, swarm_round, synced, cause
                                                              (``others_left`` | ``alone`` |
                                                              ``digest_differs`` | ``tie_lost``); alone:
                                                              waited_s, min_peers; digest_differs: others,
                                                              majority_digest; tie_lost: winner_round,
                                                              winner_digest, others
``swarm_back``               node._on_empty_swarm             peer, run_id, peers (PeerIDs live again)
``waiting_for_late_peer``    round.gather.finishing_waits     peer, round, finishing_peer (still in the
                                                              last round), wait_s
``waiting_for_peers``        round.gather.gather (once per    peer, round, min_peers, live, wait_s
                             state)
``waiting_for_resumed``      round.gather.say_held (every    peer, round, waiting_for (PeerIDs of the
                             30 s)                            checkpoint's last round), live, waited_s
``waiting_for_syncing_peer`` round.gather.sync_deadline       peer, round, syncing_peer, wait_s (the
                                                              wait applied), done_bytes, total_bytes,
                                                              bytes_per_s, probation
============================ ================================ ==========================================
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional, Union

from geomesh_p2p.telemetry.metrics import json_safe

log = logging.getLogger(__name__)

Sink = Callable[[dict], None]
# Fixed names: logging.getLevelName follows addLevelName (a program may print WARNING as "WARN").
_LEVELS = {
    logging.DEBUG: "DEBUG",
    logging.INFO: "INFO",
    logging.WARNING: "WARNING",
    logging.ERROR: "ERROR",
    logging.CRITICAL: "CRITICAL",
}
_sinks: List[Sink] = []
_sinks_lock = threading.Lock()


def emit(
    logger: logging.Logger, level: int, kind: str, msg: str, *args: Any, stacklevel: int = 1, **fields: Any
) -> dict:
    """Log ``msg % args`` on ``logger`` at ``level`` (as ``logger.log`` does; a level the logger
    ignores prints nothing) and hand the event ``{"event": kind, "t": unix seconds (float, time.time()),
    "level": "DEBUG" | "INFO" | "WARNING" | "ERROR" | "CRITICAL" (else the number), "message": msg % args, **fields}`` to every sink, whatever the log level.

    ``fields`` are JSON values (str, int, float, bool, None, lists and dicts of them); anything else is
    written as its ``str()``, a non-finite float as null. Thread-safe, any thread. Returns the event.
    A sink that raises is logged once per event at DEBUG and skipped: an event never fails the caller.

    ``stacklevel`` (as in :meth:`logging.Logger.log`, not a field): which frame the log record names
    (funcName, pathname, lineno); 1 = the caller of ``emit``, 2 = its caller (for a helper such as
    :class:`geomesh_p2p.telemetry.logonce.LogOnce` that calls ``emit`` for the real call site).
    """
    message = msg % args if args else msg
    # +1: the record names the call site, not this function
    logger.log(level, msg, *args, stacklevel=stacklevel + 1)
    event = {"event": kind, "t": time.time(), "level": _LEVELS.get(level, str(level)), "message": message, **fields}
    with _sinks_lock:
        sinks = list(_sinks)
    for sink in sinks:
        try:
            sink(event)
        except Exception as e:  # a broken sink (closed file, full disk) must not break the node
            log.debug("event sink %r failed: %s", sink, e)
    return event


def add_sink(sink: Sink) -> None:
    """Register ``sink(event: dict)`` for every later :func:`emit` of the process (any thread)."""
    with _sinks_lock:
        _sinks.append(sink)


def remove_sink(sink: Sink) -> None:
    """Unregister ``sink``; no error when it is not registered."""
    with _sinks_lock:
        if sink in _sinks:
            _sinks.remove(sink)


@contextlib.contextmanager
def capture(kind: Optional[str] = None) -> Iterator[List[dict]]:
    """Collect the events emitted (by any thread) while the ``with`` lasts into the yielded list, in
    order; only those of ``kind`` when given. For in-process tests::

        with events.capture("dht_join_retry") as got:
            ...
        assert [e["attempt"] for e in got] == [1, 2]
    """
    got: List[dict] = []

    def sink(event: dict) -> None:
        if kind is None or event["event"] == kind:
            got.append(event)

    add_sink(sink)
    try:
        yield got
    finally:
        remove_sink(sink)


def events_path(log_json: Union[str, Path]) -> Path:
    """Where a peer run with ``--log-json log_json`` writes its events: ``.events`` inserted before the
    suffix (``run/peer0.jsonl`` -> ``run/peer0.events.jsonl``; ``log`` -> ``log.events``)."""
    p = Path(log_json)
    return p.with_name(f"{p.stem}.events{p.suffix}") if p.suffix else p.with_name(p.name + ".events")


class JsonLinesSink:
    """Appends each event as one JSON line (UTF-8, ``\\n``-terminated, flushed per line) to ``path``,
    from a writer thread it owns: the caller's thread (the event loop) never waits on the disk.
    Register it with :func:`add_sink`; :meth:`close` writes what is queued, then stops the thread.
    A line that cannot be written (full disk) is dropped with one DEBUG line."""

    def __init__(self, path: Union[str, Path]):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._queue: "queue.SimpleQueue[Optional[str]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write_lines, name=f"events:{self.path.name}", daemon=True)
        self._closed = False
        self._thread.start()

    def __call__(self, event: dict) -> None:
        if not self._closed:
            self._queue.put(json.dumps(json_safe(event), default=str))

    def _write_lines(self) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            while True:
                line = self._queue.get()
                if line is None:
                    return
                try:
                    f.write(line + "\n")
                    f.flush()
                except OSError as e:
                    log.debug("could not write an event to %s: %s", self.path, e)

    def close(self, timeout: float = 5.0) -> None:
        """Write the queued events, stop the writer thread (waits up to ``timeout`` seconds). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)


def open_json_sink(log_json: Optional[Union[str, Path]]) -> Optional[JsonLinesSink]:
    """For a peer started with ``--log-json log_json``: a :class:`JsonLinesSink` on
    :func:`events_path` ``(log_json)``, registered; None (nothing registered) when ``log_json`` is
    None. The owner stops it with :func:`close_sink` at shutdown."""
    if not log_json:
        return None
    sink = JsonLinesSink(events_path(log_json))
    add_sink(sink)
    return sink


def close_sink(sink: Optional[JsonLinesSink]) -> None:
    """Unregister ``sink`` and close it (its queued lines are written first). None is a no-op."""
    if sink is not None:
        remove_sink(sink)
        sink.close()


def read(path: Union[str, Path], kind: Optional[str] = None) -> List[dict]:
    """The events in the JSON-lines file ``path`` (``[]`` when it does not exist), only those of
    ``kind`` when given. A partly written last line is skipped (the file may be read while written)."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for line in p.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict) and (kind is None or event.get("event") == kind):
            out.append(event)
    return out
