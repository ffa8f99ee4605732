"""Test factory of the round rules (:mod:`geomesh_p2p.round.rules`) without a node: no transport, no model.

:func:`make_rules` builds the rule objects a :class:`~geomesh_p2p.node.peer.PeerNode` owns over one
:class:`~geomesh_p2p.round.rules.RoundState`, and returns the :class:`~geomesh_p2p.round.policy.NodeRoundPolicy`
composing them: ``rules.state`` (round, digest, numel, me, standing, history), ``rules.planning``
(:class:`PlanRules`), ``rules.penalties``, ``rules.profile``, ``rules.verified`` and ``rules.sync`` (the
state vote, with no DHT: its ``peers`` returns nothing until a test replaces it).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
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
    marks_from: Optional[int] = 0,
) -> NodeRoundPolicy:
    """The round rules of a peer ``me`` at ``round`` holding ``digest`` (a model of ``numel`` parameters);
    ``run_cfg`` / ``cfg`` default to ``RunConfig()`` / ``NodeConfig()``. ``marks_from``: it applied every round from
    that one to ``round - 1`` (:meth:`Penalties.held_since`; None: none, a peer that joined or restarted fresh)."""
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
    if marks_from is not None:
        penalties.held_since(marks_from)
    profile = Reprofiler(cfg, state, ema=ema, codec_s_per_element=codec_s_per_element)
    sync = StateSync(run_cfg, state, asyncio.Event(), peers=_no_peers)
    return NodeRoundPolicy(
        PlanRules(run_cfg, cfg, state, penalties, profile),
        verified=VerifiedWork(state, verifier=verifier),
        sync=sync,
    )


def light_driver(
    rules: NodeRoundPolicy, *, me: str, ids: list[str], leader: str, run_id: str, full_view_peers: int = 1
):
    """A round driver stand-in for :func:`geomesh_p2p.round.light.is_light` at ``rules``' round R: it applied and
    confirmed round R - 1, whose plan (led by ``leader``) named ``ids`` (every one delivered: 1000 tokens/s)."""
    r = rules.state.round
    plan = SimpleNamespace(round=r - 1, leader=leader, run_id=run_id, participants=lambda: list(ids))
    rules.state.syncing = False
    rules.profile.supported_tps = (r - 1, {p: 1000.0 for p in ids})
    return SimpleNamespace(
        cfg=SimpleNamespace(full_view_peers=full_view_peers, eager=False),
        _last_plan=plan,
        state=rules.state,
        _light_ok_round=r,
        _light_fallback_round=-1,
        stop=asyncio.Event(),
        leaving=False,
        me=me,
        policy=rules,
    )
