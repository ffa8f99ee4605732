"""Penalties of the round rules (:class:`Penalties`): owners whose part had no valid result own no part for
``OWNER_PENALTY_ROUNDS`` rounds, participants that contributed to no part are not planned (nor leader
candidates) for ``probation.noshow_penalty_rounds`` rounds, and this peer's own failures, taken on by
itself so that its plans and checks agree with the others'. Every no-show is also marked late
(``probation.LATE_MARK_ROUNDS`` rounds planned at a smaller rate, :meth:`Penalties.late_ceilings`, and no leader
candidate); one that delivered the round before and was not marked stays planned instead of benched, on probation or
not (an honest peer whose pushes came after the parts closed gets less work, not a bench). A round that aggregated no token anywhere
concludes nothing (:func:`conclusive`): under overload every peer's view of it differs, and marks taken from
those views split the swarm (issue 25, 32 processes on 2 cores).
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from typing import Collection, Iterable, Optional

from geomesh_p2p.plan.bounds import LateCeilings, late_ceiling, usable_rates
from geomesh_p2p.round.rules.state import RoundState
from geomesh_p2p.schema.peer import MAX_OWNER_BARS, MAX_UNLED_MARKS
from geomesh_p2p.trust import probation as pb

# Round log lines keep the node's logger name: operators' filters and the tests' caplog select on it.
log = logging.getLogger("geomesh_p2p.node.peer.round")

__all__ = ["Penalties", "OWNER_PENALTY_ROUNDS", "MARK_SPAN_ROUNDS", "conclusive"]

#: Rounds during which a peer owns no part after a part it owned had no valid result (owner gone, or a
#: result every reader refused, e.g. below the quorum). All honest peers saw the same missing part, so
#: honest leaders agree; the peer still contributes, it only stops deciding a range.
OWNER_PENALTY_ROUNDS = 5

#: Rounds back a mark can reach: one taken from round m's results is in force up to round m + this (the longest bench,
#: a probation no-show's, then ``LATE_MARK_ROUNDS`` of late mark; an owner penalty is shorter). A peer holds every mark
#: of round r only when it applied every one of the rounds r - MARK_SPAN_ROUNDS .. r - 1 (:meth:`Penalties.holds`).
MARK_SPAN_ROUNDS = max(OWNER_PENALTY_ROUNDS, pb.PROBATION_NOSHOW_PENALTY_ROUNDS + pb.LATE_MARK_ROUNDS)

#: Restored from a checkpoint: at most this many penalties of each kind, of ids at most this long (a base58
#: PeerID is ~44-46 characters)
MAX_RESTORED = 4096
MAX_ID_CHARS = 64


def conclusive(ar) -> bool:
    """Whether round result ``ar`` (an :class:`~geomesh_p2p.exchange.client.AllReduceResult`) can tell who
    failed: some part aggregated at least one token. A round that changed nothing (every part missing, or
    every contribution of 0 tokens: nobody trained in time) is the swarm's failure, not a peer's. Seen at 32
    processes on 2 cores: round 0's exchange closed with 19 of 30 parts below their quorum and 0 tokens in
    the others; each peer marked as no-shows and failed owners whatever its own pulls missed, those marks
    differed between peers, their leader candidates and accepted plans differed, and from round 1 two
    lineages trained side by side. With no token applied, every peer's weights are unchanged and equal, so
    concluding nothing keeps their rules equal too."""
    return any(int(n) > 0 for part in (getattr(ar, "contributors", None) or {}).values() for _, n in part)


class Penalties:
    """Owner and no-show penalties and late marks this peer holds (peer id -> last round of the penalty).

    Args:
        state: this peer's :class:`RoundState` (``me``, ``round``).
        owner: initial owner penalties (peer id -> last round it owns no part).
        noshow: initial no-show penalties (peer id -> last round it is not planned).

    Attributes:
        late: peer id -> (last round of its late mark, its tokens/s ceiling meanwhile: :meth:`late_ceilings`).
        applied: (first, last) round of the unbroken run of rounds whose part results this peer applied
            (:meth:`note_applied`): it holds every mark those rounds gave, on anyone; None: none yet (a peer that
            joined, or restarted without ``--resume``, at a round past 0).
        own_known: (first, last) round of the unbroken run of rounds in which this peer knows the marks the others
            took on it (:meth:`note_own_known`: the rounds it applied, and those it saw the plan of and sat out).
        owners_known: (first, last) round of the unbroken run of rounds whose owner penalties this peer holds: the
            rounds it applied, and those a majority of its voters' records vouched for (:meth:`take_owner_bars`:
            a round it was planned out of, session 51).
    """

    def __init__(self, state: RoundState, owner: dict[str, int] | None = None, noshow: dict[str, int] | None = None):
        self.state = state
        self.owner: dict[str, int] = dict(owner or {})
        self.noshow: dict[str, int] = dict(noshow or {})
        self.late: dict[str, tuple[int, float]] = {}
        #: (penalty kind "owner" | "noshow" | "late", peer id) -> the round in which this peer noted that penalty
        self.noted: dict[tuple[str, str], int] = {}
        self.applied: Optional[tuple[int, int]] = None
        self.own_known: Optional[tuple[int, int]] = None
        self.owners_known: Optional[tuple[int, int]] = None

    def held_since(self, first: int) -> None:
        """Declare that this peer applied every round from ``first`` to the one before ``state.round`` (a test's
        rules built at a round; ``--resume`` of a checkpoint written before session 50: :meth:`restore`)."""
        last = self.state.round - 1
        self.applied = self.own_known = self.owners_known = (first, last) if 0 <= first <= last else None

    def note_applied(self, round: int) -> None:
        """This peer applied round ``round``'s part results (``after_exchange``, conclusive or not): it took every
        mark they give, on anyone. A round not noted (planned out, sat out, stalled, before it joined) breaks the
        run: the marks the others took then are unknown here."""
        self.applied = _extended(self.applied, round)
        self.owners_known = _extended(self.owners_known, round)
        self.note_own_known(round)

    def note_own_known(self, round: int) -> None:
        """This peer knows what the others marked on it in round ``round``: it applied it, or saw its plan and sat
        it out (not named: no mark; named: :meth:`note_sat_out`), or was stalled through it (its failures)."""
        self.own_known = _extended(self.own_known, round)

    def holds(self, round: int, span: int = MARK_SPAN_ROUNDS, own: bool = False) -> bool:
        """Whether this peer holds, at ``round``, every mark taken in the ``span`` rounds before it (``own``: those on
        itself only): it applied (``own``: knows its own marks of) each of rounds ``round - span`` .. ``round - 1``
        (none before round 0). Marks older than ``MARK_SPAN_ROUNDS`` have ended everywhere."""
        return _covers(self.own_known if own else self.applied, round, span)

    def holds_owners(self, round: int) -> bool:
        """Whether this peer holds, at ``round``, every owner penalty in force (taken in the ``OWNER_PENALTY_ROUNDS``
        rounds before it): it applied each of them, or took those it did not apply by its voters
        (:meth:`take_owner_bars`). ``applied`` too: a run set by hand (tests, :meth:`held_since`) is one."""
        return _covers(self.owners_known, round, OWNER_PENALTY_ROUNDS) or self.holds(round, OWNER_PENALTY_ROUNDS)

    def owner_bars(self) -> Optional[dict[str, int]]:
        """The owner penalties in force this round (PeerID -> last round it owns no part, this peer's own included)
        when it holds every one (:meth:`holds_owners`), for its record (``PeerRecord.owner_bars``: what a peer
        planned out of one of those rounds takes, :meth:`take_owner_bars`); None when it does not, or holds more
        than a record carries (``MAX_OWNER_BARS``: then nobody votes with its record)."""
        r = self.state.round
        if not self.holds_owners(r) or self._concluded_round(r):
            return None
        # concluded in rounds r-5..r-1 only: round r's own conclusions (its exchange done, the record still at round r)
        # are not yet the others' at round r, and two spellings of one round's map would split the vote
        bars = {p: until for p, until in self.owner.items() if r <= until < r + OWNER_PENALTY_ROUNDS}
        return bars if len(bars) <= MAX_OWNER_BARS else None

    def _concluded_round(self, r: int) -> bool:
        """Whether this peer already concluded round ``r`` (applied it, or took a bar ending past ``r + 4``: its
        exchange done or stalled through, the record still at round ``r`` until the commit). A bar renewed in round
        ``r`` then ends in ``r + 5``, outside the span :meth:`owner_bars` names, so its map would lack a bar the others
        still hold at round ``r``: it names none rather than that map (red team 51a: a taker that read such maps gave
        the barred owner a part, and the holders refused its plan)."""
        ran = any(run is not None and run[1] >= r for run in (self.applied, self.owners_known))
        return ran or any(until >= r + OWNER_PENALTY_ROUNDS for until in self.owner.values())

    def take_owner_bars(self, records: Iterable, voters: Collection[str]) -> Optional[str]:
        """Take the owner penalties in force this round from ``voters``' ``records`` (PeerRecords; the voters: this
        peer's leader candidates, itself left out) when this peer does not hold them all (:meth:`holds_owners`: it was
        planned out of, or sat out, one of the last ``OWNER_PENALTY_ROUNDS`` rounds, whose part results it never read).
        Counted: the voters' records at this round and digest (a state made by the same rounds: their holders hold the
        same owner penalties); taken: a map (``PeerRecord.owner_bars``) that more than half of all ``voters`` name (one
        at another round or state, or still syncing, counts against: the peers a rogue leader planned out were still
        syncing, so a denominator of those at this round let 2 rogues of 6 outvote 1 holder, red team 51a), merged into
        ``owner`` (this peer's own entry excepted: it knows its own marks) and those rounds' owner penalties held from
        then on (``owners_known``). Returns one line for the log when taken, else None.

        Why (red team 50, session 51): a peer planned out of round r lacked r's owner penalties and led nothing in
        rounds r+1..r+5, so a rogue leader that planned out the peers ranked ahead of it kept the lead with a third of
        the plan-outs. A failed owner is a missing part result, which no signed message proves absent, so the holders'
        word is taken, as a majority (one record one vote; each record is signed by its peer): a minority of rogue
        voters takes nothing and leaves the gap as before. The candidates of every view are unchanged (an owner
        penalty bars no leader); what changes is that this peer's plans and checks bar the owners the holders bar.
        Honest holders of one state name one map, so a map other than theirs is taken only where rogue records are
        more than half of the voters (all of them count, those naming none too: a rogue leader chooses who took part
        in round r, not who its voters are); this peer's plans and checks then differ from the holders' as a blind
        follower's did before."""
        r, me, digest = self.state.round, self.state.me, self.state.digest
        if r <= 0 or not digest or self.holds_owners(r):
            return None
        who = set(voters) - {me}
        at = [x for x in records if x.peer_id in who and x.round == r and x.weights_digest == digest]
        named = Counter(_bars_key(x.owner_bars) for x in at if isinstance(getattr(x, "owner_bars", None), dict))
        if not named:
            return None
        top, votes = named.most_common(1)[0]
        if votes * 2 <= len(who):  # every voter counts, not only those at this round and state (red team 51a)
            return None
        bars = {p: u for p, u in json.loads(top).items() if p != me and r <= u < r + OWNER_PENALTY_ROUNDS}
        for p, until in bars.items():
            if until > self.owner.get(p, -1):
                self.owner[p] = until
                self.noted[("owner", p)] = until - OWNER_PENALTY_ROUNDS  # the round that concluded it, as if applied
        self.owners_known = _joined(self.owners_known, max(0, r - OWNER_PENALTY_ROUNDS), r - 1)
        return (
            f"{votes} of {len(who)} voters ({len(at)} at this round and state) name the owner penalties in force "
            f"({len(bars)} on others): taken for rounds {max(0, r - OWNER_PENALTY_ROUNDS)}-{r - 1}"
        )

    def shared_bars(self, peers: Collection[str], records: Iterable, voters: Collection[str], leader: str) -> tuple:
        """Of ``peers`` (owners a leader's plan of this round gives a part, under an owner penalty this peer holds),
        those whose bar the swarm shares: the leader's own record names it (``PeerRecord.owner_bars``, in force this
        round: it broke a bar it holds), or more than half of ``voters`` (this peer's leader candidates, this peer
        counted too, as a holder) do. Returns (the shared ones, "k of n voters" per peer of ``peers``).

        Why (fresh user 52): p1 restarted first and ran round 27 with p2 before p2 was ready; p2's part had no result
        in p1's view only (p2 and p3 synced past the round), and p1 refused the plans of rounds 29-32, each giving p2
        a part, while p2 and p3 followed them: 4 rounds sat out for a bar nobody else held. As for verified work's lone
        verdicts (``Verdicts.plan_problem``), a bar held alone takes effect through this peer's own plans only
        (:meth:`without_parts`); a shared one still refuses, so a rogue minority that leaves a bar out of its records
        cannot get a failed owner a part past the honest holders. Records at another round count as they name the bar
        (a stale one against it): honest peers in the plan announced this round before the leader planned them."""
        r, me = self.state.round, self.state.me
        who = set(voters) | ({me} if me is not None else set())
        recs = {x.peer_id: x for x in records}

        def names(x, p: str) -> bool:
            bars = getattr(x, "owner_bars", None)
            return isinstance(bars, dict) and bars.get(p, -1) >= r

        shared, tally = [], {}
        for p in peers:
            votes = 1 + sum(1 for v in who - {me} if v in recs and names(recs[v], p))
            tally[p] = f"{votes} of {len(who)} voters"
            if (leader != me and leader in recs and names(recs[leader], p)) or votes * 2 > len(who):
                shared.append(p)
        return shared, tally

    def lead_gap(self, round: int) -> Optional[str]:
        """Why this peer must not lead ``round`` from the marks it holds (None: it may): it does not know the marks
        the others may hold on it (up to ``MARK_SPAN_ROUNDS`` back: they refuse a benched leader's plan,
        and a late-marked leader's plan would escape the ceiling they hold it to), or every owner penalty on the others (``OWNER_PENALTY_ROUNDS`` back: they refuse a part given to a
        barred owner). Other marks it lacks change only whom it plans how much, which followers accept (session 50:
        k2, restarted without its history, led round 7 of the e2e killed-peer run and followed its own plan)."""
        if not self.holds(round, own=True):
            return (
                f"it knows the marks the others took on it in {_span(self.own_known)}, not in each of "
                f"rounds {max(0, round - MARK_SPAN_ROUNDS)}-{round - 1}"
            )
        if not self.holds_owners(round):
            return (
                f"it applied {_span(self.applied)}, not each of rounds "
                f"{max(0, round - OWNER_PENALTY_ROUNDS)}-{round - 1} (owner penalties)"
            )
        return None

    def lead_from(self, round: int) -> Optional[int]:
        """The first round at which :meth:`lead_gap` lets this peer lead again if it applies each round from ``round``
        on (None: no gap at ``round``), announced in its record (``PeerRecord.lead_from``) so that the others do not
        wait a whole take-over delay for its plan (fresh user 51: ranked first everywhere but here, it cost 4-8 s a
        round for up to 18 rounds after a restart, re-sync or join). Exact over the runs: a run that reaches round
        ``round - 1`` goes on from its first round, any other starts anew at ``round``; the own marks need
        ``MARK_SPAN_ROUNDS`` rounds of it, the owner penalties ``OWNER_PENALTY_ROUNDS`` (``owners_known`` or
        ``applied``). A lower bound of the gap's end: a round missed later moves it on (the next record says so);
        only the owner penalties taken from the voters (:meth:`take_owner_bars`) can end it sooner, and then this
        peer publishes beside the next candidate, whose plan ranks worse and is not followed."""
        own = _free_from(self.own_known, round, MARK_SPAN_ROUNDS)
        owners = min(
            _free_from(self.owners_known, round, OWNER_PENALTY_ROUNDS),
            _free_from(self.applied, round, OWNER_PENALTY_ROUNDS),
        )
        end = max(own, owners)
        return end if end > round else None

    def follower_late(self, round: int, participants, supported) -> dict[str, float]:
        """The late ceilings this peer checks a plan of ``round`` with (``late`` of
        :func:`~geomesh_p2p.plan.planner.check_plan`): :meth:`late_ceilings` when it :meth:`holds` every mark that
        can be in force. Else (session 50: joined, restarted, re-synced or planned out within ``MARK_SPAN_ROUNDS``)
        a :class:`~geomesh_p2p.plan.bounds.LateCeilings` that no honest leader's plan falls under: a participant with
        a delivered rate ``d`` of round ``round - 1`` (``supported``) at ``min(d, its ceiling held)``, the others
        ``blind`` (no low end). Why ``d``: a leader holding the marks plans it at ``min(EVIDENCE_GROWTH x d, its
        ceiling)``; its ceiling is no lower than the rate round ``round - 1``'s plan gave it (a mark ceilings at the
        plan of its miss, and a miss since would have left it out of ``supported``), which is at least ``d``. A peer
        back from a bench or new has no ``d``, and its ceiling may be any; the high end is untouched, so such a
        follower never accepts more work for anyone."""
        marks = self.late_ceilings()
        if self.holds(round):
            return marks
        rates = usable_rates(supported)
        caps = {p: c for p, c in marks.items() if c > 0}
        caps.update({p: min(d, caps.get(p, d)) for p, d in rates.items()})
        return LateCeilings(caps, [p for p in participants if p not in rates])

    def to_meta(self) -> dict:
        """The penalties as JSON-able data for the checkpoint's meta: ``{"owner": {peer id: last round},
        "noshow": {peer id: last round}, "late": {peer id: [last round, tokens/s]}}``."""
        return {
            "owner": dict(self.owner),
            "noshow": dict(self.noshow),
            "late": {p: list(m) for p, m in self.late.items()},
            # the rounds whose marks it holds (session 50): a resumed peer leads and checks plans as before its stop
            "applied": list(self.applied) if self.applied else None,
            "own_known": list(self.own_known) if self.own_known else None,
            "owners_known": list(self.owners_known) if self.owners_known else None,
        }

    def restore(self, meta) -> None:
        """Take the penalties of :meth:`to_meta` (``--resume``; ``state.round`` is the checkpoint's round); malformed
        entries are dropped (a checkpoint is this peer's own file, but an edited one must not end the node), and so
        are marks on this peer itself that end later than the longest penalty would from that round."""
        if not isinstance(meta, dict):
            return
        # This peer's marks on itself are the others' marks on it, which they restore too: dropped, it led plans
        # they refused until those ended. Kept within the longest penalty from the checkpoint's round only (an
        # edited file barred it for ever, silently: red team, session 13).
        own_max = {"owner": OWNER_PENALTY_ROUNDS, "noshow": max(pb.noshow_penalty_rounds(x) for x in (False, True))}
        for kind in ("owner", "noshow"):
            got = meta.get(kind)
            if isinstance(got, dict):
                ok = self._restorable(got, lambda r: type(r) is int, lambda r: r, own_max[kind])
                getattr(self, kind).update(ok)
        got = meta.get("late")
        if isinstance(got, dict):
            # this peer's own mark as its bench and owner marks above: the others restore theirs on it
            marks = self._restorable(got, _mark_ok, lambda m: m[0], MARK_SPAN_ROUNDS)
            self.late.update((p, (int(m[0]), float(m[1]))) for p, m in marks)
        if "applied" not in meta:  # written before session 50: it held every mark then, as far as it can tell
            self.held_since(0)
            return
        # the runs end at the checkpoint's round at the latest (an edited file cannot make a round it never saw its own)
        runs = {k: _run_ok(meta.get(k), self.state.round) for k in ("applied", "own_known", "owners_known")}
        bad = [k for k, v in runs.items() if v is None and meta.get(k) is not None]
        if bad:  # an edited or damaged file: said, not silent (red team 50: it cost 18 rounds of no leading unsaid)
            log.warning(
                "checkpoint: its %s dropped (not [first, last] integers with 0 <= first <= last < %d, the "
                "checkpoint's round): taken as no round, so this peer leads only once it holds the marks again",
                " and ".join(f"{k!r} run of rounds {str(meta.get(k))[:40]}" for k in bad),
                self.state.round,
            )
        self.applied = runs["applied"]
        # every round applied is one whose own marks are known (note_applied): a dropped or shorter own_known run
        # takes the applied one (red team 50: a damaged own_known alone cost 18 rounds the file still showed)
        self.own_known = _covering(runs["own_known"], self.applied)
        self.owners_known = _covering(runs["owners_known"], self.applied)  # the same rule: every applied round is one

    def _restorable(self, got: dict, valid, until_of, own_span: int) -> list:
        """The ``(peer id, value)`` items of a restored penalty map ``got`` that may be taken: ids of PeerID length,
        ``valid(value)``, this peer's own only while ``until_of(value)`` (its last round) is at most ``own_span``
        rounds past the checkpoint's round; at most ``MAX_RESTORED`` of them (the penalties of one swarm)."""
        me, r = self.state.me, self.state.round
        ok = [
            (p, v)
            for p, v in got.items()
            if isinstance(p, str)
            and 0 < len(p) <= MAX_ID_CHARS
            and valid(v)
            and (p != me or until_of(v) <= r + own_span)
        ]
        return ok[:MAX_RESTORED]

    def noshows(self) -> dict[str, int]:
        """Peers under a no-show penalty this round (peer id -> last round of it); expired ones dropped."""
        pen = self.noshow
        for p in [p for p, until in pen.items() if until < self.state.round]:
            del pen[p]
        return pen

    def late_marks(self) -> dict[str, tuple[int, float]]:
        """Late marks in force this round (peer id -> (last round, tokens/s ceiling)); expired ones dropped."""
        for p in [p for p, (until, _) in self.late.items() if until < self.state.round]:
            del self.late[p]
        return self.late

    def late_ceilings(self) -> dict[str, float]:
        """peer id -> the most tokens/s a plan of this round gives it (:func:`~geomesh_p2p.plan.bounds.late_ceiling`),
        for the peers marked late: the leader plans them within it and followers accept budgets that low
        (``late`` of :func:`~geomesh_p2p.plan.planner.check_plan`)."""
        return {p: c for p, (_, c) in self.late_marks().items()}

    def unled(self) -> set[str]:
        """Peers that are no leader candidates this round: no-shows and peers marked late (a late peer must not plan
        its own budget: followers accept it at the newcomer seed, over its late ceiling)."""
        return set(self.noshows()) | set(self.late_marks())

    def own_unled_until(self) -> Optional[int]:
        """The last round through which this peer is no leader candidate by the marks it holds on itself (a no-show
        bench or a late mark, which the others hold on it too: :meth:`note_own_failures`, :meth:`note_sat_out`), or
        None when none is in force. Announced in its record (``PeerRecord.unled_until``) for :meth:`announced_unled`."""
        me = self.state.me
        if me is None:
            return None
        ends = [self.late_marks()[me][0]] if me in self.late_marks() else []
        ends += [self.noshows()[me]] if me in self.noshows() else []
        return max(ends, default=None)

    def announced_unled(self, records) -> set[str]:
        """Peers of ``records`` (PeerRecords) that announce themselves no leader candidate this round
        (``unled_until`` at or past it: :meth:`own_unled_until`), taken only while this peer does not :meth:`hold` the
        marks of the round; empty when it does. Session 50 (e2e slow-link joiner): a joiner holding no mark counted a
        late-marked participant of the last round as a candidate, so ``round.planning.last_round_leaders`` gave it an
        earlier level than the peers holding the mark, and it refused as content the last round's leader succeeding
        itself, which they followed (8 rounds without training). A peer's word on itself only (its record is signed
        by it): a rogue can bar nobody else from leading this way; and a claim, taken only where a majority of the
        voters back it (:meth:`backed_unled`, red team 50b: the word alone moved a joiner's level off the holders'). The
        holders never take it (a record rewritten
        between two holders' reads would give them two levels)."""
        r, me = self.state.round, self.state.me
        if self.holds(r):
            return set()
        return {
            x.peer_id
            for x in records
            if x.peer_id != me and type(getattr(x, "unled_until", None)) is int and x.unled_until >= r
        }

    def unled_marks(self) -> Optional[dict[str, int]]:
        """The leader marks in force this round that this peer holds on the others (PeerID -> last round it is no leader
        candidate: the later end of its no-show bench and late mark), for its record (``PeerRecord.unled_marks``: what
        backs a peer's own ``unled_until`` for a follower without the history, :meth:`backed_unled`). None when there
        is none, when this peer does not :meth:`hold` the marks of the round, when it already concluded its own round
        (its record still at that round until the commit would name marks of the next one, as
        :meth:`_concluded_round` for the owner penalties) or holds more than a record carries (``MAX_UNLED_MARKS``)."""
        r, me = self.state.round, self.state.me
        if not self.holds(r) or (self.applied is not None and self.applied[1] >= r):
            return None
        marks = {p: until for p, until in self.noshows().items() if p != me}
        for p, (until, _) in self.late_marks().items():
            if p != me:
                marks[p] = max(until, marks.get(p, until))
        return marks if 0 < len(marks) <= MAX_UNLED_MARKS else None

    def backed_unled(self, records, voters: Collection[str]) -> set[str]:
        """The peers of :meth:`announced_unled` (``records``: PeerRecords, one a peer) whose own mark a majority of
        ``voters`` (this peer's leader candidates before any announced mark, itself left out) back: more than half of
        all of them have a record at this round that names it in force, the claimant's own ``unled_until`` or another
        voter's ``unled_marks`` (:meth:`unled_marks`). A voter not at this round, or naming nothing, counts against.
        Empty when this peer holds the marks (it goes by its own).

        Why (red team 50b, session 52): a claim on oneself only shrinks the candidates, yet it moves a joiner's level
        (``round.planning.last_round_leaders``) to a later one than the holders': a rogue X, the holders' only
        first-level candidate, announced a mark nobody held; the joiner dropped X, took the level with round r - 1's
        leader L, and followed no plan (L honest: it knows it may not lead) or L's self-succession (L colluding) while
        the holders followed X's: two plans in one round. The claimant's word alone is one vote; an honest mark is
        held by every holder, so where honest holders are most of the voters it is taken as before."""
        told = self.announced_unled(records)
        if not told:
            return set()
        r = self.state.round
        who = set(voters) - {self.state.me}
        at = {x.peer_id: x for x in records if x.peer_id in who and x.round == r}
        backed = set()
        for p in told:
            votes = 0
            for v, x in at.items():
                if v == p:
                    votes += type(getattr(x, "unled_until", None)) is int and x.unled_until >= r
                else:
                    marks = getattr(x, "unled_marks", None)
                    until = marks.get(p) if isinstance(marks, dict) else None
                    votes += type(until) is int and until >= r
            if votes * 2 > len(who):
                backed.add(p)
        return backed

    def barred(self) -> list[str]:
        """Peers under an owner penalty this round."""
        return [p for p, until in self.owner.items() if until >= self.state.round]

    def note_sat_out(self, plan, delivered_before: Optional[Collection[str]] = None) -> None:
        """This peer sits round ``plan.round`` out although ``plan`` names it (it refuses the plan the others may
        follow, or its weights differ from the plan's): at every peer that runs ``plan`` the parts it gives this
        peer have no result and this peer contributes to no part, so they bar it from owning
        (:meth:`note_failed_owners`) and mark it a no-show (:meth:`note_no_shows`). It takes the same marks on
        itself, as a peer stalled through a round does (:meth:`note_own_failures` ``stalled``). Before, a peer
        that refused a plan noted nothing on itself: at its first turn as leader, ``OWNER_PENALTY_ROUNDS`` rounds
        later, it gave itself a part the others barred through that round, they refused its plan, their own parts
        failed, and the cycle fed itself every 5 rounds (fresh-user trial, session 49: rounds 58, 63, 68, 73; one
        peer trained 8 of rounds 63-74 alone). The driver calls it after its re-sync, when the state moved past
        ``plan``'s start: a round that applied nothing concludes nothing at the others (:func:`conclusive`)."""
        me = self.state.me
        if me is None or me not in plan.participants():
            return
        concluded = _SatOut(plan.round, [pid for pid, _, _ in plan.owners()], me)
        # delivered_before: the others grace a late peer that delivered the round before; so must it (session 49)
        self.note_own_failures(concluded, plan, concluded, stalled=True, delivered_before=delivered_before)

    def forget_marks_since(self, round: int) -> list[str]:
        """Drop the owner and no-show penalties this peer noted in round ``round`` or later (the driver calls it
        after a re-sync to a state this peer did not make: those rounds were of a lineage the swarm never
        confirmed, e.g. every part failed while this peer itself was stalled). A penalty noted earlier and
        renewed in such a round goes too (the renewal replaced it). This peer's penalties on itself are not
        noted here: they are the others' view of its own failures, which they keep. Returns the peer ids whose
        marks went."""
        noted = self.noted
        gone = [(kind, pid) for (kind, pid), r in noted.items() if r >= round]
        pens: dict[str, dict] = {"owner": self.owner, "noshow": self.noshows(), "late": self.late}
        for kind, pid in gone:
            pens[kind].pop(pid, None)
            del noted[(kind, pid)]
        # the swarm's rounds from ``round`` on are not the ones this peer applied: their marks are unknown here. Its own
        # marks of rounds it only saw the plan of (planned out, sat out: the driver notes them before this re-sync) or
        # was stalled through stay known, as the marks themselves stay (a cut there cost 18 rounds of no leading
        # after every planned-out round: the e2e killed-peer run's re-sync). Where it applied a round from ``round`` on,
        # every round seen since ``round`` goes: a plan it was planned out of after such a round was its lineage's, not
        # the swarm's (red team 50: applied 25-29 on a minority side, planned out of 30 there, applied 31: the cut
        # from 31 only kept 25-30 known, and it led at round 36 while the swarm's late mark of its absence held)
        run = self.applied
        if run is not None and run[1] >= round:
            self.own_known = _cut(self.own_known, round)
        self.applied = _cut(run, round)
        self.owners_known = _cut(self.owners_known, round)  # the owner penalties noted since went above
        return sorted({pid for _, pid in gone})

    def note_own_failures(
        self, spec, plan, ar, *, stalled: bool = False, delivered_before: Optional[Collection[str]] = None
    ) -> None:
        """Penalties the other peers give this peer for round ``plan.round``, taken on by itself so that its
        plans and checks agree with theirs (one INFO line each when it starts):

        * its own parts with no valid result: every other peer bars it from owning for
          ``OWNER_PENALTY_ROUNDS`` rounds (:meth:`note_failed_owners`); barred in its own view too, it
          plans itself client-only and accepts their plans that give it no part (planner.check_plan);
        * a participant in no part's contributors (``stalled``: it pushed nothing in time, whatever its own
          view of the parts): they mark it a no-show (:meth:`note_no_shows`), refuse its plans and do not
          plan it; marked in its own view too, it does not lead meanwhile (leader_candidates' ``barred``); or, late
          but in ``delivered_before`` and not marked late (:meth:`note_no_shows`), only marked late.

        The driver calls it alone (``stalled=True``) for a round this peer was stalled through: its view
        of the others is void then, its own failures are real for everyone. Otherwise nothing is taken on
        from a round that aggregated no token (:func:`conclusive`): the others conclude nothing from it."""
        if not stalled and not conclusive(ar):
            return
        me = self.state.me
        self._note_own_no_show(plan, ar, stalled, delivered_before)
        for j in ar.missing_parts:
            if _owner_of(spec, ar, j) != me:  # a grouped round's parts are its cross level's (their leaders own them)
                continue
            if me not in self.owner:
                log.info(
                    "round %d: this peer's own part %d had no valid result; the others bar it from owning a "
                    "part for the next %d rounds, and so does it",
                    spec.round,
                    j,
                    OWNER_PENALTY_ROUNDS,
                )
            self.owner[me] = spec.round + OWNER_PENALTY_ROUNDS

    def _note_own_no_show(self, plan, ar, stalled: bool, delivered_before: Optional[Collection[str]]) -> None:
        """:meth:`note_own_failures`' no-show half."""
        me = self.state.me
        if me is None or me not in plan.participants():
            return
        if not stalled and me not in pb.absent_participants(plan.participants(), ar.contributors):
            return
        pen = self.noshows()
        if self._mark_late(plan, me, pen, delivered_before):
            log.info(
                "round %d: this peer contributed to no part the others applied (late); they plan it with less work "
                "and not as a leader for the next %d rounds, and so does it",
                plan.round,
                pb.LATE_MARK_ROUNDS,
            )
            return
        rounds = pb.noshow_penalty_rounds(me in set(plan.probation()))
        if me not in pen:
            log.info(
                "round %d: this peer contributed to no part the others applied; they do not plan it nor "
                "follow its plans for the next %d rounds, so it does not lead meanwhile",
                plan.round,
                rounds,
            )
        pen[me] = plan.round + rounds

    def note_failed_owners(self, spec, ar) -> None:
        """Owners of parts with no valid result this round own no part for ``OWNER_PENALTY_ROUNDS`` rounds
        (this peer's own parts: :meth:`note_own_failures`). Nothing from a round that aggregated no token
        (:func:`conclusive`)."""
        if not conclusive(ar):
            return
        for j in ar.missing_parts:
            pid = _owner_of(spec, ar, j)
            if pid == self.state.me:
                continue
            if pid not in self.owner:
                log.warning(
                    "round %d: part %d of %s had no valid result; it owns no part for the next %d rounds",
                    spec.round,
                    j,
                    pid[:10],
                    OWNER_PENALTY_ROUNDS,
                )
            self.owner[pid] = spec.round + OWNER_PENALTY_ROUNDS
            self.noted[("owner", pid)] = spec.round

    def note_no_shows(self, plan, ar, delivered_before: Optional[Collection[str]] = None) -> None:
        """Participants of ``plan`` in no aggregate this node applied are marked late for ``probation.
        LATE_MARK_ROUNDS`` rounds (:meth:`late_ceilings`; no leader candidates meanwhile) and, unless graced, not
        planned for ``probation.noshow_penalty_rounds`` rounds. Graced (planned, with the late ceiling): a
        participant, on probation or not (session 50), in ``delivered_before`` (the peers that delivered in round ``plan.round - 1``,
        :meth:`~geomesh_p2p.round.rules.planning.PlanRules.delivered_evidence`) that holds no late mark nor bench.
        Every honest peer applied the same plans and aggregates, so honest leaders agree. Nothing is concluded
        when no part had a result, nor when no part aggregated a token (:func:`conclusive`)."""
        if not conclusive(ar):
            return
        pen = self.noshows()
        marked = set(plan.probation())
        for pid in pb.absent_participants(plan.participants(), ar.contributors):
            if pid == self.state.me:
                continue
            if self._mark_late(plan, pid, pen, delivered_before):
                log.warning(
                    "round %d: %s was planned and contributed to no part (late: its pushes came after the parts "
                    "closed, or none came); planned with less work and not as a leader for the next %d rounds",
                    plan.round,
                    pid[:10],
                    pb.LATE_MARK_ROUNDS,
                )
                continue
            rounds = pb.noshow_penalty_rounds(pid in marked)
            if pid not in pen:
                log.log(
                    logging.INFO if pid in marked else logging.WARNING,
                    "round %d: %s%s was planned and contributed to no part; not planned for the next %d rounds",
                    plan.round,
                    pid[:10],
                    " (on probation)" if pid in marked else "",
                    rounds,
                )
            pen[pid] = plan.round + rounds
            self.noted[("noshow", pid)] = plan.round

    def _mark_late(self, plan, pid: str, pen: dict, delivered_before: Optional[Collection[str]]) -> bool:
        """Mark participant ``pid`` of ``plan``, which contributed to no part, late (see :meth:`note_no_shows`), and
        return whether it is graced (not benched). The mark lasts ``LATE_MARK_ROUNDS`` rounds past the bench it gets
        (none when graced, on probation or not); its ceiling is :func:`~geomesh_p2p.plan.bounds.late_ceiling` of the rate ``plan`` gave it
        (0, no ceiling, from a plan that gave it no compute: the mark still bars it from leading and from a grace)."""
        marks = self.late_marks()
        held = marks.get(pid)
        on_probation = pid in set(plan.probation())
        # a newcomer on probation is graced as an established peer is (session 50: both newcomers of the e2e young swarm,
        # each late once after a delivered round, were benched 10 rounds): delivered_before is proven work, which an
        # identity that never delivers lacks, and the mark benches its next miss; its slot, part bar, budget cap and
        # quorum exclusion stay (the plan's probation marking, which every peer reads alike)
        graced = pid in (delivered_before or ()) and held is None and pid not in pen
        bench = 0 if graced else pb.noshow_penalty_rounds(on_probation)
        a = next((a for a in getattr(plan, "assignments", ()) if a.peer_id == pid), None)
        held_c = held[1] if held is not None and held[1] > 0 else None
        if a is not None and a.predicted_compute_s > 0 and a.token_budget > 0:
            ceiling = late_ceiling(a.token_budget / a.predicted_compute_s, held_c)
        else:
            ceiling = held_c or 0.0
        marks[pid] = (plan.round + bench + pb.LATE_MARK_ROUNDS, ceiling)
        if pid != self.state.me:
            self.noted[("late", pid)] = plan.round
        return graced

    def without_parts(self, members, probation=()):
        """``members`` with the peers under an owner penalty planned as client-only (they own no part),
        unless that would leave no owner at all; peers on ``probation`` always own no part."""
        self.owner = {p: until for p, until in self.owner.items() if until >= self.state.round}
        if probation:
            members = [
                m.model_copy(update={"address": None}) if m.peer_id in probation and m.address else m for m in members
            ]
        barred = [m for m in members if m.peer_id in self.owner and m.address]
        if not barred or all(m in barred or not m.address for m in members):
            return members
        return [m.model_copy(update={"address": None}) if m in barred else m for m in members]


def _extended(run: Optional[tuple[int, int]], round: int) -> tuple[int, int]:
    """``run`` (first, last round) with ``round`` added: extended when it follows on (or lies within), else a new run
    from ``round`` (the rounds between were not seen)."""
    return (run[0], max(run[1], round)) if run is not None and run[0] <= round <= run[1] + 1 else (round, round)


def _covers(run: Optional[tuple[int, int]], round: int, span: int) -> bool:
    """Whether ``run`` (first, last round) holds each of rounds ``round - span`` .. ``round - 1`` (none before 0)."""
    return round <= 0 or (run is not None and run[0] <= max(0, round - span) and run[1] >= round - 1)


def _free_from(run: Optional[tuple[int, int]], round: int, span: int) -> int:
    """The first round ``R >= round`` that ``run`` :func:`_covers` with ``span`` once each of rounds ``round`` ..
    ``R - 1`` is added to it (:func:`_extended`): ``round`` when it covers it already."""
    start = run[0] if run is not None and run[1] >= round - 1 else round
    return round if round <= 0 or start == 0 else max(round, start + span)


def _joined(run: Optional[tuple[int, int]], first: int, last: int) -> Optional[tuple[int, int]]:
    """``run`` with rounds ``first`` .. ``last`` added: their hull when they touch, else the later of the two."""
    if last < first:
        return run
    if run is not None and run[0] <= last + 1 and first <= run[1] + 1:
        return (min(run[0], first), max(run[1], last))
    return run if run is not None and run[0] > last else (first, last)


def _bars_key(bars: dict) -> str:
    """One spelling of an owner-penalty map (a vote's key): JSON, keys sorted, rounds as ints."""
    return json.dumps({str(p): int(u) for p, u in bars.items()}, sort_keys=True)


def _span(run: Optional[tuple[int, int]]) -> str:
    """A run of rounds as text: ``"rounds a-b only"``, or ``"no round"``."""
    return "no round" if run is None else f"rounds {run[0]}-{run[1]} only"


def _cut(run: Optional[tuple[int, int]], round: int) -> Optional[tuple[int, int]]:
    """``run`` without the rounds from ``round`` on (None when nothing is left)."""
    return None if run is None or run[0] >= round else (run[0], min(run[1], round - 1))


def _covering(own: Optional[tuple[int, int]], applied: Optional[tuple[int, int]]) -> Optional[tuple[int, int]]:
    """The own-marks run ``own`` made to hold the ``applied`` run (each round applied is known: :meth:`Penalties.
    note_applied`): ``own`` when it does, else their hull when they touch, else ``applied`` (the run that reaches
    later; an own run that ends before the applied one's last round is no current run)."""
    if applied is None or (own is not None and own[0] <= applied[0] and own[1] >= applied[1]):
        return own
    if own is not None and own[1] >= applied[1] and own[0] <= applied[1] + 1:
        return (min(own[0], applied[0]), own[1])
    if own is not None and own[1] >= applied[1]:
        return own  # a later run of its own (the applied one ended before it began): the current one
    return applied


def _run_ok(v, round: int) -> Optional[tuple[int, int]]:
    """A restored run ``[first, last]``: ints, ``0 <= first <= last < round`` (the checkpoint's); else None."""
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(type(x) is int for x in v) and 0 <= v[0] <= v[1] < round:
        return (v[0], v[1])
    return None


def _mark_ok(m) -> bool:
    """A restored late mark: ``[last round (int), tokens/s ceiling (a finite float >= 0; 0: none)]``."""
    if not (isinstance(m, (list, tuple)) and len(m) == 2 and type(m[0]) is int):
        return False
    c = m[1]
    if not isinstance(c, (int, float)) or isinstance(c, bool):
        return False
    try:
        v = float(c)
    except OverflowError:  # a JSON integer past a float's range (red team 39)
        return False
    return math.isfinite(v) and v >= 0


def _owner_of(spec, ar, j: int) -> str:
    """The owner of part ``j`` of ``ar``: a grouped round's parts are its cross level's (``ar.part_owners``: their
    leaders, :mod:`geomesh_p2p.exchange.groups`), a one-level round's the spec's."""
    owners = getattr(ar, "part_owners", None)
    return owners[j] if owners else spec.owners[j].peer_id


class _SatOut:
    """Round ``round`` as the peers that ran it conclude it when peer ``me`` sat it out (:meth:`Penalties.note_sat_out`;
    both the spec and the result :meth:`Penalties.note_own_failures` reads): the parts it owned missing
    (``part_owners[j]`` owns part ``j``), no contribution of it to any part."""

    def __init__(self, round: int, part_owners: list[str], me: str):
        self.round, self.part_owners = round, part_owners
        self.missing_parts = [j for j, pid in enumerate(part_owners) if pid == me]
        self.contributors: dict = {}
