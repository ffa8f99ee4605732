"""Standing: votes that count delivered work, not identities (issue 12, "Votes that count work").

A peer's *standing*, as one node sees it, is the number of rounds, among the last ``window`` rounds
this node applied an aggregate of, in which that peer was a contributor of the aggregate (its part
pushes were accepted by the owners). New identities have standing 0 until they deliver; a peer that
stops delivering loses it as the window slides; no peer weighs more than ``window``.

The swarm's round, the digest a state download must match and the donors are chosen by
:func:`choose_state`:

* **standing vote** (a node that has trained with others): each other peer's record weighs its
  standing; a (round, digest) is adopted only when its backers hold more than half of the standing
  weight this node sees. Records of zero-standing identities count for nothing, however many: 30
  fresh Sybil records announcing round+1 cannot move a peer that trained with the honest ones.
* **fresh vote** (a node that knows nobody: fresh joiner, or resumed and none of the peers it knows is
  live): the (round, digest) backed by the most *distinct addresses* (one address, one vote, however
  many identities announce it), ties to the longest *record history*. A peer's history is the
  standing that *other* peers attest for it in their records (``PeerRecord.standing``; its own claim
  does not count). While any peer in view has history, identities nobody vouches for do not vote;
  records without an address (no donor) do not vote either. More than half of the addresses must
  back the state (or there is only one).
* **solo** (a node whose ledger credits only itself: it trained alone, so it knows nobody): the fresh
  vote; when no state has a majority, the most addresses, then the latest round, so lineages trained
  alone merge on one (docs/admission.md, "A young swarm").

What a fresh joiner cannot defend against: it has no history of its own, so when most of the network
it sees is the attacker's, it adopts the attacker's state, and the digest check only proves it got
what those identities announced. Concretely: identities that vouch for each other (so they have
"history") announcing more distinct addresses than the honest peers. Addresses in records are
claims (only a donor that serves the forged state has to be real), so this cost the attacker the
proof of work per identity and nothing else. The catch-up now dials each voter's address first
(:mod:`.dialback`: a signed Status reply from the record's own key, holding the state it announces),
so each vote costs a reachable address that serves a key and the state; distinct *hosts* are not
counted (honest peers share addresses behind NATs), so one attacker machine with many ports still
buys many votes. A joiner
of a private run (--allow-peers) is not exposed; a peer that has trained is protected by its own
ledger, which no record can write.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence

from geomesh_p2p.telemetry.logonce import LogOnce

log = logging.getLogger(__name__)

#: Rounds a node remembers: a peer's standing is the number of them it delivered in (so at most this).
DEFAULT_WINDOW = 32
#: Peers a record attests (its ledger's highest standings), and the PeerID prefix length used there.
ATTEST_TOP = 16
ATTEST_ID_CHARS = 16


def attest_key(peer_id: str) -> str:
    """How a record names a peer it vouches for: the first 16 base58 characters of its PeerID (~94 bits)."""
    return peer_id[:ATTEST_ID_CHARS]


def delivered(contributors: Mapping[int, Sequence[tuple[str, int]]]) -> set[str]:
    """The peers that delivered work in a round: listed with more than 0 tokens in at least one part's contributors
    (``CollectiveResult.contributors``: part index -> ``(peer id, tokens counted)``).

    A contribution counted at 0 tokens (a 0-token claim, or one below its token floor:
    :meth:`~geomesh_p2p.exchange.partition.CollectiveSpec.counted_tokens`) is listed but had no weight: crediting it
    let an identity that claims nothing, or too little to be screened, become established on rounds it never trained
    (issue 28, session 32)."""
    return {str(pid) for part in contributors.values() for pid, n in part if int(n) > 0}


class Standing:
    """Ledger of delivered rounds: ``credit(round, contributors)`` after each applied aggregate.

    ``weight(peer)`` = rounds among the last ``window`` credited in which ``peer`` contributed.
    """

    def __init__(self, window: int = DEFAULT_WINDOW):
        if window < 1:
            raise ValueError("window must be >= 1")
        self.window = window
        self._rounds: deque[tuple[int, frozenset]] = deque()
        self._counts: Counter = Counter()

    @property
    def known(self) -> bool:
        """True once any round was credited (this node has seen peers deliver)."""
        return bool(self._rounds)

    @property
    def last_round(self) -> Optional[int]:
        return self._rounds[-1][0] if self._rounds else None

    def credited_rounds(self) -> list[int]:
        """The rounds this ledger holds (credited, still in the window), oldest first."""
        return [r for r, _ in self._rounds]

    def credit(self, round: int, contributors: Iterable[str]) -> None:
        """Record that ``contributors`` delivered in ``round`` (once per round; a repeat is ignored)."""
        ids = frozenset(str(p) for p in contributors)
        if not ids or any(r == round for r, _ in self._rounds):
            return
        self._rounds.append((int(round), ids))
        self._counts.update(ids)
        while len(self._rounds) > self.window:
            _, old = self._rounds.popleft()
            self._counts.subtract(old)
            for p in old:
                if self._counts[p] <= 0:
                    del self._counts[p]

    def forget_since(self, round: int) -> list[int]:
        """Drop the credits of round ``round`` and later; returns the rounds dropped (oldest first).

        For a re-sync to a state this peer did not make (:func:`geomesh_p2p.round.resync.forget_blame`): the rounds
        since its last confirmed state were of a lineage the swarm discarded, and who delivered in them is no
        standing (session 31, the 2-of-7 backdoor run: the peer that started the swarm trained rounds 0-1 alone
        before the others were up, re-synced to their state, and still counted itself established on those two
        rounds: it published plans every other peer refused as a probation leader's, followed its own, was
        marked a no-show and sat out the rest of the run)."""
        gone = [r for r, _ in self._rounds if r >= round]
        if gone:
            keep = [(r, ids) for r, ids in self._rounds if r < round]
            self._rounds = deque(keep)
            self._counts = Counter()
            for _, ids in keep:
                self._counts.update(ids)
        return gone

    def weight(self, peer_id: str) -> int:
        return self._counts.get(peer_id, 0)

    def weights_in(self, rounds: range) -> Counter:
        """Peer id -> rounds credited within ``rounds`` (round numbers) in which it contributed: the ledger's
        weight restricted to a window of rounds, so credits of long ago (a checkpoint restored after a
        gap) do not count as recent ones."""
        out: Counter = Counter()
        for r, ids in self._rounds:
            if r in rounds:
                out.update(ids)
        return out

    def knows_others(self, me: Optional[str]) -> bool:
        """True when this ledger credits a peer other than ``me`` (this node saw someone else deliver).
        A ledger of rounds this node trained alone knows nobody: it is no evidence about anyone."""
        return any(p != me for p in self._counts)

    def attestations(self, exclude: Optional[str] = None, top: int = ATTEST_TOP, own: bool = False) -> dict[str, int]:
        """The ``top`` highest standings (prefix of PeerID -> rounds), for this node's PeerRecord; with
        ``own``, plus ``exclude``'s own entry (the rounds this node saw itself deliver) when it has one.

        The own entry is a claim: the fresh vote's history never counts it (:func:`history`), and a
        :class:`~geomesh_p2p.trust.probation.StandingView` reads it only from peers it trusts and only for the
        rounds it missed (docs/admission.md, "A young swarm")."""
        # Ties break on a hash salted with ``exclude`` (this node), so that in a large swarm different
        # nodes vouch for different peers of equal standing rather than all for the same 16.
        salt = (exclude or "").encode()
        best = sorted(
            ((c, p) for p, c in self._counts.items() if p != exclude and c > 0),
            key=lambda x: (-x[0], hashlib.sha256(salt + x[1].encode()).digest()),
        )
        out = {attest_key(p): c for c, p in best[:top]}
        if own and exclude is not None and self.weight(exclude) > 0:
            out[attest_key(exclude)] = self.weight(exclude)
        return out

    def trained_with(self, state_round: int, me: Optional[str]) -> tuple[str, ...]:
        """The other PeerIDs (sorted) credited at round ``state_round - 1``, the round that made a state of
        ``state_round`` (a checkpoint's), or when that round is not in the ledger at the newest round before it that is
        (a peer credits only the rounds it exchanged in: one planned out of the last rounds, or re-synced, caught up to
        the swarm's state; red team 50b: its checkpoint named nobody and a ``--resume --min-peers 2`` trained alone);
        empty when that round was trained alone (a lone round is credited too) or the ledger holds none before it."""
        before = [(r, ids) for r, ids in self._rounds if r < state_round]
        ids = max(before, key=lambda x: x[0])[1] if before else frozenset()
        return tuple(sorted(p for p in ids if p != me))

    def to_meta(self) -> dict:
        """JSON-able form, kept in checkpoints' metadata."""
        return {"window": self.window, "rounds": [[r, sorted(ids)] for r, ids in self._rounds]}

    @classmethod
    def from_meta(cls, meta, window: int = DEFAULT_WINDOW) -> "Standing":
        """Inverse of :meth:`to_meta`; anything malformed gives an empty ledger (logged)."""
        s = cls(window)
        if not meta:
            return s
        try:
            for r, ids in meta["rounds"]:
                s.credit(int(r), [str(p) for p in ids])
        # OverflowError: a round of Infinity (int(inf)) ended --resume in a traceback (red team 39)
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            log.warning("ignoring malformed standing in checkpoint metadata (%s)", e)
            return cls(window)
        return s


# ------------------------------------------------------------------------------------------- votes
@dataclass(frozen=True)
class StateChoice:
    """What to adopt: the state of ``round`` with ``digest``, downloadable from ``donors`` (addresses)."""

    round: int
    digest: str
    donors: list[str]
    backing: float  # weight of the records backing it
    total: float  # weight of every record that voted
    mode: str  # "standing", "fresh", "solo" or "tie" (StateSync.rejoin_state's break of a vote with no majority)

    def describe(self) -> str:
        """How the vote chose it, in the words of the refusal (:meth:`Refusal.message`)."""
        if self.mode == "tie":
            counted = f"; {self.backing:g} of the {self.total:g} peers counted hold it" if self.total else ""
            return f"the tie rule's state (the most holders, then the later round, then the larger digest{counted})"
        if self.mode == "standing":
            return (
                f"standing vote: its backers hold {self.backing:g} of the {self.total:g} rounds of standing "
                f"this peer sees"
            )
        rule = "more than half needed" if self.mode == "fresh" else "most addresses, then the latest round"
        return f"{self.mode} vote: {self.backing:g} of {self.total:g} distinct addresses ({rule})"


@dataclass(frozen=True)
class Refusal:
    """A state most *identities* announce that the standing vote refuses."""

    round: int
    digest: str
    identities: int  # records announcing it
    backing: float  # standing behind it
    total: float  # standing this node sees

    def message(self) -> str:
        head = (
            f"refusing the state of round {self.round} (digest {self.digest[:8]}) announced by "
            f"{self.identities} peer(s)"
        )
        if self.total <= 0:
            # Nobody in view was seen delivering: there is no standing to split, say so plainly.
            return (
                f"{head}: this peer has seen none of the peers in view deliver a round (standing vote: "
                f"it follows only peers it saw deliver)"
            )
        return (
            f"{head}: they hold {self.backing:g} of the {self.total:g} rounds of standing this peer sees "
            f"(more than half needed)"
        )


@dataclass
class Vote:
    """A state vote's outcome: ``choice`` (None: no state has a majority), the ``refusal`` to say, the voters'
    ``weights`` (peer -> standing, or history in a fresh vote) and whether it was the ``standing`` vote."""

    choice: Optional[StateChoice]
    refusal: Optional[Refusal] = None
    weights: dict = field(default_factory=dict)
    standing: bool = False


def history(records: Sequence, peer_id: str) -> int:
    """Standing that *other* records attest for ``peer_id`` (the highest attestation; its own does not count)."""
    key = attest_key(peer_id)
    best = 0
    for r in records:
        if r.peer_id != peer_id:
            best = max(best, min(int((getattr(r, "standing", None) or {}).get(key, 0)), DEFAULT_WINDOW))
    return best


def _address_key(address: str) -> str:
    return address.strip().lower()


def _standing_vote(others: list, standing: Standing) -> Vote:
    weights = {r.peer_id: standing.weight(r.peer_id) for r in others}
    total = sum(weights.values())
    backing: Counter = Counter()
    count: Counter = Counter()
    for r in others:
        backing[(r.round, r.weights_digest)] += weights[r.peer_id]
        count[(r.round, r.weights_digest)] += 1
    choice = None
    if total > 0:
        (rnd, dig), w = max(backing.items(), key=lambda kv: (kv[1], kv[0][0], kv[0][1]))
        if 2 * w > total:
            donors = [
                r.address
                for r in others
                if (r.round, r.weights_digest) == (rnd, dig) and r.address and weights[r.peer_id] > 0
            ]
            choice = StateChoice(rnd, dig, donors, w, total, "standing")
    refusal = None
    # What counting identities would have chosen (the old rule): say so when standing refuses it.
    (rnd, dig), n = max(count.items(), key=lambda kv: (kv[1], kv[0][0], kv[0][1]))
    if 2 * n > len(others) and (choice is None or (choice.round, choice.digest) != (rnd, dig)):
        refusal = Refusal(rnd, dig, n, backing[(rnd, dig)], total)
    return Vote(choice, refusal, weights, standing=True)


def _fresh_vote(others: list, *, solo: bool = False) -> Vote:
    hist = {r.peer_id: history(others, r.peer_id) for r in others}
    voters = [r for r in others if r.address]
    if any(hist[r.peer_id] > 0 for r in voters):
        voters = [r for r in voters if hist[r.peer_id] > 0]  # identities nobody vouches for do not vote
    if not voters:
        return Vote(None, None, hist)
    # One address, one vote (however many identities announce it); ties go to the longer history.
    per_state: dict = {}
    addresses: set = set()
    for r in voters:
        a, s = _address_key(r.address), (r.round, r.weights_digest)
        addrs = per_state.setdefault(s, {})
        addrs[a] = max(addrs.get(a, 0), hist[r.peer_id])
        addresses.add(a)
    total = len(addresses)
    (rnd, dig), addrs = max(per_state.items(), key=lambda kv: (len(kv[1]), sum(kv[1].values()), kv[0][0], kv[0][1]))
    mode = "fresh"
    if not (2 * len(addrs) > total or total == 1):
        if not solo:
            return Vote(None, None, hist)
        # A peer that trained alone: no majority, so the most addresses, then the latest round (then the
        # longer history, the digest), the same order on every such peer, so lineages trained alone merge
        # (each one behind moves to the front one) instead of each keeping its own.
        (rnd, dig), addrs = max(per_state.items(), key=lambda kv: (len(kv[1]), kv[0][0], sum(kv[1].values()), kv[0][1]))
        mode = "solo"
    donors = list(dict.fromkeys(r.address for r in voters if (r.round, r.weights_digest) == (rnd, dig)))
    return Vote(StateChoice(rnd, dig, donors, len(addrs), total, mode), None, hist)


def choose_state(records: Iterable, *, me: Optional[str], standing: Optional[Standing], trained: bool = False) -> Vote:
    """The (round, digest) this node should be at, by the records of the *other* peers (those with a digest).

    ``standing``: this node's ledger; ``trained``: it trained in this session. The standing vote is
    used when the ledger knows another peer (:meth:`Standing.knows_others`) and (this node trained, or
    some peer in view has standing); a peer whose ledger credits only itself (it trained alone) uses
    the fresh vote, with the "solo" order when no state has a majority; else the fresh vote. See the
    module doc. ``Vote.refusal`` is set when most identities announce a state the standing vote does
    not back.
    """
    others = [r for r in records if r.weights_digest and r.peer_id != me]
    if not others:
        return Vote(None)
    if (
        standing is not None
        and standing.knows_others(me)
        and (trained or any(standing.weight(r.peer_id) > 0 for r in others))
    ):
        return _standing_vote(others, standing)
    return _fresh_vote(others, solo=standing is not None and standing.known)


class _Attested:
    """A ledger read from a record's attestations (``PeerRecord.standing``): ``weight(peer)`` is what the
    record attests for ``peer`` (bounded by the window). For :func:`would_adopt` only."""

    def __init__(self, attested: dict):
        self._att = attested

    def weight(self, peer_id: str) -> int:
        return min(int(self._att.get(attest_key(peer_id), 0)), DEFAULT_WINDOW)


def would_adopt(voter, records: Iterable, round: int, digest: str) -> bool:
    """Whether the peer of record ``voter`` would probably adopt the state (``round``, ``digest``) announced
    among ``records`` (the records it sees: those of the other peers; ``voter``'s own is skipped).

    Read from its record: its attestations are the highest standings of its ledger, so its standing vote
    is :func:`choose_state`'s, weighted by them; a record that attests none of the others (a fresh peer,
    or one that saw none of them deliver) is taken to run the fresh vote. An estimate (a ledger holds more
    than the 16 peers a record attests, and whether the voter trained is not in its record): the driver's
    catch-up uses it to tell whether peers at an older round can come up to this peer's newer state, or
    whether only going back rejoins them (docs/round.md, "Never back to an older round")."""
    others = [r for r in records if r.weights_digest and r.peer_id != voter.peer_id]
    if not others:
        return False
    ledger = _Attested(getattr(voter, "standing", None) or {})
    if any(ledger.weight(r.peer_id) > 0 for r in others):
        vote = _standing_vote(others, ledger)  # type: ignore[arg-type]  # duck-typed: weight() only
    else:
        vote = _fresh_vote(others)
    return vote.choice is not None and (vote.choice.round, vote.choice.digest) == (round, digest)


class OnceLog(LogOnce):
    """Logs each message key once (bounded), so a vote polled every 0.2 s logs a refusal one time.

    :class:`geomesh_p2p.telemetry.logonce.LogOnce` on this module's logger; call ``(key, level, msg, *args)``."""

    def __init__(self, capacity: int = 1024):
        super().__init__(log, capacity)
