"""Red team 48b: session 48's changes attacked -- a lone peer's start-time evidence (``RoundDriver._start_backed``),
the pre-flight's "can never work" verdict (``dht.preflight.permanent_failure``) and a finished peer's linger for a
peer announcing its last plan's start state (``node.report.catching_up``). The bootstrap's give-back of a disowned
rise is attacked over gRPC in tests/integration/test_redteam48b.py."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from geomesh_p2p.dht import preflight
from geomesh_p2p.net.transport import RpcError
from geomesh_p2p.node import report
from geomesh_p2p.telemetry import events
from tests.unit.test_round_driver import FakeClock, _digest, _peers
from tests.unit.test_stalled_peer import _finished

pytestmark = pytest.mark.timeout(60)


def _unavailable(reason: str) -> RpcError:
    return RpcError("boot.example:31337", "Ping", grpc.StatusCode.UNAVAILABLE, reason)


#: gRPC's words (grpcio 1.x, read here: c-ares with a DNS server that does not answer, and glibc's getaddrinfo) for
#: a name that could not be looked up *now*: the resolver is down or slow, not the name wrong
TRANSIENT_DNS = [
    "errors resolving boot.example:31337: [field:hostname lookup error:address lookup failed for boot.example:31337: "
    "Could not contact DNS servers]",
    "errors resolving boot.example:31337: [field:hostname lookup error:address lookup failed for boot.example:31337: "
    "Timeout while contacting DNS servers]",
    "errors resolving boot.example:31337: [field:hostname lookup error:Address lookup failed for boot.example:31337 "
    "os_error: Temporary failure in name resolution syscall: getaddrinfo]",
]

#: and for a name that does not exist (a typo): what the pre-flight ends on at once, exit 2
NO_SUCH_NAME = [
    "errors resolving boot.exmaple:31337: [field:hostname lookup error:address lookup failed for boot.exmaple:31337: "
    "Domain name not found]",
    "errors resolving boot.exmaple:31337: [field:hostname lookup error:Address lookup failed for boot.exmaple:31337 "
    "os_error: Name or service not known syscall: getaddrinfo]",
]


@pytest.mark.parametrize("reason", TRANSIENT_DNS)
def test_a_dns_server_that_does_not_answer_is_no_bootstrap_that_can_never_work(reason):
    """Red team 48b: ``_UNRESOLVABLE`` matched "address lookup failed" / "DNS resolution failed", the prefix gRPC
    puts before *every* failed look-up, so a resolver briefly down (a machine or container started before its
    network, a DNS outage) made the pre-flight exit 2 at once: "--bootstrap boot.example:31337: host name does not
    resolve", where a retry would have joined (before session 48: a WARNING, then the join's retries). Fixed: those
    words (``_DNS_TRANSIENT``) are no unresolvable name."""
    r = _unavailable(reason)
    assert not preflight.permanent_failure(r)
    assert not preflight.final_failure(r)  # the join retries it
    assert preflight.short_reason(r) != "host name does not resolve"
    assert preflight.preflight_verdict(["boot.example:31337"], [r], "run") is not None  # the WARNING, no exit


@pytest.mark.parametrize("reason", NO_SUCH_NAME)
def test_a_name_that_does_not_exist_still_ends_the_preflight(reason):
    r = _unavailable(reason)
    assert preflight.permanent_failure(r) and preflight.short_reason(r) == "host name does not resolve"
    with pytest.raises(preflight.BootstrapAddressError, match="host name does not resolve"):
        preflight.preflight_verdict(["boot.exmaple:31337"], [r], "run")


def test_one_bootstrap_that_can_work_keeps_the_preflight_going():
    """Several --bootstrap: one mistyped, one restarting (refused) or silent: no exit 2; one answered: no line."""
    typo = _unavailable(NO_SUCH_NAME[0])
    refused = _unavailable(
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Connection refused"
    )
    silent = RpcError("b:1", "Ping", grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
    for other in (refused, silent):
        assert preflight.preflight_verdict(["a:1", "b:1"], [typo, other], "run") is not None
    assert preflight.preflight_verdict(["a:1", "b:1"], [typo, object()], "run") is None


def test_a_rogue_announcing_the_last_plans_start_state_holds_a_finished_peer_no_longer_than_a_syncing_one():
    """Target 4 (holds): any identity may announce the last plan's start state (round N - 1, its start digest) and
    be served; the linger is the one a syncing record (round N, no digest) already bought since session 27, at most
    ``FINAL_STATE_LINGER_S``, and never for a leaving record or a participant of that plan."""
    start = (9, "ab" * 32)
    rec = lambda pid, **kw: type(
        "R", (), {"peer_id": pid, "leaving": False, "round": 9, "weights_digest": "ab" * 32, **kw}
    )  # noqa: E731
    records = [rec("rogue"), rec("left", leaving=True), rec("part"), rec("syncing", round=10, weights_digest=None)]
    assert report.catching_up(records, "me", 10, start, participants=["part"]) == ["rogue", "syncing"]
    assert report.catching_up(records, "me", 10) == ["syncing"]
    assert report.FINAL_STATE_LINGER_S <= 30


async def test_a_fork_restarted_under_another_identity_is_not_backed_by_its_own_old_leaving_record():
    """Red team 47b's guarantee, another identity: the others left at round 4; this peer trained round 4 alone
    (--min-peers 1) and was stopped at round 5 (Ctrl+C: its leaving record names round 5 and its digest). Restarted
    on that checkpoint under the same identity, its own record is left out: "NOT the swarm's" (47b). Under a new
    key (another machine, a lost key file) its old record is "another peer that left at this state": the start is
    backed (``_start_backed``, read at start since helper-ux48, so a restart within the record's ~30-40 s suffices),
    and it ends "this peer was the whole swarm", synced, exit 0. The checkpoint names the PeerID that wrote it
    (``joining.warn_if_other_identity``): that identity's record is no other peer's evidence (fixed: ``written_by``).
    (A rogue that copies the round and digest into a leaving record of its own is the same claim and cannot be told
    apart: security.md.)"""
    me, a, old = _peers(3)
    _finished(a, 4, 0.25)
    _finished(old, 5, 0.5)  # this peer's previous session, under its old identity
    for p in (a, old):
        rec = p.swarm.records[p.me]
        p.swarm.records[p.me] = rec.model_copy(update={"timestamp": rec.timestamp - 20})
    me.theta = old.theta.clone()
    me.round, me.digest, me.model = 5, _digest(me.theta), me.theta.clone()
    drv = me.driver(rounds=9, min_peers=2, wait_peers_s=3.0, clock=FakeClock())
    with events.capture("swarm_ended") as ended:  # written_by: what the checkpoint's meta says (RoundState)
        await asyncio.wait_for(drv.run(known_round=4, written_by=old.me), 30)
    assert drv.ended is not None and [(e["cause"], e["synced"]) for e in ended] == [("alone", False)]
    assert drv.ended.round == 6 and not drv.ended.synced
