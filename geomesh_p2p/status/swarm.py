"""What the swarm looks like from outside: the view behind the status page and ``geomesh-peer status``.

Sources, all signed DHT records (the DHT checked every signature and the owner rule):

* ``<run>/peers`` (subkey = PeerID): each peer's :class:`~geomesh_p2p.schema.peer.PeerRecord`;
* ``<run>/plan/<r>`` (subkey = leader PeerID): the leaders' plans of round ``r``
  (:mod:`geomesh_p2p.round`);
* ``<run>/rounds`` (subkey = PeerID): :class:`RoundSummaries`, each peer's compact summary of its last
  :data:`KEEP_ROUNDS` rounds (loss, eval perplexity, idle, bytes, digest), published after every
  round by :func:`publish_round_summary` (one call per round: :meth:`RoundDriver.finish
  <geomesh_p2p.round.driver.RoundDriver.finish>` hands the round's row to ``NodeRoundPolicy.publish_record``).

:class:`SwarmWatcher` reads them every few seconds through a :class:`~geomesh_p2p.dht.DHTNode`, keeps
the history of the rounds it saw (so the plots go further back than one peer's window) and builds two
JSON documents: :meth:`SwarmWatcher.swarm` (peers, round, leader, plan, digests) and
:meth:`SwarmWatcher.rounds` (one point per round). Every string taken from a record is cleaned by
:func:`clean_text` (control characters replaced, truncated); the page also writes it as text, never
as HTML. Records are counted only when they match the majority's run-config hash and carry the proof
of work that run config asks for (:mod:`geomesh_p2p.trust.admission`); the rest are counted as ignored.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import statistics
import unicodedata
import weakref
from collections import Counter
from typing import Any, Dict, List, Optional, Sequence

from pydantic import BaseModel, Field, ValidationError

from geomesh_p2p.util.aio import cancel_and_wait
from geomesh_p2p.net.swarm_time import swarm_time
from geomesh_p2p.schema.peer import PeerRecord
from geomesh_p2p.schema.compat import WIRE_MODEL
from geomesh_p2p.config.models import MAX_POW_BITS
from geomesh_p2p.dht import live_peers
from geomesh_p2p.plan.awb import AUTO_WINDOW_MIN_S
from geomesh_p2p.plan.agree import choose_plan, digest_majority, leader_order, plan_key
from geomesh_p2p.plan.wire import PlanPending, PlanReader
from geomesh_p2p.trust.admission import Admission

log = logging.getLogger(__name__)

#: Rounds each peer's summary record holds (newest last); ~150 bytes each as JSON.
KEEP_ROUNDS = 24
#: Shortest lifetime of a summary record, seconds (re-stored every round; kept a while after a peer leaves).
SUMMARY_TTL_S = 900.0
#: ... and at least this many of the peer's longest recent rounds (:func:`summary_ttl_s`).
SUMMARY_TTL_ROUNDS = 3.0


def summary_ttl_s(rounds: Sequence["RoundSummary"]) -> float:
    """Lifetime (seconds) of a summary record holding ``rounds``: ``SUMMARY_TTL_S``, or ``SUMMARY_TTL_ROUNDS``
    times the longest of those rounds when longer, so a record re-stored once per round never expires between
    two rounds, whatever the window (issue 29 #2: lifetimes follow the run's timing)."""
    longest = max((float(r.round_s) for r in rounds), default=0.0)
    return max(SUMMARY_TTL_S, SUMMARY_TTL_ROUNDS * longest)


#: A leaving record is shown as ``left`` once it was not stored again for this many of the swarm's rounds plus
#: ``LEFT_SLACK_S`` seconds (:func:`_gone`), rounds being at least ``MIN_ROUND_S`` long (the auto window's floor).
LEFT_AFTER_ROUNDS = 2.0
LEFT_SLACK_S = 10.0
MIN_ROUND_S = AUTO_WINDOW_MIN_S
#: How long a watcher keeps listing, as ``silent``, a peer whose record expired without a ``leaving`` one
#: (killed, hung, cut off, or a laptop asleep): as long as the summaries of its last rounds live (fresh user 54: a
#: killed peer read ``training``, then ``behind``, then vanished from the page ~30 s after the kill, with its record).
SILENT_KEEP_S = SUMMARY_TTL_S
#: Most such peers a watcher keeps (the oldest go first); only records it admitted (proof of work, run config) count.
MAX_SILENT_KEPT = 1024
#: Most characters of a record string shown anywhere.
MAX_TEXT = 64
#: Most rounds a watcher keeps in memory.
MAX_HISTORY = 5000


def rounds_key(run_id: str) -> str:
    """The DHT key of the peers' round summaries (subkey = the publisher's PeerID)."""
    return f"{run_id}/rounds"


def clean_text(value: Any, limit: int = MAX_TEXT) -> str:
    """``value`` as one line of printable text: control, format and separator characters (newlines,
    ANSI escapes, bidi overrides, ...) become U+FFFD, and anything over ``limit`` characters is cut
    with an ellipsis. HTML is *not* escaped here: the page writes every string as text."""
    text = "" if value is None else str(value)
    if len(text) > 4 * limit:
        text = text[: 4 * limit]
    out = []
    for ch in text:
        cat = unicodedata.category(ch)
        out.append("\ufffd" if cat in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp") else ch)
    text = "".join(out)
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def _finite(v: Optional[float]) -> Optional[float]:
    return float(v) if v is not None and isinstance(v, (int, float)) and math.isfinite(v) else None


# ------------------------------------------------------------------------------- the summary record
class RoundSummary(BaseModel):
    """One round as one peer saw it (a compact :class:`~geomesh_p2p.telemetry.metrics.RoundRecord`). Units:
    seconds, tokens, bytes; ``time`` in unix seconds (end of the round)."""

    model_config = WIRE_MODEL  # a field of a newer patch is ignored, not refused (docs/compat.md)

    round: int = Field(ge=0, le=1 << 40)
    time: float = Field(ge=0, le=1e11)
    peers: int = Field(ge=0, le=1 << 20, description="participants of the round's plan")
    leader: str = Field(max_length=64)
    batch: int = Field(ge=0, le=1 << 20)
    steps: int = Field(ge=0, le=1 << 20, description="inner steps done")
    steps_planned: int = Field(ge=0, le=1 << 20)
    tokens: int = Field(ge=0, le=1 << 50)
    loss: Optional[float] = Field(default=None, ge=0, le=1e6)
    eval_ppl: Optional[float] = Field(default=None, ge=0, le=1e30)
    compute_s: float = Field(ge=0, le=1e6)
    round_s: float = Field(ge=0, le=1e6)
    straggler_s: float = Field(ge=0, le=1e6)
    network_s: float = Field(ge=0, le=1e6)
    sent: int = Field(ge=0, le=1 << 50)
    recv: int = Field(ge=0, le=1 << 50)
    digest: str = Field(default="", max_length=32, description="weights digest after the round (prefix)")
    agree: Optional[bool] = Field(default=None, description="digest equal to the participants' majority")

    @classmethod
    def from_round_record(cls, r) -> "RoundSummary":
        """From a :class:`~geomesh_p2p.telemetry.metrics.RoundRecord` (non-finite figures become None / 0)."""
        loss = _finite(r.train_loss)
        ppl = _finite(r.eval_ppl)
        return cls(
            round=r.round,
            time=r.time or swarm_time(),
            peers=r.peers,
            leader=str(r.leader)[:64],
            batch=r.batch_size,
            steps=r.inner_steps_done,
            steps_planned=r.inner_steps_planned,
            tokens=r.tokens,
            loss=None if loss is None or not 0 <= loss <= 1e6 else loss,
            eval_ppl=None if ppl is None or not 0 <= ppl <= 1e30 else ppl,
            compute_s=min(max(_finite(r.compute_s) or 0.0, 0.0), 1e6),
            round_s=min(max(_finite(r.round_s) or 0.0, 0.0), 1e6),
            straggler_s=min(max(_finite(r.straggler_idle_s) or 0.0, 0.0), 1e6),
            network_s=min(max(_finite(r.network_idle_s) or 0.0, 0.0), 1e6),
            sent=max(0, int(r.bytes_sent)),
            recv=max(0, int(r.bytes_received)),
            digest=(r.digest or "")[:16],
            agree=r.digest_agree,
        )


class RoundSummaries(BaseModel):
    """What a peer stores under ``<run>/rounds`` (subkey = its PeerID): its last rounds, oldest first."""

    model_config = WIRE_MODEL  # a field of a newer patch is ignored, not refused (docs/compat.md)

    peer_id: str = Field(max_length=64)
    rounds: List[RoundSummary] = Field(default_factory=list, max_length=KEEP_ROUNDS)

    def to_bytes(self) -> bytes:
        return self.model_dump_json(exclude_none=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "RoundSummaries":
        return cls.model_validate_json(data)


_recent: "weakref.WeakKeyDictionary[Any, List[RoundSummary]]" = weakref.WeakKeyDictionary()  # node -> last rounds


def publish_round_summary(node, record) -> None:
    """Store ``node``'s summary of its last :data:`KEEP_ROUNDS` rounds, ``record`` (a RoundRecord)
    included, under ``<run>/rounds`` in the background (the round does not wait for it; a failure is
    logged at DEBUG and the next round stores again). Never raises."""
    try:
        rows = _recent.setdefault(node, [])
        rows.append(RoundSummary.from_round_record(record))
        del rows[:-KEEP_ROUNDS]
        payload = RoundSummaries(peer_id=node.me, rounds=list(rows)).to_bytes()
        ttl_s = summary_ttl_s(rows)
        dht = node.dht

        async def store() -> None:
            try:
                await dht.store(
                    rounds_key(node.run_cfg.run_id),
                    payload,
                    swarm_time() + ttl_s,
                    subkey=node.me,
                    owner=node.identity,
                )
            except Exception as e:  # the status page misses one round at worst
                log.debug("round summary not stored: %r", e)

        dht.tasks.spawn(store(), name="round-summary")
    except Exception as e:
        log.debug("round summary not published: %r", e)


# ------------------------------------------------------------------------------------- the watcher
def _median(xs: Sequence[Optional[float]]) -> Optional[float]:
    """Median of the values of ``xs`` that are not None; None when there is none."""
    known = [x for x in xs if x is not None]
    return float(statistics.median(known)) if known else None


def _unstored_for(rec: PeerRecord, now: float, round_s: float) -> bool:
    """Whether ``rec`` was not stored again for ``LEFT_AFTER_ROUNDS`` rounds of ``round_s`` seconds (at least
    ``MIN_ROUND_S``) plus ``LEFT_SLACK_S``: a running peer, a waiting or leaving one included, stores its record at
    least every 1.3 rounds (geomesh_p2p.dht.announce.RECORD_REFRESHES) and at once when what it does changes."""
    return now - rec.timestamp > LEFT_AFTER_ROUNDS * max(round_s, MIN_ROUND_S) + LEFT_SLACK_S


def _gone(rec: PeerRecord, now: float, current: Optional[int], round_s: float) -> bool:
    """Whether the process behind a leaving record has gone: the swarm (its peers that are not leaving) is two
    rounds past the round the record names, or the record was not stored again for ``LEFT_AFTER_ROUNDS`` rounds
    of ``round_s`` seconds plus ``LEFT_SLACK_S`` (:func:`_unstored_for`; a leaving peer lingers after its last round
    only until that round's exchange deadline). The record itself lives on until it expires, about four rounds."""
    if current is not None and rec.round + 1 < current:
        return True
    return _unstored_for(rec, now, round_s)


#: States a record's ``activity`` names that outrank what its round and digest say (a peer refusing the plans or
#: planned out announces no digest while it waits for the round's end: it is not downloading yet).
_SITTING_OUT = ("sitting out", "refusing plans")


def _state(
    rec: PeerRecord, plan_members: Optional[set], current: Optional[int], now: float = 0.0, round_s: float = 0.0
) -> str:
    """left (a leaving record whose peer has gone: :func:`_gone`) / leaving / silent (a record not stored again for
    two rounds and 10 s: its peer was killed, hangs, or lost the network; the record lives on until it expires) /
    what its ``activity`` says it does (sitting out / refusing plans) / syncing (no digest: downloading the swarm's
    state) / behind (more than one round behind the swarm's round) / client-only / what its ``activity`` says
    (waiting / training / no plan / syncing, or a newer release's word, as announced) / for a record without one
    (an older release): waiting (not in the current round's plan) / training. ``now``: swarm time; ``round_s``: the
    swarm's recent round length, seconds (fresh user 52: a waiting, a catching-up and a killed peer read
    ``training``)."""
    if rec.leaving:
        return "left" if _gone(rec, now, current, round_s) else "leaving"
    if _unstored_for(rec, now, round_s):
        return "silent"
    activity = clean_text(rec.activity, 24) if rec.activity else None
    if activity in _SITTING_OUT:
        return activity
    if rec.weights_digest is None:
        return "syncing"
    if current is not None and rec.round < current - 1:
        return "behind"
    if rec.client_only:
        return "client-only"
    if activity:
        return activity
    if plan_members is not None and rec.peer_id not in plan_members:
        return "waiting"
    return "training"


def _top_leader(rows) -> str:
    """The leader most of ``rows`` (RoundSummary s of one round) name (the largest id among equals)."""
    leaders = Counter(x.leader for x in rows)
    return max(leaders.items(), key=lambda kv: (kv[1], kv[0]))[0]


class SwarmWatcher:
    """Reads a run's records through ``node`` (:meth:`refresh`, or :meth:`start` to poll every
    ``poll_s`` seconds) and serves the last view as JSON bytes (:meth:`swarm_json`, :meth:`rounds_json`).
    ``shards``: the run's ``record_shards`` (the keys its records live under, :mod:`geomesh_p2p.schema.shards`).
    """

    def __init__(
        self,
        node,
        run_id: Optional[str] = None,
        *,
        poll_s: float = 2.0,
        allow=None,
        self_id: Optional[str] = None,
        pow_floor: int = 0,
        shards: int = 1,
    ):
        self.node = node
        self.shards = shards  # the run's record_shards: the keys its records are read from
        self.run_id = run_id or node.run_id
        self.poll_s = poll_s
        self.allow = allow  # private run: callable(PeerID) -> bool, as admission.Admission takes
        self.self_id = self_id
        # least proof of work (bits) a record needs to count at all, whatever config it announces (a bootstrap's
        # --pow-bits): else free identities announcing a config with pow_bits 0 would be the majority and admit
        # themselves
        self.pow_floor = max(0, min(int(pow_floor), MAX_POW_BITS))
        self._history: Dict[int, Dict[str, RoundSummary]] = {}  # round -> peer id -> summary
        self._swarm: Dict[str, Any] = self._empty()
        self._swarm_bytes = json.dumps(self._swarm).encode()
        self._rounds_bytes = json.dumps({"run_id": self.run_id, "rounds": []}).encode()
        self._task: Optional[asyncio.Task] = None
        self._admissions: Dict[int, Any] = {}
        #: the last admitted record of every peer read, by peer id (:meth:`_unread`), oldest first
        self._seen: Dict[str, PeerRecord] = {}
        self._plans = PlanReader(node)  # assembles chunked plans; remembers the last ones read
        self.refreshes = 0
        self.last_error: Optional[str] = None

    def _empty(self) -> Dict[str, Any]:
        return {
            "run_id": self.run_id,
            "time": swarm_time(),
            "updated": None,
            "round": None,
            "leader": None,
            "plan": None,
            "digests": None,
            "peers": [],
            "ignored": 0,
            "error": None,
        }

    # -------------------------------------------------------------------- reading
    async def _get(self, key: str):
        return await self.node.get(key, latest=True)

    def _admitted(self, recs: List[PeerRecord]):
        """(admitted records, ignored count): majority run-config hash, its proof of work, allow-list."""
        if not recs:
            return [], 0
        total = len(recs)
        if self.pow_floor > 0:
            floor = self._admissions.get(-1)
            if floor is None:
                floor = self._admissions[-1] = Admission(self.run_id, self.pow_floor, self.allow)
            recs = floor.filter(recs)
            if not recs:
                return [], total
        hashes = Counter(r.run_config_hash for r in recs if not r.leaving) or Counter(r.run_config_hash for r in recs)
        major, _ = max(hashes.items(), key=lambda kv: (kv[1], kv[0]))
        configs = [r.run_config for r in recs if r.run_config_hash == major and isinstance(r.run_config, dict)]
        bits = Counter(int(c.get("pow_bits", 0)) for c in configs if isinstance(c.get("pow_bits", 0), int))
        pow_bits = max(bits.items(), key=lambda kv: (kv[1], kv[0]))[0] if bits else 0
        pow_bits = max(self.pow_floor, min(pow_bits, MAX_POW_BITS))
        admission = self._admissions.get(pow_bits)
        if admission is None:
            admission = self._admissions[pow_bits] = Admission(self.run_id, pow_bits, self.allow)
        ok = [r for r in admission.filter([r for r in recs if r.run_config_hash == major])]
        return ok, total - len(ok)

    async def refresh(self) -> Dict[str, Any]:
        """Read the records now and rebuild both views. Returns the swarm view."""
        now = swarm_time()
        recs = await live_peers(self.node, self.run_id, include_leaving=True, shards=self.shards)
        if self.self_id is not None:
            recs = [r for r in recs if r.peer_id != self.self_id]
        peers, ignored = self._admitted(recs)
        unread = self._unread(peers, now)
        known = {r.peer_id for r in peers}
        # the swarm's round: the staying peers' majority, unless every staying record is stale and leaving ones are
        # fresh (a dead peer's record, alive until it expires, named the round and its leader after the last live peer
        # announced leaving: fresh user 54b). Not the fresh records alone: in a swarm of 120 s rounds one resumed
        # peer that stored a second ago named its own round for everyone (red team 54c)
        staying = [r for r in peers if not r.leaving]
        round_s = self._round_s(None)
        fresh = [r for r in peers if not _unstored_for(r, now, round_s)]
        every_staying_stale = bool(staying) and bool(fresh) and all(r.leaving for r in fresh)
        active = fresh if every_staying_stale else staying or peers
        rounds = Counter(r.round for r in active)
        current = max(rounds.items(), key=lambda kv: (kv[1], kv[0]))[0] if rounds else None
        plan = await self._plan(current, known) if current is not None else None
        if plan is None and current:
            plan = await self._plan(current - 1, known)
        await self._read_summaries(known, current)
        members = set(plan.participants()) if plan is not None and plan.round == current else None
        self._swarm = self._build(now, peers, ignored, current, plan, members, unread)
        self._swarm_bytes = json.dumps(self._swarm, allow_nan=False).encode()
        self._rounds_bytes = json.dumps(self._rounds_view(), allow_nan=False).encode()
        self.refreshes += 1
        self.last_error = None
        return self._swarm

    def _unread(self, peers: List[PeerRecord], now: float) -> List[PeerRecord]:
        """The peers this watcher read before whose record this read did not return (expired: no process stored it
        again; or the read missed it) and was not a ``leaving`` one, newest record last: listed (as ``silent`` once
        their record is old enough, :func:`_state`) for ``SILENT_KEEP_S`` seconds after their last store, or until a
        record of theirs is read again. Remembers ``peers`` (admitted records only, so what a flood of free
        identities stores never gets here) for the next reads; at most ``MAX_SILENT_KEPT`` peers that are gone are
        kept. ``now``: swarm time."""
        for r in peers:
            self._seen.pop(r.peer_id, None)  # re-inserted: the dict's order is the order of the last reads
            self._seen[r.peer_id] = r
        live = {r.peer_id for r in peers}
        gone = [r for pid, r in self._seen.items() if pid not in live]
        for r in gone:
            if r.leaving or now - r.timestamp > SILENT_KEEP_S:
                del self._seen[r.peer_id]
        gone = [r for r in gone if r.peer_id in self._seen]
        for r in gone[: max(0, len(gone) - MAX_SILENT_KEPT)]:
            del self._seen[r.peer_id]
        return gone[-MAX_SILENT_KEPT:]

    async def _plan(self, r: int, known: set):
        try:
            found = await self._get(plan_key(self.run_id, r))
        except Exception as e:
            log.debug("plan of round %d not read: %r", r, e)
            return None
        plans = []
        key = plan_key(self.run_id, r)
        for subkey, item in (found or {}).items():
            if item.owner is None or subkey is None or subkey != str(item.owner) or subkey not in known:
                continue  # checked before any chunk is fetched
            try:
                p = await self._plans.load(key, subkey, item.value)
            except (PlanPending, ValidationError, ValueError):
                continue
            if p.leader != subkey or p.round != r or p.run_id != self.run_id:
                continue
            plans.append(p)
        return choose_plan(self.run_id, r, plans)

    async def _read_summaries(self, known: set, current: Optional[int]) -> None:
        try:
            found = await self._get(rounds_key(self.run_id))
        except Exception as e:
            log.debug("round summaries not read: %r", e)
            return
        for subkey, item in (found or {}).items():
            if subkey is None or item.owner is None or subkey != str(item.owner) or subkey not in known:
                continue
            try:
                s = RoundSummaries.from_bytes(item.value)
            except (ValidationError, ValueError):
                continue
            if s.peer_id != subkey:
                continue
            for row in s.rounds:
                # a record cannot move the plots far ahead of the swarm's round
                if current is not None and row.round > current + 2:
                    continue
                self._history.setdefault(row.round, {})[subkey] = row
        if len(self._history) > MAX_HISTORY:
            for r in sorted(self._history)[: len(self._history) - MAX_HISTORY]:
                del self._history[r]

    # -------------------------------------------------------------------- building the views
    def _round_s(self, plan) -> float:
        """The swarm's recent round length, seconds: the longest of the plan's window, the median over the last 3
        rounds read of each one's median round time, and the last round's (0.0 when none is known). The median, not
        the longest of the 3: the round after a peer died waits for its part (fresh user 54: 24 s against 6-7 s),
        and 2 x that round plus 10 s outlived the dead peer's record (4 of its own rounds) for 3 rounds, so it never
        read ``silent``; the last round too: a swarm that slows down (6.5 s rounds, then 40 s) stores its records
        once a round, and the median alone called them silent in the second slow round (red team 54b)."""
        recent = [_median([x.round_s for x in self._history[r].values()]) or 0.0 for r in sorted(self._history)[-3:]]
        last = recent[-1] if recent else 0.0
        return max(plan.window_s if plan is not None else 0.0, _median(recent) or 0.0, last)

    def _last_followed(self, peer_id: str) -> Dict[str, Any]:
        """``last_round`` (the newest round ``peer_id`` summarised, or None), ``last_leader`` (the short id of the
        leader whose plan it ran then) and ``other_plan`` (True when that leader is not the one most reporters of the
        round ran: it followed another plan, or trained alone; fresh user 51: three peers listed as ``training``
        with equal digests while one of them refused the others' plans for 10 rounds)."""
        for r in sorted(self._history, reverse=True):
            row = self._history[r].get(peer_id)
            if row is not None:
                top = _top_leader(self._history[r].values())
                return {
                    "last_round": r,
                    "last_leader": clean_text(row.leader, 10),
                    "other_plan": len(self._history[r]) > 1 and row.leader != top,
                }
        return {"last_round": None, "last_leader": None, "other_plan": False}

    def _build(
        self, now, peers: List[PeerRecord], ignored: int, current, plan, members, unread: Sequence[PeerRecord] = ()
    ) -> Dict[str, Any]:
        """The swarm view of ``peers`` (the live admitted records) at swarm time ``now``; ``unread``: remembered peers
        this read did not return (:meth:`_unread`), listed by their last record's state (``silent`` once it was not
        stored again for two rounds and 10 s: a read that missed a live peer's fresh record, or came back empty, shows
        what it showed before; red team 54b) and counted in nothing else (round, digests)."""
        assign = {a.peer_id: a for a in plan.assignments} if plan is not None else {}
        round_s = self._round_s(plan)
        rows = []
        for r in [*peers, *unread]:
            a = assign.get(r.peer_id)
            last = self._last_followed(r.peer_id)
            rows.append(
                {
                    "peer_id": r.peer_id,
                    "short": r.peer_id[:10],
                    "device": clean_text(r.device),
                    "memory_gib": round(r.memory_bytes / 2**30, 2),
                    "tokens_per_s": round(r.best_tokens_per_s(), 1),
                    "up_mbps": round(r.upload_bps * 8e-6, 2),
                    "down_mbps": round(r.download_bps * 8e-6, 2),
                    "round": r.round,
                    "state": _state(r, members, current, now, round_s),
                    "last_seen_s": round(max(0.0, now - r.timestamp), 1),
                    "address": clean_text(r.address) if r.address else None,
                    "version": clean_text(r.version, 24),
                    "digest": clean_text(r.weights_digest[:8]) if r.weights_digest else None,
                    "batch": a.batch_size if a is not None else None,
                    "inner_steps": a.inner_steps if a is not None else None,
                    # the marks it announces on itself (late or no-show bench: no leader through that round)
                    "marked_until": (
                        r.unled_until
                        if type(r.unled_until) is int and current is not None and r.unled_until >= current
                        else None
                    ),
                    **last,
                }
            )
        rows.sort(key=lambda x: (x["state"] in ("leaving", "left", "silent"), x["peer_id"]))
        digests = None
        if current is not None:
            majority, agree, total = digest_majority(peers, current)
            digests = {
                "round": current,
                "majority": majority[:8] if majority else None,
                "agree": agree,
                "total": total,
                "equal": None if total == 0 else agree == total,
            }
        leader = (
            plan.leader
            if plan is not None
            else (
                leader_order(self.run_id, current, [r.peer_id for r in peers if not r.leaving])[0]
                if current is not None and any(not r.leaving for r in peers)
                else None
            )
        )
        plan_view = None
        if plan is not None:
            plan_view = {
                "round": plan.round,
                "leader": plan.leader[:10],
                "window_s": round(plan.window_s, 2),
                "method": plan.method,
                "mode": plan.mode,
                "assignments": [
                    {
                        "short": a.peer_id[:10],
                        "batch": a.batch_size,
                        "micro_batch": a.micro_batch,
                        "inner_steps": a.inner_steps,
                        "owns_part": a.owns_part,
                    }
                    for a in plan.assignments
                ],
            }
        return {
            "run_id": clean_text(self.run_id),
            "time": now,
            "updated": now,
            "round": current,
            "leader": leader[:10] if leader else None,
            "plan": plan_view,
            "digests": digests,
            "peers": rows,
            "ignored": ignored,
            "error": None,
        }

    def _rounds_view(self) -> Dict[str, Any]:
        out = []
        for r in sorted(self._history):
            rows = list(self._history[r].values())
            round_s = _median([x.round_s for x in rows]) or 0.0
            tokens = sum(x.tokens for x in rows)
            digests = {x.digest for x in rows if x.digest}
            agree = None
            if any(x.agree is False for x in rows) or len(digests) > 1:
                agree = False
            elif len(rows) > 1 and len(digests) == 1:
                agree = True
            elif any(x.agree for x in rows):
                agree = True
            leaders = Counter(x.leader for x in rows)
            # more than one: the reporters ran different plans of this round (a split, whatever the digests say)
            out.append(
                {
                    "round": r,
                    "time": _median([x.time for x in rows]),
                    "reporters": len(rows),
                    "peers": int(_median([x.peers for x in rows]) or 0),
                    "leader": clean_text(_top_leader(rows), 10),
                    "leaders": len(leaders),
                    "loss": _median([x.loss for x in rows]),
                    "eval_ppl": _median([x.eval_ppl for x in rows]),
                    "tokens": tokens,
                    "tokens_per_s": round(tokens / round_s, 1) if round_s > 0 else None,
                    "round_s": round(round_s, 3),
                    "straggler_idle_pct": round(
                        100 * max(x.straggler_s / x.round_s if x.round_s > 0 else 0 for x in rows), 2
                    ),
                    "network_idle_pct": round(
                        100 * max(x.network_s / x.round_s if x.round_s > 0 else 0 for x in rows), 2
                    ),
                    "bytes_sent_per_peer": int(statistics.mean(x.sent for x in rows)),
                    "digest_agree": agree,
                    "plan": sorted(([x.batch, x.steps_planned] for x in rows), reverse=True)[:16],
                }
            )
        return {"run_id": clean_text(self.run_id), "rounds": out}

    # -------------------------------------------------------------------- serving
    def swarm_json(self) -> bytes:
        return self._swarm_bytes

    def rounds_json(self) -> bytes:
        return self._rounds_bytes

    @property
    def view(self) -> Dict[str, Any]:
        return self._swarm

    def rounds(self) -> Dict[str, Any]:
        return json.loads(self._rounds_bytes)

    async def _loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # keep serving the last view
                self.last_error = f"{type(e).__name__}: {e}"
                view = dict(self._swarm, error=clean_text(self.last_error, 200))
                self._swarm_bytes = json.dumps(view, allow_nan=False).encode()
                log.warning("status: could not read the swarm's records: %s", self.last_error)
            await asyncio.sleep(self.poll_s)

    def start(self) -> asyncio.Task:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="status-watcher")
        return self._task

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None
