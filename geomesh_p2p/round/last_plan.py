"""Round r - 1's plan for a peer that did not obtain it (issue 28 "verdicts that cannot fork", red team 47b).

Who may lead round r is a function of round r - 1's plan (:func:`~geomesh_p2p.round.planning.last_round_leaders`:
not its leader while another took part, not its accused), and a plan led by anyone else is refused as content,
i.e. ignored as absent, because "every peer that obtained that plan gives it". A peer that sat round r - 1 out (a
refused plan, a DHT miss, a restart, a newcomer) held no such plan: no rule applied for it, so it accepted the plan
of round r - 1's rogue leader L that the others ignored, ranked it first, and two honest peers followed two plans
of one round (L's, and a first-level candidate's or, after a miss, the accused's last resort).

**The rule.** Every record names the plan that made its state (``PeerRecord.last_plan``: round ``round - 1``'s plan
this peer obtained, as ``"<leader>/<SHA-256 hex of RoundPlan.to_bytes>"``, :func:`record_ref`). A peer agreeing
round r without round r - 1's plan (:func:`recover`) reads the references of its voters: the records of its leader
candidates (established by standing: no fresh identity counts) at round r with its own digest. When at most half
of those voters name any plan (a joint restart: resumed peers name none), references to plans that cannot be read
count for nothing, so one rogue's forged reference cannot hold every peer in doubt (red team 48). A reference named
by more than half of the voters that name one is taken: the plan is read from the DHT under its leader's subkey and
checked (signed by that leader, this run, round r - 1, the same hash), and the peer then holds what the others
hold, so ``lead_problem`` is again the same for everyone. The plan stays readable long enough: it lives until its
round's exchange deadline + 30 s and at least 120 s (``plan.agree.plan_expiration``), read here past its round's end.

**Why not the DHT's plans of round r - 1 alone, or a reference in the round r plan.** Several plans of a round can
be stored, and a rogue can store a shadow one at any time under its own subkey (a colluder's plan naming L as a
plain participant): choosing among them by rank picks the shadow when its signer ranks first, and L's round r plan
would simply refer to it. A shadow gets no more than the rogue voters' references here.

**In doubt** (the references split with no majority, or the plan named cannot be read: expired, a DHT miss, a
forged reference): the peer accepts only a plan whose leader every plan named lets lead (none when one of them
cannot be read: judged by a readable shadow alone, L would be cleared), refusing others with a reason that is no content refusal, so it sits the round out where such a plan
ranks first (``PlanRefused``, then a re-sync), and it leads nothing itself that round. No reference at all (the
run's first round, a swarm of 0.15 peers, which name none): no rule, as before 0.16.0 (docs/security.md).
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable, Optional

from geomesh_p2p.plan.schema import RoundPlan
from geomesh_p2p.schema.peer import PeerRecord

log = logging.getLogger("geomesh_p2p.node.peer.round")

#: A reference: a PeerID (base58, no "/"), "/", the 64 hex digits of SHA-256.
_REF = re.compile(r"([1-9A-HJ-NP-Za-km-z]{1,90})/([0-9a-f]{64})")
#: Rounds of obtained plans a driver keeps for its record (:func:`remember`): its round's and a margin.
KEEP_ROUNDS = 3
#: Most distinct references read in doubt: more means a rogue fills the vote, and the peer sits the round out.
MAX_DOUBT_PLANS = 4

#: ``read(round, leader, sha256) -> (plan or None, why)``: ``PlanAgreement.plan_of``.
PlanRead = Callable[[int, str, str], Awaitable[tuple[Optional[RoundPlan], str]]]


def plan_ref(plan: RoundPlan) -> str:
    """``"<leader>/<SHA-256 hex of plan.to_bytes()>"``: what a record names (``PeerRecord.last_plan``)."""
    return f"{plan.leader}/{hashlib.sha256(plan.to_bytes()).hexdigest()}"


def parse_ref(ref: Any) -> Optional[tuple[str, str]]:
    """(leader, sha256 hex) of a reference, or None when it is malformed (a record's field is untrusted)."""
    # fullmatch: "$" also matches before a trailing newline, and one plan would have two spellings (two votes' keys)
    m = _REF.fullmatch(ref) if isinstance(ref, str) else None
    return (m.group(1), m.group(2)) if m else None


@dataclass(frozen=True)
class Recovered:
    """What :func:`recover` found: ``plan``, round r - 1's plan taken (None: in doubt); ``doubt``, in doubt, the
    plans named that could be read (one may be the real one); ``why``: one line for the log."""

    plan: Optional[RoundPlan]
    doubt: tuple[RoundPlan, ...]
    why: str


def named_refs(records: Iterable[PeerRecord], r: int, digest: Optional[str], voters: Iterable[str]) -> Counter:
    """Reference -> number of ``voters``' records at round ``r`` with weights ``digest`` that name it (well-formed
    references only; one record, one vote)."""
    who = set(voters)
    out: Counter = Counter()
    for x in records:
        ref = getattr(x, "last_plan", None)
        if x.peer_id in who and x.round == r and digest and x.weights_digest == digest and parse_ref(ref):
            out[ref] += 1
    return out


async def recover(
    read: PlanRead, records: Iterable[PeerRecord], r: int, digest: Optional[str], voters: Iterable[str]
) -> Optional[Recovered]:
    """Round ``r - 1``'s plan as ``voters`` (this peer's leader candidates, itself left out) name it in their
    records at round ``r`` and weights ``digest`` (this peer's state), read with ``read``. None when none names one
    (no rule applies, as before). When no more than half of the voters at that round and state name one (red team
    48: a joint restart), the references whose plan cannot be read are left out first (None when none is left).
    Otherwise a :class:`Recovered`: ``plan`` set when more than half of the
    references named are one and that plan was read and checked; else in doubt with the plans named (at most
    :data:`MAX_DOUBT_PLANS`), none when one of them could not be read (a peer in doubt then accepts no plan). Never
    raises on what the DHT holds."""
    records = list(records)
    refs = named_refs(records, r, digest, voters)
    if not refs:
        return None
    who = set(voters)
    n = len({x.peer_id for x in records if x.peer_id in who and x.round == r and digest and x.weights_digest == digest})
    if refs.total() * 2 <= n:
        # Most voters name no plan (a joint restart: resumed peers name none): a reference that cannot be read is no
        # reason to doubt here, or one rogue's forged reference would hold every peer in doubt (red team 48)
        refs = await _readable(read, r, refs)
        if not refs:
            return None  # no rule applies, as before 0.16.0
    total = refs.total()
    (top, votes), *_ = refs.most_common(1)
    if votes * 2 > total:
        leader, sha = parse_ref(top) or ("", "")
        plan, why = await read(r - 1, leader, sha)
        if plan is not None:
            # the round said: the next line (this round's plan) may name another leader (fresh user 49 read two leaders)
            return Recovered(plan, (), f"{votes} of {total} voters name round {r - 1}'s plan, by leader {leader[:10]}")
        return Recovered(
            None,
            (),
            f"{votes} of {total} voters name a plan of round {r - 1} by {leader[:10]} that is not usable: {why}",
        )
    if len(refs) > MAX_DOUBT_PLANS:
        return Recovered(None, (), f"{len(refs)} different plans named by {total} voters")
    read_ok: list[RoundPlan] = []
    whys = []
    for ref in sorted(refs):
        leader, sha = parse_ref(ref) or ("", "")
        plan, why = await read(r - 1, leader, sha)
        if plan is not None:
            read_ok.append(plan)
        else:
            whys.append(why)
    split = ", ".join(f"{(parse_ref(k) or ('?',))[0][:10]} x{c}" for k, c in sorted(refs.items()))
    # One plan named and not read may be the real one: judging by the others alone would follow the plans a shadow
    # allows (a rogue overwrites or forges the real reference's plan, its shadow stays readable). None is cleared.
    return Recovered(
        None,
        () if whys else tuple(read_ok),
        f"the voters' references split with no majority ({split})" + (f"; {'; '.join(whys)}" if whys else ""),
    )


async def _readable(read: PlanRead, r: int, refs: Counter) -> Counter:
    """``refs`` less the references whose plan of round ``r - 1`` cannot be read and checked (none read, an empty
    Counter, when more than :data:`MAX_DOUBT_PLANS` are named: a rogue fills the vote)."""
    if len(refs) > MAX_DOUBT_PLANS:
        return Counter()
    out: Counter = Counter()
    for ref in sorted(refs):
        leader, sha = parse_ref(ref) or ("", "")
        if (await read(r - 1, leader, sha))[0] is not None:
            out[ref] = refs[ref]
    return out


def remember(drv: Any, plan: RoundPlan) -> None:
    """``plan`` is the one this peer obtained for its round (followed or not, or recovered): the next round's
    leader rule reads it (``drv._plan_seen``) and this peer's record names it while its state is of the round after
    (:func:`record_ref`); the last :data:`KEEP_ROUNDS` rounds' plans are kept."""
    drv._plan_seen = plan
    held = getattr(drv, "_plans_by_round", None)
    if held is None:
        held = drv._plans_by_round = {}
    held[plan.round] = plan
    for old in [k for k in held if k <= plan.round - KEEP_ROUNDS]:
        del held[old]


def record_ref(drv: Any, round: int) -> Optional[str]:
    """The reference this peer's record at ``round`` names: the plan of round ``round - 1`` it obtained (a state of
    round ``round`` is made by it), or None (it obtained none: it sat that round out, or the driver is not built)."""
    plan = (getattr(drv, "_plans_by_round", None) or {}).get(round - 1)
    return plan_ref(plan) if plan is not None else None


def forget_since(drv: Any, round: int) -> None:
    """After a re-sync to a state this peer did not make, of round ``round``: the plans it obtained for rounds
    ``round - 1`` and later may not be the ones that made that state (it was planned out of one, or its attempt
    failed while the others retried with another), so they are dropped; the next agreement takes round
    ``round - 1``'s from its voters (:func:`recover`), and its record names none meanwhile (red team 48)."""
    held = getattr(drv, "_plans_by_round", None) or {}
    for k in [k for k in held if k >= round - 1]:
        del held[k]
    seen = getattr(drv, "_plan_seen", None)
    if seen is not None and seen.round >= round - 1:
        drv._plan_seen = None
