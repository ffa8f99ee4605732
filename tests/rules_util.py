"""Test factory of the round rules (:mod:`geomesh_p2p.round.rules`) without a node: no transport, no model.

:func:`make_rules` builds the rule objects a :class:`~geomesh_p2p.node.peer.PeerNode` owns over one
:class:`~geomesh_p2p.round.rules.RoundState`, and returns the :class:`~geomesh_p2p.round.policy.NodeRoundPolicy`
composing them: ``rules.state`` (round, digest, numel, me, standing, history), ``rules.planning``
(:class:`PlanRules`), ``rules.penalties``, ``rules.profile``, ``rules.verified`` and ``rules.sync`` (the
state vote, with no DHT: its ``peers`` returns nothing until a test replaces it).
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

from geomesh_p2p.config.models import NodeConfig, RunConfig
from geomesh_p2p.round.policy import NodeRoundPolicy
from geomesh_p2p.round.rules import Penalties, PlanRules, Reprofiler, RoundState, StateSync, VerifiedWork
from geomesh_p2p.trust.standing import Standing


async def _no_peers(include_leaving: bool = False) -> list:
    return []


def make_rules(
    run_cfg: Any = None,
    cfg: Any = None,
    *,
    me: Optional[str] = None,
    round: int = 0,
    digest: Optional[str] = None,
    numel: int = 0,
    standing: Optional[Standing] = None,
    history: Optional[list] = None,
    owner_penalty: Optional[dict[str, int]] = None,
    noshow_penalty: Optional[dict[str, int]] = None,
    ema: Any = None,
    codec_s_per_element: Optional[float] = None,
    verifier: Any = None,
) -> NodeRoundPolicy:
    """The round rules of a peer ``me`` at ``round`` holding ``digest`` (a model of ``numel`` parameters);
    ``run_cfg`` / ``cfg`` default to ``RunConfig()`` / ``NodeConfig()``."""
    run_cfg = run_cfg if run_cfg is not None else RunConfig()
    cfg = cfg if cfg is not None else NodeConfig()
    state = RoundState(
        me=me,
        round=round,
        digest=digest,
        numel=numel,
        standing=standing if standing is not None else Standing(),
        history=history if history is not None else [],
    )
    penalties = Penalties(state, owner_penalty, noshow_penalty)
    profile = Reprofiler(cfg, state, ema=ema, codec_s_per_element=codec_s_per_element)
    sync = StateSync(run_cfg, state, asyncio.Event(), peers=_no_peers)
    return NodeRoundPolicy(
        PlanRules(run_cfg, cfg, state, penalties, profile),
        verified=VerifiedWork(state, verifier=verifier),
        sync=sync,
    )
