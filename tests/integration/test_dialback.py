"""Dial-back before a fresh vote (issue 28, "a fresh joiner that dials back the addresses that vouch for a
lineage before trusting it"): real transports and state servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from geomesh_p2p.config.models import RunConfig
from geomesh_p2p.model.state import GlobalState
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.net.transport import Transport
from geomesh_p2p.net.transport_config import TransportConfig
from geomesh_p2p.round.rules import RoundState
from geomesh_p2p.round.rules.state_sync import StateSync
from geomesh_p2p.sync.server import StateServer
from geomesh_p2p.trust.dialback import DialBack
from geomesh_p2p.trust.standing import attest_key, choose_state
from tests.records_util import peer_record
from tests.swarm_util import dead_address

pytestmark = pytest.mark.timeout(60)

RUN = "dialback"
P = 1 << 10


def _state(round: int, seed: int) -> GlobalState:
    g = torch.Generator().manual_seed(seed)
    gs = GlobalState(P, 1)
    gs.load(round, torch.randn(P, generator=g), torch.zeros(P))
    return gs


def _vouching(ids, fields):
    """Records of ``ids`` that each vouch for all the others (history 10), with ``fields``."""
    return [
        peer_record(i, standing={attest_key(str(o.peer_id)): 10 for o in ids if o is not i}, **fields(i)) for i in ids
    ]


async def test_made_up_addresses_vouching_for_a_lineage_do_not_outvote_the_peers_that_answer():
    """Three honest donors (round 5) against six identities that vouch for each other and announce round 9
    of another lineage: five at addresses where nobody listens, one at a real server that answers with
    another key. The fresh vote of addresses picks the made-up lineage (6 addresses to 3); after dial-back
    only the three that answered as themselves with their state vote, and the honest state wins."""
    honest_ids = [Identity.generate() for _ in range(3)]
    sybil_ids = [Identity.generate() for _ in range(6)]
    servers, addrs = [], {}
    client = Transport(Identity.generate(), RUN, TransportConfig(client_only=True))
    gs = _state(5, seed=1)
    async with contextlib.AsyncExitStack() as stack:
        for ident in honest_ids + [Identity.generate()]:  # the last: the impostor's server (its own key)
            t = Transport(ident, RUN, TransportConfig(host="127.0.0.1", port=0))
            StateServer(t, state=gs)
            addrs[ident] = await t.start()
            servers.append(t)
        impostor_addr = addrs[list(addrs)[-1]]
        dead = [stack.enter_context(dead_address()) for _ in range(5)]
        stack.push_async_callback(client.stop)
        for t in servers:
            stack.push_async_callback(t.stop, 0)

        honest = _vouching(honest_ids, fields=lambda i: dict(address=addrs[i], round=5, weights_digest=gs.digest))
        sybil_addr = dict(zip(sybil_ids, dead + [impostor_addr]))
        sybils = _vouching(sybil_ids, fields=lambda i: dict(address=sybil_addr[i], round=9, weights_digest="f" * 32))
        recs = honest + sybils

        before = choose_state(recs, me=None, standing=None).choice
        assert before is not None and (before.round, before.digest, before.mode) == (9, "f" * 32, "fresh")

        db = DialBack(client, timeout_s=2.0)
        kept, dropped = await db.verified(recs)
        assert sorted(r.peer_id for r in kept) == sorted(str(i.peer_id) for i in honest_ids)
        assert set(dropped) == {str(i.peer_id) for i in sybil_ids}
        assert all("did not answer" in dropped[str(i.peer_id)] for i in sybil_ids[:5])
        assert "answers as" in dropped[str(sybil_ids[5].peer_id)]
        after = choose_state(kept, me=None, standing=None).choice
        assert after is not None and (after.round, after.digest) == (5, gs.digest)
        assert sorted(after.donors) == sorted(addrs[i] for i in honest_ids)
        assert db.dials == 9
        await db.verified(recs)  # within the cache's lifetime: no new dial
        assert db.dials == 9

        # a record announcing a state its address does not hold does not vote; one whose donor moved on does
        stale = peer_record(honest_ids[0], address=addrs[honest_ids[0]], round=5, weights_digest="e" * 32)
        assert "holds round 5" in (await db.problem(stale) or "")
        earlier = peer_record(honest_ids[1], address=addrs[honest_ids[1]], round=4, weights_digest="e" * 32)
        assert await db.problem(earlier) is None

        # the catch-up's vote goes through it (StateSync._dialled), with one INFO line per dropped record
        sync = StateSync(RunConfig(), RoundState(me="joiner"), asyncio.Event(), peers=None, transport=lambda: client)  # type: ignore[arg-type]
        kept2 = await sync._dialled(recs)
        assert sorted(r.peer_id for r in kept2) == sorted(r.peer_id for r in kept)
        assert len(sync._vote_log) == 6
