"""Round lifecycle: the round state machine (:mod:`.driver`), its phases (:mod:`.gather`, :mod:`.planning`,
:mod:`.train` with :mod:`.steps`, :mod:`.exchange`, :mod:`.finish`, :mod:`.eager`, :mod:`.resync`; what they
share in :mod:`.context`), its injected collaborators (:mod:`.ports`) and the node's round rules
(:mod:`.policy`); plan agreement itself is :mod:`geomesh_p2p.plan.agree`. Every name of the former
``geomesh_p2p/round.py`` is importable from here."""

import asyncio
import logging
from typing import Collection, Optional

from geomesh_p2p.util.backoff import Backoff
from geomesh_p2p.plan.agree import (
    LEADER_WAIT_CANDIDATES,
    SETTLE_S,
    PlanStore,
    choose_plan,
    digest_majority,
    leader_order,
    leader_rank,
    obtain_plan,
    plan_key,
    takeover_delay,
)
from geomesh_p2p.plan.schema import RoundPlan
from geomesh_p2p.round.driver import DriverConfig, Phase, RoundContext, RoundDriver, no_work
from geomesh_p2p.round.ports import (
    Clock,
    Collective,
    GlobalStatePort,
    Membership,
    PlanAgreement,
    RoundPolicy,
    SystemClock,
    Trainer,
)

__all__ = [
    "Backoff",
    "LEADER_WAIT_CANDIDATES",
    "PlanStore",
    "choose_plan",
    "digest_majority",
    "leader_order",
    "leader_rank",
    "obtain_plan",
    "plan_key",
    "takeover_delay",
    "DriverConfig",
    "Phase",
    "RoundContext",
    "RoundDriver",
    "no_work",
    "Clock",
    "Collective",
    "GlobalStatePort",
    "Membership",
    "PlanAgreement",
    "RoundPolicy",
    "SystemClock",
    "Trainer",
    "DhtPlanAgreement",
]


class DhtPlanAgreement:
    """:class:`PlanAgreement` over a :class:`PlanStore` (the DHT): :func:`obtain_plan`, looked up on this
    module at call time (tests replace ``geomesh_p2p.round.obtain_plan``)."""

    def __init__(self, store: PlanStore):
        self.store = store

    def publish_background(self, plan) -> None:
        """Store ``plan`` without waiting (a lone peer's own plan, for the status page): an owned task of the
        DHT node (cancelled at its shutdown); a failure is logged at DEBUG."""
        spawn = getattr(getattr(getattr(self.store, "dht", None), "tasks", None), "spawn", None)
        if spawn is None:
            return

        async def store() -> None:
            try:
                await self.store.publish(plan)
            except Exception as e:  # the DHT may be unreachable: that is why the peer is alone
                logging.getLogger(__name__).debug("lone plan of round %d not stored: %r", plan.round, e)

        spawn(store(), name=f"plan-{plan.round}")

    async def agree(
        self,
        round,
        members,
        make_plan,
        *,
        accept,
        candidates,
        plan_timeout_s,
        provisional=None,
        last_resort=(),
        authorities=(),
        leaders=None,
        gapped=(),
        tiers=None,
    ):
        return await obtain_plan(
            self.store,
            round,
            members,
            make_plan,
            plan_timeout_s=plan_timeout_s,
            settle_s=self.store.settle_s(),
            stagger_s=SETTLE_S,  # the take-over stagger stays short whatever the settle
            accept=accept,
            candidates=candidates,
            provisional=provisional,
            last_resort=last_resort,
            authorities=authorities,
            leaders=leaders,
            gapped=gapped,
            tiers=tiers or {},
        )

    async def plan_of(self, round: int, leader: str, sha256: str) -> tuple[Optional[RoundPlan], str]:
        """:meth:`PlanStore.read_exact`: the plan of ``round`` from ``leader`` whose bytes hash to ``sha256``, or
        (None, why); a failed DHT read is (None, why) too."""
        try:
            return await self.store.read_exact(round, leader, sha256)
        except Exception as e:  # the DHT may be unreachable: the caller treats the plan as unknown
            return None, f"reading the plan of round {round} from {leader[:10]} failed: {e!r}"

    async def names(
        self, round: int, peer_id: str, wait_s: float, poll_s: float = 0.25, among: Collection[str] = ()
    ) -> bool:
        """Whether a signed plan of ``round`` names ``peer_id``, polled for up to ``wait_s`` seconds (a peer stopped
        between rounds asks it: a leader that read its record before it announced leaving planned it, and then
        its part would go missing); False at once when the round's plans name others only. ``among``, when given:
        only a plan that also names one of these peers counts (a gather asks whether the peers that left during the
        round planned it with this peer; this peer's own plan of itself alone is none). Never raises: a failed
        read counts as no plan."""
        loop = asyncio.get_running_loop()
        end = loop.time() + max(0.0, float(wait_s))
        while True:
            try:
                plans = await self.store.read(round)
            except Exception as e:  # the DHT may be unreachable while the peer stops: then nobody planned with it
                logging.getLogger(__name__).debug("plans of round %d not read: %r", round, e)
                plans = []
            if any(peer_id in p.participants() and (not among or set(among) & set(p.participants())) for p in plans):
                return True
            if plans:  # the round is planned without it (its leaving was read): no need to wait on
                return False
            if loop.time() + poll_s > end:
                return False
            await asyncio.sleep(poll_s)
