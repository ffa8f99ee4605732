"""Who may lead round r, as a function of round r - 1's plan (issue 28): its levels (:func:`next_leaders`), the level a
peer takes over its candidates (:func:`last_round_leaders`, :func:`ungapped_leaders` over the gaps the records
announce, :func:`announced_gaps`), the tier each leader's plan ranks at (:func:`plan_tiers`) and the content refusal of
a plan whose leader may not lead (:func:`lead_problem`). Pure functions of plans and records, the same at every peer
that holds them; :mod:`geomesh_p2p.round.planning` (the agreement) and the light followers use them. Split out of
planning.py in session 52 (its 800-line cap)."""

from __future__ import annotations

from typing import Optional, Sequence

from geomesh_p2p.plan.schema import ContentRefusal, RoundPlan

__all__ = [
    "LEADER_RESORT_MISSES",
    "announced_gaps",
    "last_round_leaders",
    "lead_problem",
    "next_leaders",
    "plan_tiers",
    "ungapped_leaders",
]

#: Attempts at a round and state that ended with no plan at all before round r - 1's leader may lead round r, where
#: another participant of round r - 1's plan is a candidate (:func:`last_round_leaders`): as a last resort, after the
#: candidates' whole attempt and the other established last resorts' (issue 28, session 52: a stopped candidate's
#: record lived on, the newcomer published first and the last leader, which refuses a newcomer's plan, led once the
#: record lapsed: two states of round 3).
LEADER_RESORT_MISSES = 2


def next_leaders(plan: RoundPlan) -> list[frozenset]:
    """Who may lead the round after ``plan``, most restrictive first: its participants but its leader and the peers
    it names as :attr:`~geomesh_p2p.plan.schema.RoundPlan.accused`; but its leader; all of them. A pure function of
    the plan (the same at every peer that obtained it); :func:`last_round_leaders` and the light followers
    (``round/light.py``) take the first level that holds one of their candidates.

    The accused (issue 28, session 47): in the backdoor benchmark (session 46, run p4) two honest peers held verdicts
    against the poisoner a0 by round 4, a0 led round 4 and planned itself in, h1 (its own screen still running, the
    others' evidence read but not re-checked) led round 5 and planned a0 in, and a0 won round 6's rank and led it
    after all three held verdicts (out from 7). A leader names the participants against which it holds published
    evidence it has not settled, so the accused leads nothing in the next round, where a leader that holds the
    verdict leaves it out. Never a refusal of a participant: naming costs leading one round. A rogue leader naming
    an honest peer removes one (``max_accused``, the schema bounds it) from one round's draw, and when its name would
    leave none of a peer's candidates, the level without it is taken; after a whole attempt at the round with no plan
    (a silent candidate holds the first level), the first level no longer applies (:func:`last_round_leaders`'s
    ``missed``), so a named peer can still take over as the last resort (red team 47)."""
    took = frozenset(plan.participants())
    others = took - {plan.leader}
    return [others - frozenset(getattr(plan, "accused", ()) or ()), others, took]


def last_round_leaders(
    seen: Optional[RoundPlan], r: int, candidates: Sequence[str], missed: int = 0
) -> Optional[frozenset]:
    """Who may lead round ``r``: the participants of round ``r - 1``'s plan ``seen`` (the plan this peer obtained
    for it, followed or not) other than its leader and those it names as accused (:func:`next_leaders`), when one
    of ``candidates`` is among them; else with the accused; with its leader when no other candidate is; None (no
    such rule this round) when ``seen`` is of another round or names none of them.

    ``missed``: how many of this peer's earlier attempts at round ``r`` (same state) ended with no plan at all (True:
    one). From one, the level without the accused is skipped (the accused may lead, its leader still not while another
    took part); from ``LEADER_RESORT_MISSES``, the second too: round ``r - 1``'s leader may lead (a last resort only:
    the candidates are the first level's, session 52 below). Red team 47:
    the rogue leader of round r - 1 names the only other honest established peer X, its colluder Y stays live and
    publishes nothing; every peer takes the level {Y}, and X's last-resort plan was refused as content, so no plan
    appeared while Y's record lived. The first level is a function of the plan but whether its candidate publishes
    is not: after a whole attempt without a plan every peer that gets there skips it alike. No fork: a peer still
    in its first attempt refuses X's plan (absent), so it follows a plan of the first level or none; X publishes
    only as a last resort (after every candidate's turn, never once a member's plan it does not ignore was read),
    and every peer that accepts X's plan accepts the first level's plans too (a subset) and ranks them the same.

    Round r - 1's leader after ``LEADER_RESORT_MISSES`` (issue 28, session 52): p0 led round 2, round 3's only
    candidate p1 was stopped with its record live, the newcomer p2 published as a late last resort, p0 refused that
    plan (its leader on probation) and led round 3 itself once p1's record lapsed: two states. A newcomer's plan is
    refused by every established peer while one is live, so an established one must publish first, round r - 1's
    leader included, in every view alike: every peer past two whole attempts lets it lead, and a newcomer waits one
    attempt more while it is a live established member (:func:`newcomer_resort_misses`). The same argument as red
    team 47's: a peer in an earlier attempt ignores its plan as absent and follows a plan of a level that every later
    peer accepts too. What a rogue leader of round r - 1 gains: it leads round r after two whole attempts in which
    every candidate of the first level, then every established last resort, published nothing; a colluder that is
    such a candidate could lead that round and plan it in anyway, and with no colluder (an honest candidate stalled)
    it leads a round it led anyway once that candidate's record lapsed (the third level), only sooner.

    Why (session 29): a peer that verified work excludes is left out of the plans of the leaders that hold the
    verdict, but stays established in everyone's standing for the window's rounds, so it kept leading the rounds
    whose rendezvous rank it won, planning itself back in (the backdoor benchmark: the poisoner, out of rounds 6-11
    and 13, was in 12 and 14, both led by it; out from round 6 otherwise). Round ``r - 1``'s plan is the same at
    every peer that obtained it, so this rule is too: a leader left out of it leads nothing in round ``r``, for
    everyone or for no one, and an exclusion that one honest leader applied keeps the accused out of the next
    round's leadership whoever holds the verdict.

    No self-succession (session 30): round r - 1's leader leads round r only when no other candidate took part.
    The benchmark's poisoner, held excluded by every honest peer from round 5, led rounds 6 and 7: it had led 6
    (planned into round 5 before the verdicts), so it was in round 6's plan, its own, and won round 7's rank too.
    A plan names its leader, so this is a function of round r - 1's plan as well; an accused that leads a round
    hands the next one to somebody else, and a leader holding the verdict leaves it out of the round after."""
    if seen is None or seen.round != r - 1:
        return None
    levels = next_leaders(seen)
    for took in levels[2:] if missed >= LEADER_RESORT_MISSES else levels[1:] if missed else levels:
        if any(c in took for c in candidates):
            return took
    return None


def plan_tiers(seen: Optional[RoundPlan], r: int) -> dict[str, int]:
    """PeerID -> the first level of :func:`next_leaders` (0, 1, 2) of round ``r - 1``'s plan ``seen`` that holds it,
    for its participants; empty when ``seen`` is of another round. The same in every view that holds ``seen``:
    ``obtain_plan`` compares it before the rank (its ``tiers``).

    Why (red team 52b): a peer one attempt with no plan further accepts one more level (:func:`last_round_leaders`'s
    ``missed``: the accused from one, round ``r - 1``'s leader from ``LEADER_RESORT_MISSES``). By rank alone it
    followed a better-ranked plan of that level where a peer one attempt behind refuses that plan as content and
    followed another one it accepts too: the rogue leader of round ``r - 1`` published once the accused's
    last-resort plan was out and, ranked first, took the peers at their third attempt while the accused and the
    peers at their second trained on its plan (two states). An earlier level first: every peer that accepts both
    follows the one the peer behind follows."""
    if seen is None or seen.round != r - 1:
        return {}
    levels = next_leaders(seen)
    return {p: min(i for i, took in enumerate(levels) if p in took) for p in levels[-1]}


def lead_problem(plan: RoundPlan, took: Optional[frozenset]) -> Optional[ContentRefusal]:
    """Why a plan's leader may not lead (:func:`last_round_leaders`: it had no part in the last round's plan, led
    it while another candidate took part, or was named accused in it while another candidate was not), as
    a :class:`ContentRefusal`: every peer that obtained that plan gives it, so the plan is ignored as absent and
    the next candidate's is followed (no sit-out). None: no objection.

    "Every peer" holds where the candidates agree, and they come from each peer's marks (``Penalties.unled``): a
    follower without the swarm's history (joined, restarted fresh, re-synced) counted a late-marked participant the
    holders leave out, took an earlier level and refused the plan they followed (session 50, the e2e slow-link
    joiner). Such a follower takes the marks the peers announce on themselves (``Penalties.announced_unled``, in
    ``policy.leader_candidates``); what is left is a mark a peer does not announce (a rogue's, or one a peer
    restarted fresh cannot know): docs/security.md, "Session 50"."""
    if took is None or plan.leader in took:
        return None
    return ContentRefusal(
        f"its leader {plan.leader[:10]} may not lead: it had no part in the last round's plan, led it, or was "
        "named accused in it"
    )


def announced_gaps(live: dict, candidates: Sequence[str], r: int, me: Optional[str]) -> list[str]:
    """The ``candidates`` (not this peer) whose records in ``live`` announce they lead nothing in round ``r`` by their
    own rule of the marks they lack (``PeerRecord.lead_from`` past ``r``: Penalties.lead_from): the turns after
    theirs come sooner (obtain_plan's ``gapped``); they stay candidates, ranked as before (fresh user 51)."""
    return [
        c
        for c in candidates
        if c != me and type(getattr(live.get(c), "lead_from", None)) is int and live[c].lead_from > r
    ]


def ungapped_leaders(
    seen: Optional[RoundPlan], r: int, candidates: Sequence[str], gaps: set[str], missed: int = 0
) -> Optional[frozenset]:
    """:func:`last_round_leaders` over the ``candidates`` less ``gaps`` (they announced they lead nothing in round ``r``:
    :func:`gaps_of`); where every candidate is gapped, the last level (every participant of ``seen``: round
    ``r - 1``'s leader may lead again, no other candidate can). Without gaps, :func:`last_round_leaders` as it is.

    Why (fresh user 52): p1 led round 11; p2 (resumed) and later p3 (resumed) and p4 (joined) left themselves out for
    the marks they lacked (``Penalties.lead_gap``). p1 counted them as candidates, so no self-succession barred it,
    while each gapped peer, not counting itself, let p1 lead and deferred to it (or to the other gapped ones): nobody
    published in a whole attempt and a gapped peer led as the last resort, 4-8 s later, every other round 12-26.
    A gapped peer keeps to the gap its record announced (``NodeRoundPolicy.announced_lead_from``), so it is no
    candidate in any view, its own included (which is why this peer's own announced gap counts here, also where it
    is its own only candidate); counted over the rest, every view that read the gap takes the same level, and round
    r - 1's leader leads at its turn (the gapped ones' turns cost nothing: obtain_plan's ``gapped``). The leader order
    and the turns are unchanged. A view that did not read a gap (a
    record rewritten between reads: a rogue's; an honest peer announces one ``lead_from`` a round,
    ``node.training.record_state``) takes a stricter level and refuses round r - 1's leader's plan as content: as for
    the marks announced on themselves (``Penalties.announced_unled``) it may follow another plan that round, and the
    digest check re-syncs it (docs/round.md, "Not closed")."""
    pool = [c for c in candidates if c not in gaps]
    if pool or not candidates:
        return last_round_leaders(seen, r, pool, missed)
    if seen is None or seen.round != r - 1:
        return None
    return next_leaders(seen)[-1]
