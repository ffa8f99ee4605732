"""The digest check's reads (issue 27, session 45): each poll is a fresh read of the voters' records alone
(``Membership.records_of`` with the full read quorum), never the node's shared membership read, which is reused
for ``peers_max_age_s`` and hid a record announced just after the check began for ~0.7 s. A fork is still told:
a majority on another digest is a mismatch (False)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from geomesh_p2p.net.identity import Identity
from geomesh_p2p.round import finish
from geomesh_p2p.util.backoff import Backoff
from tests.records_util import peer_record

pytestmark = pytest.mark.timeout(30)


class Voters:
    """Membership whose other voters announce round ``r`` with ``digests`` only from the ``announce_at``-th read."""

    def __init__(self, me: str, mine: str, others: dict[str, str], announce_at: int, r: int):
        self.me, self.mine, self.others, self.announce_at, self.r = me, mine, others, announce_at, r
        self.reads: list[tuple[tuple[str, ...], bool]] = []

    async def records_of(self, peer_ids, *, sampled=True):
        self.reads.append((tuple(peer_ids), sampled))
        out = [peer_record(self.me, round=self.r, weights_digest=self.mine)]
        if len(self.reads) >= self.announce_at:
            out += [peer_record(p, round=self.r, weights_digest=d) for p, d in self.others.items()]
        else:  # still finishing: the record of the round before, with the digest it started from
            out += [peer_record(p, round=self.r - 1, weights_digest="0" * 32) for p in self.others]
        return [x for x in out if x.peer_id in peer_ids]

    async def peers(self, include_leaving=False):
        raise AssertionError("the digest check must not use the shared membership read")


def _driver(membership, mine: str, voters_of=lambda recs: list(recs)) -> SimpleNamespace:
    """A driver of a fake clock (each pause advances it) whose policy keeps the records ``voters_of(recs)`` says."""
    clock = SimpleNamespace(t=0.0)
    clock.monotonic = lambda: clock.t
    clock.time = lambda: 1000.0 + clock.t

    async def pause(seconds: float) -> bool:
        clock.t += seconds
        await asyncio.sleep(0)
        return False

    return SimpleNamespace(
        me=membership.me,
        membership=membership,
        clock=clock,
        cfg=SimpleNamespace(digest_wait_s=2.0),
        backoff=lambda: Backoff(0.05, 1.0),
        pause=pause,
        policy=SimpleNamespace(digest_voters=voters_of),
        state=SimpleNamespace(digest=mine),
        _last_plan=None,
        _confirmed_round=0,
    )


async def test_a_record_announced_after_the_first_read_is_counted_at_the_next_read():
    me, other = (str(Identity.generate().peer_id) for _ in range(2))
    m = Voters(me, "a" * 32, {other: "a" * 32}, announce_at=3, r=5)
    drv = _driver(m, "a" * 32)
    assert await finish.check_digest(drv, 5, [me, other]) is True
    # three reads from the full read quorum: this peer's record shows round 5 at the first, so only the other is
    # read again; the third saw the other's record
    assert m.reads == [((me, other), False), ((other,), False), ((other,), False)]
    assert drv._confirmed_round == 5


async def test_a_majority_on_another_digest_is_still_a_mismatch():
    me, b, c = (str(Identity.generate().peer_id) for _ in range(3))
    m = Voters(me, "a" * 32, {b: "b" * 32, c: "b" * 32}, announce_at=2, r=7)
    drv = _driver(m, "a" * 32)
    assert await finish.check_digest(drv, 7, [me, b, c]) is False
    assert m.reads == [((me, b, c), False), ((b, c), False)]
    assert drv._confirmed_round == 0


async def test_a_poll_reads_only_the_voters_not_yet_at_the_round():
    """A voter whose record shows the round is not read again: at --full-view-peers peers the check's reads shrink
    as the voters announce, rather than reading every voter's record at each poll."""
    me, b, c = (str(Identity.generate().peer_id) for _ in range(3))

    class Staggered(Voters):
        async def records_of(self, peer_ids, *, sampled=True):
            self.reads.append((tuple(peer_ids), sampled))
            n = len(self.reads)
            at = {me: 1, b: 1, c: 3}  # c announces round 9 at the third read
            return [
                peer_record(p, round=9 if n >= at[p] else 8, weights_digest="a" * 32 if n >= at[p] else "0" * 32)
                for p in peer_ids
            ]

    m = Staggered(me, "a" * 32, {}, announce_at=1, r=9)
    drv = _driver(m, "a" * 32)
    assert await finish.check_digest(drv, 9, [me, b, c]) is True
    assert m.reads == [((me, b, c), False), ((c,), False), ((c,), False)]
