"""``self-succession``, the red-team behaviour of issue 28's "verdicts that cannot fork" (red team 47b) for
``tests/adversary.py`` -- tests and benchmarks only; a normal peer never imports this module.

A rogue that led round r - 1 may not lead round r while another of that plan's participants is a candidate
(``round/planning.last_round_leaders``): every peer that obtained round r - 1's plan refuses a round r plan of its
as content and follows the next candidate's. This rogue publishes one anyway: when the plan it obtained for round
r - 1 is its own, it stores a plan of round r led by itself (its honest planner's, over the members it gathered)
before it agrees the round as an honest peer does (its own rule then ignores that plan as well, so it stays in the
swarm's lineage and leads again whenever it ranks first). A peer that holds no round r - 1 plan (it sat that
round out) had no rule before 0.16.0 and followed it when it ranked first: a fork. 0.16.0 has such a peer take
round r - 1's plan its voters' records name (``round/last_plan.py``).

``--plan-out PEER_ID`` (repeatable) makes the sit-out happen on cue: the plans this rogue leads with the rule's
consent leave those peers out (a leader may: too slow, joined late), so they obtain its plan, are not in it, re-sync
after the round and drop it (``last_plan.forget_since``): they agree the next round without it. Its self-succession
plans name every member it gathered, those peers included (a plan they would follow, not one that plans them out).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

log = logging.getLogger("tests.adversary")


def planned_members(node: Any, members: Sequence) -> list:
    """``members`` (PeerRecords) less the ``--plan-out`` peers of ``node`` (an ``AdversaryNode``) when it is a
    ``self-succession`` rogue planning a round it may lead; every member otherwise (its self-succession plans,
    other attacks), and never without itself."""
    out = set(getattr(node, "plan_out", ()) or ()) - {node.me}
    if node.attack != "self-succession" or getattr(node, "_succeeding", False) or not out:
        return list(members)
    return [m for m in members if m.peer_id not in out]


class SuccessionAgreement:
    """The round driver's plan agreement (``DhtPlanAgreement``) of a ``self-succession`` rogue: :meth:`agree`
    publishes a round plan of this rogue's own when the plan it obtained for the round before is its own and none is
    out yet (:meth:`publish_early` usually published it before the gather), then agrees the round as the honest
    agreement does. Everything else is the wrapped agreement's."""

    def __init__(self, inner: Any, driver: Any, node: Any):
        self.inner, self.driver, self.node = inner, driver, node
        self.published: set[int] = set()  # rounds it published a plan of its own for (one each: no overwrite)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _due(self, round: int) -> bool:  # noqa: A002
        last = (getattr(self.driver, "_plans_by_round", None) or {}).get(round - 1)
        return round not in self.published and last is not None and last.leader == self.node.me

    async def _publish(self, round: int, members: Sequence, make_plan: Any, when: str) -> None:  # noqa: A002
        me = self.node.me
        if not self._due(round) or not any(m.peer_id != me for m in members):
            return
        self.published.add(round)
        self.node._succeeding = True
        try:
            plan = make_plan(members, me)
            stored = await self.inner.store.publish(plan)
        except Exception as e:  # its planner deferred or failed, or the DHT: agree honestly
            log.warning("adversary[self-succession]: round %d: no plan of its own published: %r", round, e)
        else:
            self.node._note(
                round,
                "succession",
                "led round %d; published its own plan for round %d anyway (%d participants, %s)",
                round - 1,
                round,
                len(plan.assignments),
                f"{when}, stored" if stored else f"{when}, stored nowhere",
            )
        finally:
            self.node._succeeding = False

    async def publish_early(self) -> None:
        """Before the gather of its round r (whose waits, e.g. for a peer still downloading, would let an honest
        leader publish first): its plan over the live records it reads, those of peers still at round r - 1 or
        syncing included (a plan may name them; a follower checks its start digest against its own)."""
        drv = self.driver
        if self._due(drv.state.round):
            live = [x for x in await drv.membership.peers() if not x.leaving]
            await self._publish(drv.state.round, live, drv.policy.make_plan, "before its gather")

    async def agree(self, round: int, members: Sequence, make_plan: Any, **kwargs: Any) -> Any:  # noqa: A002
        await self._publish(round, members, make_plan, "at its agreement")
        return await self.inner.agree(round, members, make_plan, **kwargs)


def wrap_driver(driver: Any, node: Any) -> Any:
    """``driver`` (the node's ``RoundDriver``) with a :class:`SuccessionAgreement` and a gather that publishes
    first (:meth:`SuccessionAgreement.publish_early`) when ``node`` is a ``self-succession`` rogue (once; the driver
    as it is otherwise)."""
    if node.attack == "self-succession" and not isinstance(driver.plans, SuccessionAgreement):
        plans = driver.plans = SuccessionAgreement(driver.plans, driver, node)
        gather = driver.gather

        async def gather_after_publishing(expected: Any, *, first: bool) -> Any:
            if not first:
                await plans.publish_early()
            return await gather(expected, first=first)

        driver.gather = gather_after_publishing
    return driver
