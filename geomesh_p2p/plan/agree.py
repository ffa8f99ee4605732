"""Round lifecycle: leader election, the signed plan in the DHT, digest agreement (DESIGN.md "Round r").

Leader election is rendezvous hashing: every candidate PeerID p gets the rank H(r, p) = SHA-256 of
``"<run>/<r>/<p>"``; the lowest rank leads round r. Candidates are the members a peer sees that may
lead (the node passes the established ones, :func:`geomesh_p2p.trust.probation.leader_candidates`: new
identities never lead). Candidate i (0-based, in rank order) publishes its plan only after
:func:`takeover_delay` without a plan from a better-ranked leader: ``i * plan_timeout_s`` for the
first ``LEADER_WAIT_CANDIDATES`` (so a leader that died before publishing is replaced within one
timeout), then only a short ``stagger_s`` more per candidate, never more than
``(LEADER_WAIT_CANDIDATES + 1) * plan_timeout_s`` in all. So silent candidates (identities that announce
and never lead) cost a bounded wait however many there are.

Why this cannot fork an honest round: waiting less only makes *more* candidates publish, and which plan
is followed does not depend on who published first. Every peer, candidate or not, follows
:func:`choose_plan` over the valid plans it reads after ``settle_s``: the lowest-ranked leader's. Two
honest leaders publishing (one took over while the other was slow) is harmless as long as every
follower sees both before deciding; a better-ranked candidate does not publish once a worse-ranked
plan has started (its peers are training), which is the rule that already kept late leaders from
splitting a round. The stagger keeps the candidates past the bounded ones from all publishing at once
(each sees the first of them and stays quiet).

Several plans can exist for one round (peers that saw different member sets may each think they
lead). Every peer follows the same deterministic rule: among the valid plans it can read, the one
whose leader has the lowest rank wins. A peer waits ``settle_s`` after the first plan appears and
reads again before deciding, so late-published better-ranked plans are seen too (no settle once
``settle_s`` has passed since the plan's start time: an honest better-ranked leader does not publish
after a plan has started, so whatever it published before is visible by then). A plan is valid
when it is signed by its leader (the DHT record's owner), names that leader and this round, and (a plan
too big for one DHT value, :mod:`geomesh_p2p.plan.wire`) every chunk the leader's head lists is there,
signed by the leader and matching its hash; until then the plan counts as not yet visible.

Digest agreement: after the outer step each peer publishes the digest of its global weights in its
PeerRecord; :func:`digest_majority` finds the majority digest of a round, and a peer whose digest
differs is flagged for re-sync.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter
from typing import Callable, Collection, Container, Iterable, Mapping, Optional, Sequence

from pydantic import ValidationError

from geomesh_p2p.dht.chunked import store_chunked
from geomesh_p2p.dht.records import RecordLimits
from geomesh_p2p.telemetry import events
from geomesh_p2p.net.swarm_time import swarm_time
from geomesh_p2p.plan.schema import ContentRefusal, RoundPlan
from geomesh_p2p.plan.wire import THREAD_ABOVE_PEERS, PlanPending, PlanReader, split_plan
from geomesh_p2p.util.backoff import Backoff
from geomesh_p2p.schema.peer import PeerRecord


class PlanRefused(Exception):
    """Raised by :func:`obtain_plan` when this peer refuses a plan that other peers may follow, so that any
    other plan it followed (or published) would split the round: a leader candidate's plan ranked better than
    every plan it accepts, or a plan of one that already started (its peers are training). The peer sits the
    round out (waits for its end and re-syncs to what the swarm made) instead of forking; ``plan`` is the
    refused plan, ``reason`` why (issue 25, "no fork under overload")."""

    def __init__(self, plan: RoundPlan, reason: str):
        super().__init__(f"round {plan.round}: refused the plan of leader {plan.leader[:10]}: {reason}")
        self.plan, self.reason = plan, reason


class PlanStalled(Exception):
    """Raised by :func:`obtain_plan` instead of publishing when this process was not running (SIGSTOP, swap, a
    debugger, an event loop blocked) for at least :data:`STALL_S` of the agreement: its members view and the
    plans it read are as old as the stall, and a take-over made from them plans a round with peers that may
    have finished the round or left long ago (review H1: a peer stopped 47 s planned round 3 alone after the
    others exited). The caller reads the swarm again before planning; ``stalled_s`` is the stall, seconds."""

    def __init__(self, round: int, stalled_s: float):
        super().__init__(f"round {round}: this peer was not running for {stalled_s:.1f} s during the plan agreement")
        self.round, self.stalled_s = round, stalled_s


class PlanDeferred(Exception):
    """Raised by :meth:`RoundPolicy.make_plan` when no plan can be made yet for a reason the policy has
    already told the user (logged once per change of state, e.g. no reachable peer can own a part): the
    caller waits and retries without logging it again (issue 14 #10: not an ERROR every few seconds)."""


log = logging.getLogger(__name__)


#: Better-ranked candidates a follower waits a whole ``plan_timeout_s`` for before the next takes over;
#: past them each further candidate waits only ``stagger_s`` more (see :func:`takeover_delay`).
LEADER_WAIT_CANDIDATES = 2
#: Seconds one step of the agreement loop (a DHT read and the sleep after it) may overrun what it was given
#: before the process counts as stalled (:class:`PlanStalled`): far above the loop lag of a loaded host
#: (heavy work runs off the loop) and the DHT's per-read deadlines, far below a stopped process.
STALL_S = 15.0

#: Seconds a peer waits after the first plan it reads, for a better-ranked plan published meanwhile (the floor of
#: :meth:`PlanStore.settle_s`, which follows the DHT's store latency).
SETTLE_S = 0.5

#: From this many participants a plan's body may be over ``wire.PLAN_INLINE_BYTES`` (4 KB: ~40 peers; a lower
#: count, so that every chunked plan is covered): its leader publishes in two steps (the chunks, then the head), so
#: a better-ranked plan becomes visible two store latencies after its leader starts, and a follower settles twice
#: :meth:`PlanStore.settle_s` (red team, session 18).
CHUNKED_SETTLE_PEERS = 32


def settle_for(plan: RoundPlan, settle_s: float) -> float:
    """How long a follower that read ``plan`` first waits for a better-ranked one: ``settle_s`` (x 2 when plans of
    this many participants may be chunked: :data:`CHUNKED_SETTLE_PEERS`), ended by the middle of the plan's window
    at the latest (the inner steps run on the provisional plan meanwhile; the exchange must not start late), that
    cap being at least :data:`SETTLE_S`. Seconds."""
    steps = 2 if len(plan.assignments) >= CHUNKED_SETTLE_PEERS else 1
    return min(steps * settle_s, max(SETTLE_S, plan.window_s / 2))


def takeover_delay(
    index: int, plan_timeout_s: float, stagger_s: float, wait_candidates: int = LEADER_WAIT_CANDIDATES
) -> float:
    """Seconds without a better-ranked plan after which the candidate at ``index`` (0 = best) publishes:
    ``min(i, M) * T + min(max(0, i - M) * stagger_s, T)`` with ``M = wait_candidates``, ``T =
    plan_timeout_s``; bounded by ``(M + 1) * T`` whatever the number of candidates."""
    m = max(0, int(wait_candidates))
    return min(index, m) * plan_timeout_s + min(max(0, index - m) * stagger_s, plan_timeout_s)


def plan_key(run_id: str, round: int) -> str:
    """DHT key under which the leaders of ``round`` store their plans (subkey = leader PeerID)."""
    return f"{run_id}/plan/{round}"


def leader_rank(run_id: str, round: int, peer_id: str) -> bytes:
    """Rendezvous-hash rank of ``peer_id`` for ``round`` (lower leads). 32 bytes."""
    return hashlib.sha256(f"{run_id}/{round}/{peer_id}".encode()).digest()


def leader_order(run_id: str, round: int, peer_ids: Iterable[str]) -> list[str]:
    """Candidates for leading ``round``, best first (deterministic for the same set)."""
    return sorted(set(peer_ids), key=lambda p: leader_rank(run_id, round, p))


def choose_plan(
    run_id: str, round: int, plans: Sequence[RoundPlan], tiers: Mapping[str, int] = {}
) -> Optional[RoundPlan]:
    """The plan every peer follows for ``round``: the one whose leader ranks lowest (``tiers``: leader -> tier, 0
    when absent, compared before the rank: :func:`obtain_plan`). None if no plan."""
    valid = [p for p in plans if p.round == round and p.run_id == run_id]
    if not valid:
        return None
    return min(valid, key=lambda p: (tiers.get(p.leader, 0), leader_rank(run_id, round, p.leader)))


def digest_majority(
    records: Iterable[PeerRecord], round: int, behind: Optional[str] = None
) -> tuple[Optional[str], int, int]:
    """Majority weights digest among records announced at ``round``.

    Returns (digest or None, votes for it, records counted). A tie breaks against ``behind`` first, then on the
    digest string, so every peer that counts the same votes picks the same one. ``behind``: the start digest of
    round ``round - 1`` (the plan's ``start_digest``), the state of a peer that applied nothing of that round.

    Why ``behind`` loses a tie (session 28's backdoor pair b): two honest peers advanced to X while a third, which
    had followed a plan that lost the agreement and applied nothing, still held the start state S, backed by the
    poisoner. The 2-2 tie broke on the string for S, so the third kept it and trained on with the poisoner: a fork.
    A side that advanced is ahead of one that stood still (one lineage); the reverse is never true.
    """
    votes = Counter(r.weights_digest for r in records if r.round == round and r.weights_digest)
    if not votes:
        return None, 0, 0
    digest, n = max(votes.items(), key=lambda kv: (kv[1], kv[0] != behind, kv[0]))
    return digest, n, sum(votes.values())


def state_tie_winner(holders: Mapping[tuple[int, str], int]) -> tuple[int, str]:
    """The state (round, digest) that peers on different states, none of them ahead by the vote, settle on: the one
    most of them hold, then the later round, then the larger digest (:func:`digest_majority`'s break of a tie), so
    every peer that counts the same records computes the same state. ``holders``: (round, digest) -> how many peers
    hold it (this peer counted); not empty.

    Why (red team 50b): two peers resumed from checkpoints of the same round with different digests (one of them a
    fork) were a 1-1 tie that nothing broke: each waited for the other, for ever when each was held for the peers
    of its checkpoint (``round.gather.held_for_swarm``). With this rule both sides agree which one moves."""
    return max(holders.items(), key=lambda kv: (kv[1], kv[0][0], kv[0][1]))[0]


#: A stored plan lives at least this long (seconds), and longer when its round lasts longer (:func:`plan_expiration`).
PLAN_TTL_FLOOR_S = 120.0
#: A reader ignores a plan this long (seconds) after its exchange deadline (``PlanStore.stale_after_s``).
PLAN_STALE_AFTER_S = 30.0


def plan_expiration(
    plan: RoundPlan, now: float, floor_s: float = PLAN_TTL_FLOOR_S, stale_after_s: float = PLAN_STALE_AFTER_S
) -> float:
    """When (swarm time, unix seconds) the DHT may drop ``plan`` stored at ``now``: not before its whole round is
    over and readers stopped following it (``exchange_deadline + stale_after_s``), and at least ``floor_s``
    after ``now``; never past the DHT's longest lifetime (``RecordLimits.max_ttl_s``, a store beyond it is refused).

    Why from the plan's deadlines (issue 29 #2, hivemind#482): a fixed 120 s made a plan of a multi-minute window
    vanish mid-round, from the status page and from a joiner's busy-donor map, and peers reading late found no
    plan and published last-resort ones. Followers accept deadlines up to ``4 x window + 120 s`` ahead
    (:func:`geomesh_p2p.round.rules.planning.plan_horizon_s`), so the lifetime follows the window through them."""
    end = max(now + floor_s, float(plan.exchange_deadline) + stale_after_s)
    return min(end, now + RecordLimits().max_ttl_s - 600.0)  # a margin for the readers' clock offsets


class PlanStore:
    """Reads and writes signed plans in the DHT (the DHT record owner is the plan's leader).

    The wire form (:mod:`geomesh_p2p.plan.wire`): a compact body, in the head value under
    ``<run>/plan/<r>`` (subkey = the leader) when it fits in one value, else in chunks under their own
    keys that the head lists by hash. ``chunk_timeout_s``: deadline of each chunk's get, seconds.
    ``ttl_s``: the shortest lifetime of a stored plan, seconds; a plan lives until its round is over
    (:func:`plan_expiration`). ``stale_after_s``: a plan whose exchange deadline is this long past is ignored.
    ``stable_parts`` (a run with record shards S > 1): a chunked plan's chunks are also stored under the keys of
    :func:`geomesh_p2p.dht.chunked.stable_chunk_key`, the same every other round, and its head says so: followers read
    each chunk from one holder they found before (a Find call, no lookup; issue 25, session 26).
    """

    def __init__(
        self,
        dht,
        identity,
        run_id: str,
        ttl_s: float = PLAN_TTL_FLOOR_S,
        stale_after_s: float = PLAN_STALE_AFTER_S,
        chunk_timeout_s: float = 5.0,
        stable_parts: bool = False,
    ):
        self.dht, self.identity, self.run_id, self.ttl_s = dht, identity, run_id, ttl_s
        self.stable_parts = stable_parts
        self.stale_after_s = stale_after_s
        self.reader = PlanReader(dht, chunk_timeout_s=chunk_timeout_s)
        self._refused: set = set()
        self._logged: set = set()

    def settle_s(self, floor_s: float = SETTLE_S) -> float:
        """How long a follower settles (:func:`obtain_plan`'s ``settle_s``): ``floor_s``, or the longest of this
        node's recent DHT stores when longer (``DHTNode.recent_store_s``). A better-ranked leader that read no
        started plan publishes, and its plan becomes visible when its store ends: under load (32 peer processes on
        2 cores, issue 25) stores took seconds, followers that settled 0.5 s read only the worse-ranked plan,
        those that read later followed the better one, and the round ended on two states. Stores of one swarm
        take about as long as each other's, so a settle as long as this node's slowest sees such a plan.
        :func:`obtain_plan` ends a settle longer than ``SETTLE_S`` by the middle of the plan's window at the latest."""
        recent = getattr(self.dht, "recent_store_s", None)
        return max(floor_s, float(recent()) if callable(recent) else 0.0)

    async def publish(self, plan: RoundPlan) -> bool:
        """Store ``plan`` signed by this peer: its chunks first (16 at once), then the head, so a reader
        that sees the head finds the chunks. Returns False when a chunk or the head was stored nowhere.
        Also False (one ERROR line) when the plan needs more than ``wire.MAX_PLAN_CHUNKS`` chunks."""
        me = str(self.identity.peer_id)
        try:
            if len(plan.assignments) > THREAD_ABOVE_PEERS:
                enc = await asyncio.to_thread(split_plan, plan, stable=self.stable_parts)
            else:
                enc = split_plan(plan, stable=self.stable_parts)
        except ValueError as e:  # ~47,000 peers: the next leader will not do better, but the node lives on
            log.error("round %d: my plan cannot be stored: %s", plan.round, e)
            return False
        key = plan_key(self.run_id, plan.round)
        expires = plan_expiration(plan, swarm_time(), self.ttl_s, self.stale_after_s)
        out = await store_chunked(self.dht, key, enc, subkey=me, owner=self.identity, expiration_time=expires)
        if out.chunks_failed:
            log.warning("round %d: %d of %d plan chunks were stored nowhere", plan.round, out.chunks_failed, out.chunks)
        return out.ok

    def _once(self, level: int, key: tuple, msg: str, *args) -> None:
        """Log ``msg`` once per ``key`` (the reads of a round poll: one line per reason, not one per poll)."""
        if key not in self._logged:
            self._logged.add(key)
            if len(self._logged) > 4096:  # bounded: a long run forgets old rounds' lines
                self._logged.clear()
                self._logged.add(key)
            log.log(level, msg, *args)

    async def _load(self, round: int, key: str, subkey, entry) -> Optional[RoundPlan]:
        """The plan of one head, or None (logged once with the reason) when it is not signed by the peer
        whose subkey it is under, malformed, or not assembled yet (a chunk missing or not matching)."""
        value, _expiration, owner = entry
        who = str(subkey)[:10]
        if owner is None or subkey is None or str(owner) != subkey:
            self._once(
                logging.WARNING,
                (round, subkey, "unsigned"),
                "ignoring plan for round %d under %s: not signed by it",
                round,
                who,
            )
            return None
        try:
            return await self.reader.load(key, subkey, value)
        except PlanPending as e:
            self._once(
                logging.INFO, (round, subkey, str(e)), "plan of round %d from %s not usable yet: %s", round, who, e
            )
        except (ValidationError, ValueError) as e:
            self._once(
                logging.WARNING,
                (round, subkey, "malformed"),
                "ignoring malformed plan for round %d from %s: %s",
                round,
                who,
                str(e)[:160],
            )
        return None

    async def read_exact(self, round: int, leader: str, sha256: str) -> tuple[Optional[RoundPlan], str]:
        """The plan of ``round`` stored under ``leader``'s subkey whose ``RoundPlan.to_bytes`` hashes (SHA-256,
        lowercase hex) to ``sha256``, and "" ; else (None, why): absent, not signed by ``leader``, malformed or
        its chunks not readable, of another run or round, or another plan (a hash mismatch). Unlike :meth:`read`,
        a plan past its round's end is returned: a peer that sat that round out asks for it after it ended
        (``round/last_plan.py``). Never raises on what the DHT holds."""
        key = plan_key(self.run_id, round)
        entry = (await self.dht.get(key) or {}).get(leader)
        if entry is None:
            return None, f"no plan of round {round} from {leader[:10]} in the DHT"
        plan = await self._load(round, key, leader, entry)
        if plan is None:
            return None, f"the plan of round {round} from {leader[:10]} is unsigned, malformed or incomplete"
        if plan.leader != leader or plan.round != round or plan.run_id != self.run_id:
            return None, f"the plan stored under {leader[:10]} for round {round} names another leader, run or round"
        if hashlib.sha256(plan.to_bytes()).hexdigest() != sha256:
            return None, f"the plan of round {round} from {leader[:10]} is another one than referenced (hash differs)"
        return plan, ""

    async def read(
        self,
        round: int,
        accept: Optional[Callable[[RoundPlan], Optional[str]]] = None,
        seen: Optional[set] = None,
        leaders: Optional[Container[str]] = None,
    ) -> list[RoundPlan]:
        """Valid plans for ``round``: parsed, for this run and round, signed by the leader they name,
        and passing ``accept`` (a check returning a reason to refuse, or None). ``seen``, when given,
        receives the leader of every signed, current plan of the round, refused ones included.
        A plan whose chunks are not all readable and matching is left out (the next read retries).

        ``leaders``, when given: only the plans stored under these subkeys (PeerIDs) are parsed and their
        chunks fetched; the others are left unread. Any identity can store a head under its own subkey, and
        a head that names 64 chunks costs 64 lookups per read (review, session 10: 50 throwaway identities
        made each read of a follower take 11-13 s), so a follower passes the peers whose plans its ``accept``
        could take (a plan's leader must be a live peer it knows)."""
        key = plan_key(self.run_id, round)
        found = list((await self.dht.get(key) or {}).items())
        if leaders is not None:
            known = [(sk, e) for sk, e in found if sk is not None and str(sk) in leaders]
            if len(known) < len(found):
                n = len(found) - len(known)
                self._once(
                    logging.INFO,
                    (round, "unknown", n),
                    "round %d: %d plan(s) under the subkeys of no known peer left unread",
                    round,
                    n,
                )
            found = known
        loaded = await asyncio.gather(*(self._load(round, key, sk, entry) for sk, entry in found))
        plans = []
        for (subkey, _entry), plan in zip(found, loaded):
            if plan is None:
                continue
            if plan.leader != subkey:
                log.warning("ignoring plan for round %d: leader %s did not sign it", round, plan.leader[:10])
                continue
            if plan.round != round or plan.run_id != self.run_id:
                log.warning(
                    "ignoring plan stored for round %d that says run %s round %d", round, plan.run_id, plan.round
                )
                continue
            if plan.exchange_deadline + self.stale_after_s < swarm_time():
                continue  # a finished round of an earlier swarm (e.g. before a restart): not ours to follow
            if seen is not None:
                seen.add(plan.leader)
            reason = accept(plan) if accept is not None else None
            if reason is not None:
                once = (round, plan.leader, reason)
                if once not in self._refused:
                    self._refused.add(once)
                    events.emit(
                        log,
                        logging.WARNING,
                        "plan_refused",
                        "refusing the plan of round %d from %s: %s",
                        round,
                        plan.leader[:10],
                        reason,
                        peer=str(self.identity.peer_id),
                        round=round,
                        leader=plan.leader,
                        reason=reason,
                    )
                continue
            plans.append(plan)
        return plans


async def obtain_plan(
    store: PlanStore,
    round: int,
    members: Sequence[PeerRecord],
    make_plan: Callable[[Sequence[PeerRecord], str], RoundPlan],
    *,
    plan_timeout_s: float = 5.0,
    settle_s: float = SETTLE_S,
    poll_s: float = 1.0,
    give_up_s: Optional[float] = None,
    accept: Optional[Callable[[RoundPlan], Optional[str]]] = None,
    candidates: Optional[Sequence[str]] = None,
    stagger_s: Optional[float] = None,
    wait_candidates: int = LEADER_WAIT_CANDIDATES,
    provisional: Optional[Callable[[RoundPlan], None]] = None,
    last_resort: Sequence[str] = (),
    authorities: Sequence[str] = (),
    leaders: Optional[Callable[[], Collection[str]]] = None,
    gapped: Collection[str] = (),
    tiers: Mapping[str, int] = {},
) -> Optional[RoundPlan]:
    """Agree on the plan of ``round``: publish one if this peer's turn as leader comes, follow the best.

        ``members`` is this peer's view of the live, in-sync peers (itself included); ``make_plan(members,
        leader)`` computes a plan. ``candidates``: the PeerIDs that may lead (default: every member); a peer
        that is not one never publishes. Candidate i publishes after :func:`takeover_delay` (``stagger_s``
        defaults to ``settle_s``). Returns None when no plan appeared within ``give_up_s`` (default: the
        last candidate's delay + 2 * plan_timeout_s). DHT reads back off from 50 ms to ``poll_s`` (x1.5),
    restarting when the plans seen change and at each candidate's take-over instant. ``accept(plan)`` returns a reason to refuse a plan (a
        rogue or broken leader's), or None; refused plans are ignored as if absent.

        ``provisional(plan)`` (issue 17), when given, is called once with the best plan seen just before the
        settle wait starts: the plan that is returned unless a better-ranked one shows up during the settle.
        The caller may start the round on it at once (the driver trains on it, and throws those steps away
        if the returned plan differs), so the settle costs no compute; which plan is followed is unchanged.

        ``last_resort``: PeerIDs that are no candidates but publish when every candidate's turn has passed
        with no plan at all: ranked after the candidates (by :func:`leader_order` among themselves), the
        first one ``plan_timeout_s`` after the last candidate's turn, then ``stagger_s`` apart. One never
        publishes once a plan of the round from one of ``members`` was read, even one it refuses (a leader it
        does not accept is there: its own plan would split the round).
        The driver names this peer so after a whole attempt without a plan (docs/round.md, "Leader
        election when nobody leads"): views that differ must not leave every member deferring to another.

        No fork on a refused plan (issue 25): a plan this peer refuses from one of ``candidates`` or
        ``authorities`` (established live peers outside this peer's members, e.g. in sync at another state:
        other peers may follow their plans) is not bypassed. While it ranks better than every plan this peer
        accepts, this peer publishes nothing and follows nothing; the refusal is read again until that plan's
        settle ends (a view that catches up accepts it), then :class:`PlanRefused` is raised: the caller sits
        the round out. Nor does this peer publish once such a plan ranks better than itself or has started.
        Followers of a refused plan and of another one would end the round on two states. A refusal that is a
        :class:`~geomesh_p2p.plan.schema.ContentRefusal` (it follows from the plan and the run config alone:
        every honest follower gives it) is not such a plan: it is ignored as absent, as before.

        ``leaders()``, when given: PeerIDs whose plans may be read besides ``members``, the candidates, the last
        resorts and ``authorities`` (the caller's view of live peers: a plan's leader must be one for ``accept``
        to take it); every other stored plan is left unread (:meth:`PlanStore.read`). None: all are read.

        ``gapped``: candidates that announce they lead nothing this round by their own rule of the marks they lack
        (``PeerRecord.lead_from``, :meth:`~geomesh_p2p.round.rules.penalties.Penalties.lead_from`). They keep their
        rank (the order, the candidates and the plans accepted are unchanged); only the turns after theirs come
        sooner: candidate ``i`` waits :func:`takeover_delay` of ``i`` less the gapped ones ranked before it. Why
        (fresh user 51): such a peer leaves itself out where the others cannot see it, and they waited a whole
        ``plan_timeout_s`` for its plan, 4-8 s a round for up to 18 rounds. A rogue announcing a gap it lacks gains
        nothing it could not by staying silent and publishing late: its plan, published any time before the
        next candidate's has started, still ranks better and is followed (:func:`choose_plan` after the settle);
        waiting less only makes more candidates publish, which forks nothing (see the module's docstring).

        ``tiers``: leader -> tier (0 when absent), compared before the rendezvous rank wherever leaders are ordered
        (the turns, the last resorts' stagger, which plan is followed, which one ranks better): the level of round
        ``r - 1``'s plan a leader first appears in (``round.planning.plan_tiers``), the same in every view holding that
        plan. Why (red team 52b): a peer one attempt with no plan further accepts the plans of one more level (the
        accused, then round ``r - 1``'s leader), so by rank alone it followed a better-ranked plan of that level
        while a peer one attempt behind, refusing it as content, followed the other one (the rogue last leader
        published once the accused's plan was out: two states). With the tiers a plan of an earlier level wins in
        every view that accepts it.
    """
    me = str(store.identity.peer_id)
    member_ids = {m.peer_id for m in members}
    pool = [m.peer_id for m in members] if candidates is None else list(candidates)

    def rank(leader: str) -> tuple[int, bytes]:
        return tiers.get(leader, 0), leader_rank(store.run_id, round, leader)

    order = sorted(set(pool), key=rank)
    n_regular = len(order)
    # Last resorts are ranked among themselves over the whole list, candidates of this view included: the
    # views differ (rs7: each peer's only candidate was the other), and each last resort must get the same
    # rank in every view for the stagger to hold.
    lr_order = sorted(set(last_resort), key=rank)
    order += [p for p in lr_order if p not in order]
    my_turn = order.index(me) if me in order else None
    stagger_s = settle_s if stagger_s is None else stagger_s

    # the turns after an announced gap come sooner (``gapped``): each candidate's index less the gapped ranked before
    gaps = set(gapped) - {me}
    skipped = [0] * n_regular  # gapped candidates ranked before each (one pass: hundreds of candidates)
    for i in range(1, n_regular):
        skipped[i] = skipped[i - 1] + (order[i - 1] in gaps)

    def delay(i: int, shortened: bool = True) -> float:
        if i < n_regular:
            return takeover_delay(i - (skipped[i] if shortened else 0), plan_timeout_s, stagger_s, wait_candidates)
        # a last resort: strictly after every candidate's turn as unshortened (by one plan timeout), then staggered:
        # it publishes only where no candidate did, and a gap announced in one view must not bring it forward
        after = delay(n_regular - 1, False) + plan_timeout_s if n_regular else 0.0
        return after + lr_order.index(order[i]) * stagger_s

    if give_up_s is None:
        # nobody may publish in this view (e.g. every candidate's plan was refused last attempt): wait for a plan
        # from the others as long as for a first candidate's
        give_up_s = (delay(len(order) - 1) if order else 0.0) + 2 * plan_timeout_s
    # Take-over instants (seconds after t0): a plan is most likely to appear right after one of them, so
    # the reads wake there and back off (50 ms -> poll cap, x1.5) in between instead of polling every poll_s.
    turns = sorted({delay(i) for i in range(len(order))})
    backoff = Backoff(first=min(0.05, poll_s), cap=max(poll_s, 1.0))
    t0 = time.monotonic()
    published = False
    seen: Optional[frozenset] = None
    signed: set = set()  # leaders of every plan of the round read, refused ones included
    absent: set = set()  # leaders of plans refused as content (no honest peer follows them): they hold no last resort
    refused: dict[str, tuple[RoundPlan, str]] = {}  # leader -> its plan this peer refuses now, and why
    # leaders whose plans others may follow: a refused one of theirs must not be bypassed
    blockers = (set(pool) | set(authorities)) - {me}

    def check(plan: RoundPlan) -> Optional[str]:
        reason = accept(plan) if accept is not None else None
        if reason is None or isinstance(reason, ContentRefusal):
            # accepted (a view that caught up, a record read late), or refused by every honest follower alike:
            # ignored as absent, the next leader takes over (no follower can be on that plan)
            refused.pop(plan.leader, None)
            (absent.add if reason is not None else absent.discard)(plan.leader)
        else:
            refused[plan.leader] = (plan, reason)
            absent.discard(plan.leader)
        return reason

    def settle_of(plan: RoundPlan) -> float:
        return settle_for(plan, settle_s)

    def refused_over(best: Optional[RoundPlan]) -> Optional[tuple[RoundPlan, str]]:
        """The best-ranked refused plan of a candidate that ranks better than ``best`` (any, without one): a
        peer accepting both follows it, so following ``best`` (or a plan of this peer's) would split the round."""
        over = [v for k, v in refused.items() if k in blockers and (best is None or rank(k) < rank(best.leader))]
        return min(over, key=lambda v: rank(v[0].leader)) if over else None

    def publish_blocked() -> bool:
        """A refused candidate plan that ranks better than this peer, or that already started (its peers train)."""
        now = swarm_time()
        return any(k in blockers and (rank(k) < rank(me) or now >= p.created_at) for k, (p, _) in refused.items())

    check_fn = check if accept is not None else None
    stalled_s = 0.0  # the longest overrun of one loop step: see STALL_S
    step_due: Optional[float] = None  # elapsed seconds at which the last sleep was due to end (None: no sleep)

    # Plans read at all: those of ``leaders()`` (evaluated once per read) and of every peer this agreement names
    named = member_ids | set(order) | set(authorities) | {me}

    def readable() -> dict:
        return {"leaders": named.union(leaders())} if leaders is not None else {}

    while True:
        elapsed = time.monotonic() - t0
        due = elapsed if step_due is None else step_due
        plans = await store.read(round, check_fn, signed, **readable())
        stalled_s, step_due = max(stalled_s, time.monotonic() - t0 - due), None
        now_seen = frozenset(p.leader for p in plans)
        if now_seen != seen:
            seen = now_seen
            backoff.reset()  # something changed: read again soon
        best = choose_plan(store.run_id, round, plans, tiers)
        my_turn_now = my_turn is not None and not published and elapsed >= delay(my_turn)
        if my_turn_now and my_turn is not None and my_turn >= n_regular and (signed & member_ids) - {me} - absent:
            # a last resort publishes only where nobody leads at all; a plan it refuses from a member means a
            # leader it does not accept is there, and its own plan would split the round: it keeps waiting.
            # Plans of non-members do not count: any identity can sign one (review: a Sybil publishing a
            # plan every round that all refuse would bring the livelock back). Nor do plans refused as content
            # (red team 47: the rogue leader of the last round, which may not lead this one, published one to
            # hold the accused's last resort; no honest peer follows such a plan).
            my_turn_now = False
        # Publish when it is my turn, unless a plan from a better-ranked leader already exists, or a
        # worse-ranked one has already started (its peers are training: a competing plan would only
        # split the round; this peer follows it, or waits and catches up if it is not in it).
        if my_turn_now and publish_blocked():
            # A candidate's plan this peer refuses is there (its view lacks a record the leader saw, or holds
            # another penalty): others may follow it, and a plan of this peer's would split the round.
            my_turn_now = False
        over = refused_over(best)
        if over is not None:
            # Some peers may follow the refused plan (it ranks better than anything this peer would follow):
            # read again while its settle runs (the view may catch up: a record read late), then sit out.
            if swarm_time() > over[0].created_at + settle_of(over[0]):
                raise PlanRefused(*over)
            best = None
            my_turn_now = False
        if my_turn_now and stalled_s >= STALL_S:
            # The view this take-over would plan from is as old as the stall: read the swarm again first.
            raise PlanStalled(round, stalled_s)
        if my_turn_now and (best is None or (rank(me) < rank(best.leader) and swarm_time() < best.created_at)):
            waited = my_turn - (skipped[my_turn] if my_turn < n_regular else 0) if my_turn is not None else 0
            if my_turn is not None and waited > 0 and best is None:
                events.emit(
                    log,
                    logging.WARNING,
                    "plan_takeover",
                    "round %d: no plan from %d better-ranked leader(s) after %.1fs; taking over",
                    round,
                    my_turn,
                    elapsed,
                    round=round,
                    peer=me,
                    turn=my_turn,
                    delay_s=delay(my_turn),
                    after_s=elapsed,
                    last_resort=my_turn >= n_regular,
                )  # delay_s: this turn's take-over delay
            elif my_turn is not None and my_turn > 0 and best is None:  # every better-ranked one announced a gap
                log.info(
                    "round %d: the %d better-ranked leader(s) announce they lead nothing this round (lead_from): "
                    "leading without their wait",
                    round,
                    my_turn,
                )
            try:
                plan = make_plan(members, me)
            except PlanDeferred:  # the policy has said why (once); the next leader may do better
                my_turn = None
                continue
            except Exception as e:  # a broken record or a planner bug must not end the node
                log.error(
                    "round %d: planning failed (%s: %s); leaving the round to the next leader",
                    round,
                    type(e).__name__,
                    e,
                )
                my_turn = None
                continue
            # Read again: a plan stored while this peer planned (the next candidate's, its turn brought forward by an
            # announced gap: red team 51d) may have started, its followers settled on it.
            best = (
                choose_plan(store.run_id, round, await store.read(round, check_fn, signed, **readable()), tiers) or best
            )
            if my_turn is not None and my_turn >= n_regular and (signed & member_ids) - {me} - absent:
                continue  # a last resort that now reads a member's plan: it waits, as if read before planning (above)
            if (
                best is not None
                and (swarm_time() >= best.created_at or rank(best.leader) < rank(me))
                or publish_blocked()
            ):
                # Planning took long (a loaded CPU) and a worse-ranked plan has started by now (publishing would
                # split the round), or a better-ranked one appeared, or a candidate's plan this peer refuses:
                # follow or wait instead.
                my_turn = None
                continue
            own = check_fn(plan) if check_fn is not None else None
            if own is not None:
                # A plan this peer's own check refuses is one no follower of its view takes (stop 62's CI: a newcomer
                # on probation published plans every follower, itself too, refused, attempt after attempt): say why
                # and leave the round to the next leader.
                log.warning("round %d: not publishing my plan: my own check refuses it (%s)", round, own)
                my_turn = None
                continue
            published = await store.publish(plan)
            if not published:
                log.warning("round %d: could not store my plan in the DHT", round)
                my_turn = None  # do not retry every poll; follow whatever plan appears
            continue
        if best is not None:
            # Settle only while a better-ranked leader may still publish legitimately: until settle_s past
            # the plan's start (created_at); a peer reading later decides at once.
            wait = min(settle_of(best), best.created_at + settle_of(best) - swarm_time())
            if wait > 0:
                if provisional is not None:
                    provisional(best)
                step_due = time.monotonic() - t0 + wait
                await asyncio.sleep(wait)  # let a better-ranked plan published meanwhile become visible
                plans = await store.read(round, check_fn, **readable()) or plans
                if refused_over(choose_plan(store.run_id, round, plans, tiers)) is not None:
                    continue  # a better-ranked plan this peer refuses appeared: the loop decides (above)
            chosen = choose_plan(store.run_id, round, plans, tiers)
            if len(plans) > 1 and chosen is not None:
                log.info(
                    "round %d: %d plans seen, following leader %s (lowest rank)", round, len(plans), chosen.leader[:10]
                )
            return chosen
        if elapsed > give_up_s:
            if over is not None:
                raise PlanRefused(*over)  # others may still follow it: sit out rather than retry beside it
            return None
        step = backoff.next()
        upcoming = [t - elapsed for t in turns if t > elapsed]
        if upcoming and upcoming[0] <= step:
            step = upcoming[0] + 0.01  # wake just past the next take-over instant ...
            backoff.reset()  # ... and look closely for the plan it brings
        nap = max(0.0, min(step, give_up_s - elapsed + 0.01))
        step_due = time.monotonic() - t0 + nap
        await asyncio.sleep(nap)
