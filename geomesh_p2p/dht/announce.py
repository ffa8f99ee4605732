"""Peer announcements: each peer keeps its signed :class:`~geomesh_p2p.schema.peer.PeerRecord` under
``<run>/peers`` (subkey = its base58 PeerID, so only it can write it) and reads everyone else's.

* :class:`PeerAnnouncer` / :func:`announce_loop` store the record at once when it changes and refresh an
  unchanged one every ``max(period_s, ttl_s / 3)`` seconds after the last store, with a lifetime of ``ttl_s``
  (default 3 periods; a training peer's is :func:`record_ttl_s`: four rounds): a peer that dies drops out of
  :func:`live_peers` within ``ttl_s`` seconds.
* :func:`live_peers` reads the records, drops malformed ones and those of incompatible peers, and
  logs why (once per peer and reason).
* :func:`check_compatible` says exactly what differs between two records: run-config hash, software
  version (major.minor must match), protocol version, record schema version.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any, Awaitable, Callable, Collection, List, Optional, Union

from pydantic import ValidationError

from geomesh_p2p.util.aio import cancel_and_wait, wait_event
from geomesh_p2p.dht.node import DHTNode
from geomesh_p2p.dht.records import DEFAULT_LIMITS
from geomesh_p2p.schema.shards import check_shards, record_shard, records_key, shards_of
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.telemetry.logonce import LogOnce
from geomesh_p2p.schema.peer import PeerRecord

log = logging.getLogger(__name__)

RecordSource = Union[PeerRecord, Callable[[], PeerRecord], Callable[[], Awaitable[PeerRecord]]]
# Process-wide: every live_peers poll re-reads the same bad records; each (record, why) logs once.
_dropped_log = LogOnce(log, capacity=4096)


#: A training peer's record lives at least this many announce periods (the rule before issue 25: 4 x 2 s).
RECORD_TTL_MIN_PERIODS = 4
#: ... and at least this many rounds (the longer of the sync window and the last round's real cycle) plus
#: ``RECORD_TTL_SLACK_PERIODS`` announce periods (:func:`record_ttl_s`; 2 windows until session 16).
RECORD_TTL_ROUNDS = 4
RECORD_TTL_SLACK_PERIODS = 2
#: ... but at most the DHT's maximum lifetime (``RecordLimits.max_ttl_s``, 24 h) less 10 minutes: a peer with a
#: clock a little behind refused records at exactly the limit (the bootstrap's progress record, session 15).
RECORD_TTL_CAP_S = DEFAULT_LIMITS.max_ttl_s - 600.0
#: An unchanged record is refreshed this many times per lifetime (about once every 1.3 rounds): the round's own
#: announcements (one a round, at its end) restart the wait, so a swarm whose rounds run on time stores each
#: record once a round, whatever its size and its load.
RECORD_REFRESHES = 3


#: How much later than the stored record a peer's own record expires when it must outlive it (seconds): more
#: than the rounding of a stored expiration between swarm and local time (the storage shifts it by this
#: node's clock offset, which moves by milliseconds between stores).
EXPIRATION_STEP_S = 0.5
#: A record lives at least this many times the node's slowest recent store (:meth:`PeerAnnouncer.lifetime_s`).
STORE_LATENCY_LIFETIMES = 4.0


def record_ttl_s(period_s: float, round_s: Optional[float]) -> float:
    """The lifetime (seconds) of a training peer's record, announced every ``period_s`` seconds at least, in a
    run whose rounds last ``round_s`` seconds (the longer of the sync window and the last round's real cycle;
    None: no fixed window, then 4 periods): ``max(4 * period_s, 4 * round_s + 2 * period_s)``, at most
    ``RECORD_TTL_CAP_S`` (the DHT's 24 h less 10 minutes). 28 s at the defaults before the first round (window
    6 s, period 2 s), 36 s once rounds cycle in 8 s.

    Lifetime in rounds, not seconds (issue 25, session 16): the others read a record only while it lives, and a
    record that expires mid-round makes the peer vanish from their view: the leader plans without it while a
    follower that read it still names it, or a follower refuses a plan naming it as "not live", and the swarm
    splits (sessions 10-14: 57 "record expired" at 16 processes, forks at 24 and 32, where rounds took 36-135 s
    for a 2.5 s window). Four rounds cover a peer whose loop lags by a round or two and the refreshes that fail
    or come late in between (:data:`RECORD_REFRESHES` per lifetime, each a round's worth apart); two periods the
    latency of the store itself. A record stored once a round, at the round's end, then never lapses while its
    peer runs, however long rounds get under load, and the number of stores per round does not grow with the
    round's length (announcing every 2 s stored a 40 s round's record 20 times, each a lookup and k stores).

    What a longer lifetime costs falls on crashed peers only (a peer that leaves announces ``leaving`` and
    readers drop it at once): its last record names the round it died in, so from the next round on it is not
    in sync and not planned (the gather waits for such a record at most until the last round's exchange
    deadline plus ``ROUND_END_SLACK_S``); it stays listed as live (a state donor candidate that does not answer,
    a row of the status page) for at most this lifetime, about four rounds.
    """
    floor = RECORD_TTL_MIN_PERIODS * period_s
    if not round_s:
        return floor
    ttl = RECORD_TTL_ROUNDS * round_s + RECORD_TTL_SLACK_PERIODS * period_s
    return max(floor, min(ttl, RECORD_TTL_CAP_S))


def peers_key(run_id: str) -> str:
    """The DHT key of a run's peer records (a run with ``record_shards`` > 1 spreads them over
    :func:`~geomesh_p2p.schema.shards.records_key`)."""
    return f"{run_id}/peers"


#: Shard reads in flight at once in one :func:`live_peers` (each is a lookup and a quorum read).
SHARD_READS_IN_FLIGHT = 16


async def _read_shards(
    node: DHTNode, run_id: str, shards: int, only: Optional[Collection[str]], latest: bool, extra: dict[str, Any]
) -> dict:
    """subkey -> item over the shard keys a read needs (every shard, or those of ``only``), at most
    :data:`SHARD_READS_IN_FLIGHT` at a time. A record under a shard that is not its subkey's is dropped (logged
    once): only its owner can write that subkey, but it may write it under any shard, and a reader that took it
    would count a peer twice or from a key nobody reads."""
    wanted = shards_of(only, shards) if only is not None else {s: None for s in range(shards)}
    gate = asyncio.Semaphore(SHARD_READS_IN_FLIGHT)

    async def one(shard: int, ids: Optional[list[str]]) -> dict:
        async with gate:
            return await node.get(records_key(run_id, shard, shards), latest=latest, subkeys=ids, **extra)

    found: dict = {}
    answers = await asyncio.gather(*(one(s, ids) for s, ids in wanted.items()))
    for shard, got in zip(wanted, answers):
        for subkey, item in got.items():
            if subkey is not None and record_shard(subkey, shards) != shard:
                _log_once(
                    f"peer record {subkey[:10]}…",
                    f"dropped: stored under shard {shard} of {shards}, not its own",
                    subkey=subkey,
                    reason="wrong_shard",
                )
                continue
            found[subkey] = item
    return found


def _short(text: Optional[str], n: int = 12) -> str:
    if text is None:
        return "none"
    return text if len(text) <= n else text[:n] + "…"


def _major_minor(version: str) -> tuple:
    parts = version.split(".")
    return tuple(parts[:2]) if len(parts) >= 2 else (version,)


def check_compatible(mine: PeerRecord, other: PeerRecord) -> Optional[str]:
    """None when ``other`` can train with ``mine``; else what differs, e.g.
    ``"run-config hash 3f9a0c1d2e4b… vs 77aa01bc9d3e…; version 0.1.0 vs 0.2.0"``.

    Rules: same run-config hash, same software major.minor (patch may differ), same protocol version,
    same record schema version.
    """
    diffs = []
    if mine.run_config_hash != other.run_config_hash:
        a, b = mine.run_config_hash, other.run_config_hash
        n = 12
        while n < max(len(a), len(b)) and a[:n] == b[:n]:
            n += 8
        diffs.append(f"run-config hash {_short(a, n)} vs {_short(b, n)}")
    if _major_minor(mine.version) != _major_minor(other.version):
        diffs.append(f"version {mine.version} vs {other.version}")
    if mine.protocol_version != other.protocol_version:
        diffs.append(f"protocol version {mine.protocol_version} vs {other.protocol_version}")
    if mine.schema_version != other.schema_version:
        diffs.append(f"record schema version {mine.schema_version} vs {other.schema_version}")
    return "; ".join(diffs) or None


#: Dropped records of one :func:`live_peers` read logged one by one; the rest of the read's drops are one line.
DROP_LINES_PER_READ = 3


def _log_once(who: str, msg: str, level: int = logging.WARNING, **fields) -> None:
    """Log and emit ``peer_record_dropped`` for record ``who`` once per (who, msg); fields: subkey, reason."""
    _dropped_log((who, msg), level, "%s: %s", who, msg, event="peer_record_dropped", **fields)


async def live_peers(
    node: DHTNode,
    run_id: Optional[str] = None,
    *,
    expected_version: Optional[str] = None,
    expected_config_hash: Optional[str] = None,
    mine: Optional[PeerRecord] = None,
    latest: bool = True,
    include_leaving: bool = False,
    only: Optional[Collection[str]] = None,
    quorum: Optional[int] = None,
    shards: int = 1,
) -> List[PeerRecord]:
    """The unexpired, valid, compatible PeerRecords of ``run_id`` (default: the node's run), sorted by
    peer id.

    Dropped (and logged once): records that do not parse, whose ``peer_id`` is not the subkey they
    sit under, whose version's major.minor differs from ``expected_version``, whose run-config hash
    differs from ``expected_config_hash``, or that :func:`check_compatible` rejects against ``mine``.
    Records of peers that announced they are leaving are left out too, unless ``include_leaving``.
    Signatures and the owner rule were already checked by the DHT. ``only``: read the records of these
    PeerIDs only (a subkey read, :meth:`DHTNode.get`'s ``subkeys``: a few records, not the run's N).
    ``quorum``: the read's quorum of holders (None: the node's ``read_quorum``; :meth:`DHTNode.get`).
    ``shards``: the run's ``record_shards`` (:mod:`~geomesh_p2p.schema.shards`): above 1 the read asks every shard key,
    or with ``only`` the shards of those PeerIDs only, and drops records found under another shard than their own;
    a full read there (no ``only``, no ``quorum``) asks each key's cached holders (:meth:`DHTNode.get`'s ``cached``:
    ``full_read_reuse`` reads, a record that went missing looked up before it is taken as gone).
    """
    run_id = run_id or node.run_id
    # quorum only when given: a duck-typed DHT (tests' fakes, plan/wire.py's protocol) need not know it
    extra: dict[str, Any] = {} if quorum is None else {"quorum": quorum}
    if shards > 1 and only is None and quorum is None and latest:
        # a full read of S keys (three a round for each full-view peer): from the holders each key's last lookup
        # found, a record the last read found and the holders miss looked up again (DHTNode.get's ``cached``)
        extra["cached"] = True
    if shards == 1:
        found = await node.get(peers_key(run_id), latest=latest, subkeys=only, **extra)
    else:
        found = await _read_shards(node, run_id, shards, only, latest, extra)
    out: List[PeerRecord] = []
    dropped: Counter = Counter()  # reason -> records of this read dropped for it
    incompatible: dict[str, list[str]] = {}  # what differs -> the records (short names) that differ so

    def drop(who: str, msg: str, **fields) -> None:
        # the first few of a read each have their line; a flood of junk (the red team's 2,046 records, one WARNING
        # each) is one summary line below
        dropped[fields.get("reason", "other")] += 1
        if sum(dropped.values()) <= DROP_LINES_PER_READ:
            _log_once(who, msg, **fields)

    for subkey, item in found.items():
        who = f"peer record {subkey[:10] if subkey else '(no subkey)'}…"
        if subkey is None or item.owner is None or subkey != item.owner.to_string():
            drop(who, "dropped: not under its owner's PeerID subkey", subkey=subkey, reason="not_owner_subkey")
            continue
        try:
            rec = PeerRecord.from_bytes(item.value)
        except ValidationError as e:
            first = e.errors()[0] if e.errors() else {"loc": (), "msg": str(e)}
            drop(
                who,
                f"dropped: malformed PeerRecord ({'.'.join(map(str, first['loc']))}: {first['msg']})",
                subkey=subkey,
                reason="malformed",
            )
            continue
        if rec.peer_id != subkey:
            drop(
                who,
                f"dropped: record names peer {rec.peer_id[:10]}…, signed by {subkey[:10]}…",
                subkey=subkey,
                reason="names_another_peer",
            )
            continue
        reasons = []
        if expected_config_hash is not None and rec.run_config_hash != expected_config_hash:
            reasons.append(f"run-config hash {_short(expected_config_hash)} vs {_short(rec.run_config_hash)}")
        if expected_version is not None and _major_minor(expected_version) != _major_minor(rec.version):
            reasons.append(f"version {expected_version} vs {rec.version}")
        if mine is not None and rec.peer_id != mine.peer_id:
            diff = check_compatible(mine, rec)
            if diff and diff not in reasons:
                reasons.append(diff)
        if reasons:
            # a hash alone says nothing to act on (fresh user 39): say what it stands for and where the fields are
            hint = (
                " (other training flags or data; a joining peer's start-up names the fields that differ from the swarm's)"
                if any(r.startswith("run-config hash") for r in reasons)
                else ""
            )
            # each record's line at DEBUG (its event too), and one WARNING line for the records of one difference
            # after the read (fresh user 49: three peers of another --model were three WARNING lines of hashes
            # before the one-line refusal that names the field)
            text = "; ".join(reasons) + hint
            _log_once(
                who,
                "incompatible, ignored: " + text,
                logging.DEBUG,
                subkey=subkey,
                reason="incompatible",
                differs=reasons,
            )
            incompatible.setdefault(text, []).append(who.removeprefix("peer record "))
            continue
        if rec.leaving and not include_leaving:
            continue
        out.append(rec)
    for text, names in incompatible.items():
        names.sort()  # one order for one set of records (the line is logged once per set)
        shown = ", ".join(names[:DROP_LINES_PER_READ]) + (
            f" and {len(names) - DROP_LINES_PER_READ} more" if len(names) > DROP_LINES_PER_READ else ""
        )
        _dropped_log(
            ("incompatible", text, tuple(sorted(names))),
            logging.WARNING,
            "%d peer record(s) incompatible, ignored (%s): %s",
            len(names),
            shown,
            text,
        )
    if sum(dropped.values()) > DROP_LINES_PER_READ:
        what = ", ".join(f"{k} {v}" for k, v in sorted(dropped.items()))
        _dropped_log(
            ("many", tuple(sorted(dropped))),
            logging.WARNING,
            "a read of the peer records dropped %d of %d records (%s); only the first %d were logged one by one",
            sum(dropped.values()),
            len(found),
            what,
            DROP_LINES_PER_READ,
            event="peer_records_dropped",
            dropped=dict(dropped),
        )
    out.sort(key=lambda r: r.peer_id)
    return out


class IncompatibleSwarmError(RuntimeError):
    """The swarm's live peers all run another config or version (raised at join by
    ``PeerNode._check_swarm``, which uses :func:`check_compatible`); ``str()`` says what differs."""


class PeerAnnouncer:
    """Keeps this peer's record in the DHT: stores it now, at once on :meth:`update` (and whenever the round calls
    :meth:`announce_once`: at each round's end), and otherwise :attr:`refresh_s` seconds (``period_s``, or a
    third of ``ttl_s`` when longer) after the last store, whoever made it; each time with ``timestamp`` = now and
    expiration = now + :meth:`lifetime_s` (``ttl_s``, default 3 x period; never before the one already stored).
    A training peer's ``ttl_s`` is four rounds (:func:`record_ttl_s`, :meth:`follow_rounds`), so a swarm whose
    rounds end on time stores each record once a round (issue 25, session 16).

    ``record`` is a PeerRecord, or a (sync or async) function returning the current one (called at
    each announcement, so round, throughput and digest stay fresh). Its ``peer_id`` must be the
    identity's PeerID (ValueError otherwise). Runs as a task of the node (cancelled by
    ``node.shutdown()``) or until :meth:`stop`.
    """

    def __init__(
        self,
        node: DHTNode,
        record: RecordSource,
        *,
        identity: Optional[Identity] = None,
        run_id: Optional[str] = None,
        period_s: float = 5.0,
        ttl_s: Optional[float] = None,
        live: Optional[Callable[[], Optional[str]]] = None,
        clock: Callable[[], float] = time.monotonic,
        shards: int = 1,
    ):
        if period_s <= 0:
            raise ValueError("period_s must be > 0")
        self.node = node
        self.identity = identity or node.identity
        self.run_id = run_id or node.run_id
        #: the key this peer's record lives under: ``<run>/peers``, or its shard's (the run's ``record_shards``)
        self.key = (
            peers_key(self.run_id)
            if check_shards(shards) == 1
            else records_key(self.run_id, record_shard(self.identity.peer_id.to_string(), shards), shards)
        )
        #: shard 0's peers of a sharded run also store their record under ``<run>/peers`` (a mirror nobody of the run
        #: reads): a node started with ``record_shards`` 1 by mistake -- a joiner, a bootstrap -- then finds those
        #: records of another run config and is refused naming ``record_shards`` (``check_swarm``), where it saw
        #: an empty swarm and started alone (red team, session 19). ~N/S records on that key's holders: one shard's.
        self.mirror_key = (
            peers_key(self.run_id)
            if shards > 1 and record_shard(self.identity.peer_id.to_string(), shards) == 0
            else None
        )
        self.period_s = period_s
        self.ttl_s = ttl_s if ttl_s is not None else 3 * period_s
        self._source = record
        self.announced = 0
        self.last: Optional[PeerRecord] = None
        #: whether the store of :attr:`last` was accepted by at least one node (``announce_once``'s answer)
        self.last_ok = False
        self._task: Optional[asyncio.Task] = None
        self._wake = asyncio.Event()
        self._clock = clock
        #: When the last announcement started (``clock``, seconds), by the loop or anyone else: the next refresh of
        #: an unchanged record is due :attr:`refresh_s` after it (:meth:`refresh_due_in`).
        self.last_at: Optional[float] = None
        #: The latest expiration (swarm time) stored for this peer's subkey, by this announcer or found in the
        #: DHT right after its first store: every announcement expires later (see :meth:`announce_once`).
        self.expires_at: Optional[float] = None
        # One announcement at a time: two interleaved ones (the loop's and an update's, with a lifetime that
        # follow_rounds shortened in between) stored the later-expiring, older record last-but-one, and the
        # DHT then refused every newer one until now + ttl passed it (seen at 32 processes: "+36.4s later").
        self._one_at_a_time = asyncio.Lock()
        #: ``() -> None`` while this peer makes progress, else why not (issue 29 #5: liveness is progress, not
        #: a heartbeat): :meth:`run` then stops refreshing the record (it expires within its lifetime).
        self.live = live
        #: why the refreshes stopped (the ``live`` check's answer), None while announcing
        self.silenced: Optional[str] = None

    def follow_rounds(self, cycle_s: float, window_s: Optional[float]) -> None:
        """Records from now on live :func:`record_ttl_s` (four rounds) of the longer of the sync window and the last
        round's cycle (seconds, as it really ran). Under CPU overload rounds run several windows long and a
        peer's loop announces late: with a lifetime from the configured window only, records expired before
        others read them and the views of 32 peer processes on 2 cores split into two lineages (issue 25). A
        shorter lifetime after a long one never makes a record expire before the one already stored (the DHT
        keeps the later expiration): see :meth:`announce_once`."""
        self.ttl_s = record_ttl_s(self.period_s, max(window_s or 0.0, cycle_s))

    @property
    def refresh_s(self) -> float:
        """Seconds from the last announcement to the next of an unchanged record: ``period_s``, or
        ``ttl_s / RECORD_REFRESHES`` (a third of the lifetime: about 1.3 rounds) when that is longer. A record
        :meth:`update` changes is announced at once, and the round announces at its end, which restarts the
        wait: a peer whose rounds end on time stores its record once a round, and one whose round runs long
        refreshes it at most every 1.3 of its last rounds. Every ``period_s`` stored a 40 s round's record ~20
        times, each a lookup and k stores, so the overloaded swarm's DHT traffic per round grew with its cycle
        (issue 25). Three refreshes per lifetime: two may fail or come late before the record expires."""
        return max(self.period_s, self.ttl_s / RECORD_REFRESHES)

    def refresh_due_in(self) -> float:
        """Seconds until the unchanged record is due for a refresh (:attr:`refresh_s` after the last announcement,
        by this announcer's loop or anyone's :meth:`announce_once`); 0.0 when due, or before the first."""
        if self.last_at is None:
            return 0.0
        return max(0.0, self.last_at + self.refresh_s - self._clock())

    def lifetime_s(self) -> float:
        """The lifetime of the next announcement, seconds: ``ttl_s``, or ``STORE_LATENCY_LIFETIMES`` x the
        longest of the node's recent stores (``DHTNode.recent_store_s``) when that is longer. At 32 processes
        on 2 cores stores took 10-20 s in the first round (before :meth:`follow_rounds` had a cycle to follow):
        9 s records arrived expired ("record expired 13.0s ago") and the views of who is live emptied."""
        recent = getattr(self.node, "recent_store_s", None)
        slow = STORE_LATENCY_LIFETIMES * float(recent()) if callable(recent) else 0.0
        return max(self.ttl_s, min(slow, RECORD_TTL_CAP_S))

    async def _stored_expiration(self, mine: str) -> Optional[float]:
        """The expiration (swarm time) of the record the DHT holds for this peer's subkey, None when none."""
        found = await self.node.get(self.key, latest=True)
        item = found.get(mine)
        return None if item is None else float(item.expiration_time)

    @property
    def said_leaving(self) -> bool:
        """Whether the last announcement that returned stored a ``leaving`` record (at least one node accepted it).
        A node's shutdown announces leaving unless so: a stop's announcement cancelled mid-store set the node's flag
        and stored nothing, and a peer stopped while it waited alone stayed ``training`` on the status views until its
        record expired (fresh user 52); one that no node accepted is no better (red team 52c: it read True)."""
        return self.last is not None and self.last.leaving and self.last_ok

    def update(self, record: RecordSource) -> None:
        """Use ``record`` from now on and announce it at once (when running)."""
        self._source = record
        self._wake.set()

    async def _current(self) -> PeerRecord:
        src = self._source
        rec = src() if callable(src) else src
        if asyncio.iscoroutine(rec):
            rec = await rec
        if not isinstance(rec, PeerRecord):
            raise TypeError(f"record source gave {type(rec).__name__}, expected PeerRecord")
        return rec

    async def announce_once(self) -> bool:
        """Store the current record now; True when at least one node accepted it.

        Its expiration is now + :meth:`lifetime_s`, or ``EXPIRATION_STEP_S`` past the latest one already stored for this
        subkey when that is later: the DHT keeps the record that expires last, so a record expiring sooner
        would be refused while the stale one stays. That happens to a peer restarted with its key while the
        record of its previous process lives on (its old address, round and digest: the others would plan
        it there, and so would it: issue 25), and after :meth:`follow_rounds` shortened the lifetime. After
        its first store the announcer reads the subkey's stored expiration (one read of the key) and stores again
        past it when it is later; a failed read is logged at DEBUG (the stale record then expires on its own)."""
        async with self._one_at_a_time:
            return await self._announce()

    async def _announce(self) -> bool:
        rec = await self._current()
        mine = self.identity.peer_id.to_string()
        if rec.peer_id != mine:
            raise ValueError(f"PeerRecord.peer_id {rec.peer_id[:10]}… is not this identity's PeerID {mine[:10]}…")
        first = self.expires_at is None
        self.last_at = self._clock()  # the loop's next refresh waits refresh_s from here
        now = self.node.now()  # swarm time: peers with skewed clocks agree on when it expires
        expiration = now + self.lifetime_s()
        if self.expires_at is not None and self.expires_at >= expiration:
            expiration = self.expires_at + EXPIRATION_STEP_S
        rec = rec.model_copy(update={"timestamp": now})
        data = rec.to_bytes()
        self.expires_at = expiration  # before the store: replicas it reached hold it even if the call then fails
        ok = await self.node.store(self.key, data, expiration, subkey=mine, owner=self.identity)
        if first:
            # After the first store (not before: a fresh peer's record is not delayed by a read): a record of a
            # previous process of this identity that expires later was kept instead; outlive it.
            try:
                held = await self._stored_expiration(mine)
            except Exception as e:  # the DHT may not be reachable yet: the stale record then expires on its own
                log.debug("reading this peer's stored record after its first announcement failed: %r", e)
                held = None
            if held is not None and held > expiration:
                self.expires_at = held + EXPIRATION_STEP_S
                ok = await self.node.store(self.key, data, self.expires_at, subkey=mine, owner=self.identity)
        if self.mirror_key is not None:
            try:  # best effort: only misconfigured nodes read it
                await self.node.store(self.mirror_key, data, self.expires_at, subkey=mine, owner=self.identity)
            except Exception as e:
                log.debug("mirroring this peer's record under %s failed: %r", self.mirror_key, e)
        self.last, self.last_ok = rec, bool(ok)
        self.announced += 1
        return ok

    def _check_live(self) -> bool:
        """Ask :attr:`live` whether to refresh now; one WARNING when the refreshes stop, one INFO when they resume."""
        reason = self.live() if self.live is not None else None
        if reason and self.silenced is None:
            log.warning(
                "not announcing %s any more: %s; its record expires within %.0f s, so no leader plans it "
                "and the status page drops it (announcing resumes when the peer makes progress again)",
                self.identity.peer_id.short(),
                reason,
                self.lifetime_s(),
            )
        elif not reason and self.silenced is not None:
            log.info("announcing %s again: it makes progress again", self.identity.peer_id.short())
        self.silenced = reason or None
        return self.silenced is None

    async def run(self) -> None:
        """Announce forever (errors are logged, never fatal): now, at once on :meth:`update`, and when
        :meth:`refresh_due_in` says the record is due (every announcement, the round's own included, restarts
        that wait); refreshing only while :attr:`live` says the peer makes progress (checked every ``period_s``
        while it does not)."""
        while True:
            self._wake.clear()  # before the store: an update() during it is announced next, not lost
            try:
                if self._check_live() and not await self.announce_once():
                    log.debug("announcement of %s was accepted by no node", self.identity.peer_id.short())
            except asyncio.CancelledError:
                raise
            except Exception as e:  # keep announcing whatever happens
                log.warning("announcing %s failed: %r", self.identity.peer_id.short(), e)
            if self.silenced is not None:
                await wait_event(self._wake, self.period_s)
                continue
            # until woken or due; an announcement made meanwhile (the round's) moves the due time later
            while not await wait_event(self._wake, self.refresh_due_in()) and self.refresh_due_in() > 0:
                pass

    def start(self) -> asyncio.Task:
        """Start announcing in the background (a task owned by the node)."""
        if self._task is None or self._task.done():
            self._task = self.node.tasks.spawn(self.run(), name="dht-announce")
        return self._task

    async def stop(self) -> None:
        """Stop announcing; the record expires ``ttl_s`` after the last announcement."""
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None


async def announce_loop(node: DHTNode, record: RecordSource, **options: Any) -> None:
    """Announce ``record`` every ``period_s`` seconds until cancelled: ``PeerAnnouncer(node, record,
    **options).run()``, the keyword options (``identity``, ``run_id``, ``period_s``, ``ttl_s``) and
    errors those of :class:`PeerAnnouncer`."""
    await PeerAnnouncer(node, record, **options).run()
