"""Level-1 equivocation in accountable grouped rounds (issue 26): 12 in-process peers in groups of 3 on 127.0.0.1.

12 peers are 4 groups, so each slice has ``ceil(4 / 3) = 2`` leaders and each slice owner hands its one group part on
as two cross contributions, each with its own signed level-1 commitment. An owner that commits to different input
lists for that group part towards the two leaders (here: its own contribution counted towards one leader only, with
the packet and member list of the other cross contribution recomputed to match, so the hand-off recomputation and the
mates' receipts find nothing) is proven by its group mates, who compare the two commitments they fetch for the drop
check anyway; the proof verifies from its bytes and excludes the owner at every honest peer, and nobody else.
"""

from __future__ import annotations

import types

import pytest
import torch

from geomesh_p2p.exchange import accountable, messages
from geomesh_p2p.exchange import frames as wire
from geomesh_p2p.exchange.groups import group_layout
from tests.collective_util import RUN, deltas_for
from tests.integration.test_collective_groups import G, _run, _spec
from tests.integration.test_collective_groups_accountable import _excluded_everywhere, _validate


def _equivocate(gc, layout, round, target=1):
    """Make slice owner ``gc`` build its group results as usual, and also one without its own contribution; its cross
    contribution to cross part ``target`` then carries that second result: its list, its members and the sign of its
    aggregate over the part's range (a consistent second level-1 result, signed to one leader only)."""
    me = gc.peer_id
    alt: dict[int, tuple[bytes, torch.Tensor]] = {}  # group part -> (its list, its fp32 aggregate) without this owner
    real_build = gc.group._build_result

    def build(self, spec, part, contributions):
        kept = [c for c in contributions if c.sender != me]
        signed = messages.build_result(self.transport.identity, spec, part.index, part.owner, "", kept, b"")
        res, agg, _ = messages._result_fields(wire.SignedView(signed).payload)
        alt[part.index] = (bytes(res.inputs), torch.frombuffer(bytearray(agg), dtype=torch.float32))
        return real_build(spec, part, contributions)

    gc.group._build_result = types.MethodType(build, gc.group)
    real_parts = gc.cross._parts

    def parts(self, spec, j, delta, tokens, compute_end):
        if j != target:
            return real_parts(spec, j, delta, tokens, compute_end)
        gspec = gc.group._rounds[spec.round].spec
        a = layout.slices[layout.slice_of(me)][0]
        o = spec.owners[j]
        gid, lists = self.handoff[spec.round]
        (jj,) = [i for i, go in enumerate(gspec.owners) if go.peer_id == me]  # one group part: the whole slice
        listed, agg = alt[jj]
        d = delta.clone()
        d[o.start : o.end] = agg[a + o.start - gspec.owners[jj].start : a + o.end - gspec.owners[jj].start]
        members = [(p, n) for p, n in self.members[spec.round] if p != me]
        return messages.contribution_parts(
            self.transport.identity, spec, j, d, sum(n for _, n in members), compute_end, members, [listed], gid
        )

    gc.cross._parts = types.MethodType(parts, gc.cross)


@pytest.mark.timeout(120)
async def test_a_slice_owner_committing_two_lists_to_two_leaders_is_proven_by_its_mates_and_excluded(grouped_swarm):
    sw, grouped = await grouped_swarm(12)
    spec = _spec(sw, mode="accountable", validators_per_part=2)
    layout = group_layout(spec, G)
    assert layout is not None and len(layout.groups) == 4 and all(len(ls) == 2 for ls in layout.leaders)
    evil = next(p for os in layout.slice_owners for p in os if all(p not in ls for ls in layout.leaders))
    mates = [p for p in layout.groups[layout.group_of(evil)] if p != evil]
    gc_evil = grouped[sw.pids.index(evil)]
    _equivocate(gc_evil, layout, spec.round)
    deltas = deltas_for(sw.pids, 3 * 4 * 2048, seed=31)
    out = await _run(grouped, spec, deltas, {p: 100 for p in sw.pids})
    aggs = [r.aggregate for r in out.values()]
    assert all(torch.equal(aggs[0], a) for a in aggs[1:])
    findings = await _validate(grouped, spec)
    summary = [(f.kind, f.owner[:10], f.reason) for f in findings]
    # both mates (each holds a receipt of its push to the owner's group part, and fetched both leaders' commitments
    # for the drop check) prove the equivocation; the hand-off recomputation and the drop check prove nothing. A
    # drawn hand-off validator of the second cross part may count a suspicion against the owner (its PullInputs
    # serves the inputs of its one signed group result, not those of the second list): no proof, never acted on
    proven = [f for f in findings if f.proof is not None]
    assert [(f.kind, f.owner) for f in proven] == [("equivocation", evil)] * 2, summary
    assert all((f.kind, f.owner) == ("unvalidatable", evil) for f in findings if f.proof is None), summary
    v = accountable.verify_proof(RUN, proven[0].proof)
    assert (v.kind, v.accused, v.round) == ("handoff-equivocation", evil, spec.round)
    assert "different inputs for group part" in v.reason and "3 and 2 entries" in v.reason
    assert all(gc.drop_checks[spec.round][0] >= 2 for gc in grouped if gc.peer_id in mates)
    excluded = await _excluded_everywhere(sw, grouped, proven[0].proof, spec.round)
    for p, ex in excluded.items():
        if p == evil:
            assert ex == {}
        else:
            assert set(ex) == {evil} and "handoff-equivocation proven" in ex[evil], (p[:10], ex)


@pytest.mark.timeout(120)
async def test_honest_slice_owners_with_two_leaders_per_slice_yield_no_finding(grouped_swarm):
    """The same 12-peer layout, every owner honest: each member compares the 2 commitments of each of its 2 slice
    owners (4 fetches, the drop check's own) and finds no difference, no finding at all."""
    sw, grouped = await grouped_swarm(12)
    spec = _spec(sw, mode="accountable", validators_per_part=2)
    layout = group_layout(spec, G)
    assert layout is not None and all(len(ls) == 2 for ls in layout.leaders)
    await _run(grouped, spec, deltas_for(sw.pids, 3 * 4 * 2048, seed=32), {p: 100 for p in sw.pids})
    findings = await _validate(grouped, spec)
    assert findings == [], [(f.kind, f.owner[:10], f.reason) for f in findings]
    checks = {gc.peer_id: gc.drop_checks.get(spec.round, (0, 0)) for gc in grouped}
    print("drop+equivocation checks (fetches, bytes received) per member:", sorted(checks.values()))
    assert all(n == 4 for n, _ in checks.values()), checks
    assert all(b <= n * 600 for n, b in checks.values()), checks
