"""The round rules as plain objects with explicit dependencies (issue 24), one module per concern:

* :mod:`.state`: :class:`RoundState`, the node's round state the rules share (round, digest, P, standing);
* :mod:`.penalties`: owner and no-show penalties (:class:`Penalties`);
* :mod:`.planning`: admission of members, this peer's plan, the checks of a leader's plan (:class:`PlanRules`);
* :mod:`.spec`: the collective's spec of a plan (:func:`collective_spec`);
* :mod:`.outer`: the outer step per part (:class:`OuterStepRule`);
* :mod:`.profiling`: re-profiling EMAs and delivered rates (:class:`Reprofiler`);
* :mod:`.verified`: verified work (:class:`VerifiedWork`);
* :mod:`.state_sync`: the state vote and the re-sync (:class:`StateSync`).

:class:`geomesh_p2p.round.policy.NodeRoundPolicy` composes them into the driver's ``RoundPolicy``.
"""

from geomesh_p2p.round.rules.outer import OuterStepRule
from geomesh_p2p.round.rules.penalties import OWNER_PENALTY_ROUNDS, Penalties
from geomesh_p2p.round.rules.planning import NoOwner, PlanRules, plan_horizon_s
from geomesh_p2p.round.rules.profiling import EXCHANGE_COST_STEP, Reprofiler
from geomesh_p2p.round.rules.state_sync import StateSync
from geomesh_p2p.round.rules.spec import collective_spec
from geomesh_p2p.round.rules.state import RoundState
from geomesh_p2p.round.rules.verified import VerifiedWork

__all__ = [
    "RoundState",
    "Penalties",
    "PlanRules",
    "NoOwner",
    "collective_spec",
    "OuterStepRule",
    "Reprofiler",
    "VerifiedWork",
    "StateSync",
    "OWNER_PENALTY_ROUNDS",
    "EXCHANGE_COST_STEP",
    "plan_horizon_s",
]
