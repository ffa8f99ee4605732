"""Accountable grouped rounds in a swarm of 16 peer processes (issue 26, docs/collective.md "Accountable grouped
rounds").

15 honest tiny-model peers and one ``forge-aggregate`` attacker (tests.adversary: as a slice owner it forges its
group aggregate, as a leader its cross results), ``--mode accountable --group-size 5``: 16 participants are 4
groups of 4, 15 are 3 of 5, 14 are 3 of 5, 5 and 4, so every round of the run is grouped. An honest slice leader is
SIGKILLed as the first grouped exchange after round 0 that one leads starts (round 1, or round 2 when round 1 went
flat: under CI load 5 of 16 peers still synced in round 1, and a round with fewer established participants than
groups stays one group). What must hold for the 14 honest survivors: every one exits 0,
their digests are bitwise equal after every round, the rounds after the kill train (rows with contributors and
without the victim), every one of them excludes the forger on a proof (and nobody else), and no honest log has an
ERROR or a traceback.
"""

from __future__ import annotations

import re

import pytest

from tests.attack_util import OWNS_A_PART, AttackSwarm

#: a hang guard: one swarm took 142-490 s on 2 shared cores at load 17-45 (57-84 s since the exit-lag fix, alone or
#: in the suite), and a second swarm may be needed (TRIES)
pytestmark = pytest.mark.timeout(600)

N = 16
ROUNDS = 4
#: the rounds whose grouped exchange may be the kill's: one after it must still train
KILL_ROUNDS = (1, 2)
#: a log line at ERROR or CRITICAL (peer.cli's format: "HH:MM:SS L name: message")
_ERROR = re.compile(r"^\d\d:\d\d:\d\d [EC] ", re.M)


#: fresh swarms (new identities, so new groups and slices) when the forger owned no slice in round 0, forged a slice
#: of zeros, or no honest peer led a grouped round of KILL_ROUNDS (below); an abandoned swarm stops at the forger's
#: round 0 (~30 s) or at round 3. 3 since session 45: a CI run drew 2 swarms in a row whose forger owned none (~1 in
#: 5 swarms does, so 2 tries failed ~4 % of runs); 4 since session 52 (two more reasons to start afresh under load); 5
#: since session 54 (a CI run at load ~10 used all 4, ~38 s each: the failure now names each try's reason)
TRIES = 5


def _leads(text: str, r: int) -> bool:
    return any(f"round {r}: grouped exchange" in line and "leads it" in line for line in text.splitlines())


#: the forger's note of a forged part (tests.adversary.Adversary.forge_result): the nonzero elements of the true
#: aggregate it multiplied
_FORGED = re.compile(
    r"round 0: forge: serving \S+ the true aggregate of part \d+ \[\d+, \d+\) \(\d+ elements, (\d+) nonzero\)"
)


def _round_0_over(swarm: AttackSwarm) -> bool:
    """Whether the forger is past round 0 (its row of round 0, or any line of a later round)."""
    return any(x.get("round") == 0 for x in swarm.rows("a0")) or bool(re.search(r"round [1-9]\d*: ", swarm.text("a0")))


def _peer_id(swarm: AttackSwarm, name: str) -> str:
    from geomesh_p2p.net.identity import Identity

    return str(Identity.load_or_create(swarm.dir / f"{name}.key").peer_id)


def test_a_killed_leader_and_a_forging_owner_leave_the_honest_survivors_equal_and_training(tmp_path):
    """16 peers in accountable grouped rounds: the forger is proven and excluded by every honest peer, an honest
    leader killed mid-round is planned out, and the 14 honest survivors stay on one digest every round and train.

    The forger forges only as a slice owner, and only in round 0: its own flipped push counts in no part, so it is
    planned out of rounds 1-3 as a no-show. Not every participant of a grouped round owns a slice (a group with more
    owners than the fewest any group has, and peers the plan gives no part), and a round-0 forger without one did
    nothing to prove (run 8 of session 26: 3 of 15 owned none, the forger among them; nobody excluded it). So a
    swarm whose forger owned no slice in round 0 is stopped and a fresh one started, up to TRIES swarms."""
    why: list[str] = []
    for attempt in range(TRIES):
        swarm = AttackSwarm(tmp_path / f"swarm{attempt}")
        swarm.dir.mkdir()
        skipped: str | None = "raised"
        try:
            skipped = _forger_owned_a_slice_then_check(swarm)
        finally:
            # an abandoned swarm is only stopped: SIGKILL at once, not a 16-peer Ctrl+C that finishes its exchange
            swarm.stop_all(40.0 if skipped is None else 0.0)
        if skipped is None:
            return
        why.append(skipped)
    pytest.fail(f"in {TRIES} fresh swarms no try could be checked: {why}")


def _forger_owned_a_slice_then_check(swarm: AttackSwarm) -> str | None:
    """Start the swarm; why it is to be stopped (the forger owned no slice in round 0, ...), else every assertion of
    the test, then None."""
    honest = [f"h{i:02d}" for i in range(N - 1)]
    common = ["--rounds", str(ROUNDS), "--min-peers", str(N), "--mode", "accountable", "--group-size", "5"]
    swarm.peer(honest[0], *common)
    entry = swarm.address(honest[0])
    for n in honest[1:8]:
        swarm.peer(n, *common, bootstrap=entry)
    swarm.attacker("a0", "forge-aggregate", *common, bootstrap=entry, extra=OWNS_A_PART)
    for n in honest[8:]:
        swarm.peer(n, *common, bootstrap=entry)

    def forger_round_0() -> str | None:
        return next((ln for ln in swarm.text("a0").splitlines() if ("round 0: grouped exchange" in ln
                     or "round 0: not in the plan" in ln)), None)  # fmt: skip

    swarm.wait_for(lambda: forger_round_0() is not None, 400, "the forger's round 0")
    if "owns slice" not in str(forger_round_0()):
        return "the forger owned no slice in round 0"
    # ... and its slice's true aggregate was not all zeros: -20x of zeros is the truth, nothing to prove (the CI run of
    # stop 62 and a rerun at load ~20: 7 of 16 peers trained 0 steps in the loaded round 0, the forger's group all)
    swarm.wait_for(lambda: _round_0_over(swarm), 400, "the end of the forger's round 0")
    if not any(int(k) > 0 for k in _FORGED.findall(swarm.text("a0"))):
        return "the forger's slice aggregated zeros in round 0"

    def leader() -> tuple[str, int] | None:
        return next(((n, r) for r in KILL_ROUNDS for n in honest if _leads(swarm.text(n), r)), None)

    # a swarm whose rounds 1-2 went flat (round-0 no-shows under load planned out, fewer established participants
    # than groups) has no grouped leader to kill: once an honest peer is past them, a fresh swarm (CI, session 51)
    after = f"round {KILL_ROUNDS[-1] + 1}:"
    swarm.wait_for(
        lambda: leader() is not None or any(after in swarm.text(n) for n in honest),
        400,
        f"an honest slice leader's grouped exchange in rounds {KILL_ROUNDS}",
    )
    found = leader()
    if found is None:
        return f"no honest slice leader led a grouped round of {KILL_ROUNDS}"
    victim, kill_round = found
    swarm.kill(victim)
    rest = [n for n in honest if n != victim]
    codes = swarm.wait_exit(rest, 400)
    assert codes == {n: 0 for n in rest}, {n: swarm.text(n)[-2000:] for n, c in codes.items() if c != 0}

    # bitwise equal: one digest string per round over all survivors, every round of the run
    digests = swarm.digests_by_round(rest)
    assert sorted(digests) == list(range(ROUNDS)), sorted(digests)
    assert all(len(d) == 1 for d in digests.values()), {r: sorted(d) for r, d in digests.items()}
    rows = {n: swarm.rows(n) for n in rest}
    # round 0 and the kill's round were grouped, for every peer in them (a later round of 14 established
    # participants is 3 groups too, but one where peers still sync may go flat: see the module's docstring)
    for n, rs in rows.items():
        text = swarm.text(n)
        assert all(f"round {x['round']}: grouped exchange: " in text for x in rs if x["round"] in (0, kill_round)), (
            n,
            text[-2000:],
        )
    # training went on after the kill: every round after it has rows, each with contributors
    after = {n: [x for x in rs if x["round"] > kill_round] for n, rs in rows.items()}
    assert {x["round"] for xs in after.values() for x in xs} == set(range(kill_round + 1, ROUNDS)), sorted(digests)
    assert all(x["contributors"] > 0 for xs in after.values() for x in xs), {
        n: [(x["round"], x["contributors"]) for x in xs] for n, xs in after.items()
    }
    # and every survivor trained in some round. Not in every round after the kill: a survivor that refuses a plan
    # it reads against older records ("token budget 384 ... exceeds the 331 its bounded throughput supports") sits
    # that round out and is planned out of the next one (run 8 of session 26: rounds 2 and 3 of 4). A peer planned
    # out for good has no row at all (before the device re-measurement of node/device_probe.py: the first peer,
    # its start-up profile taken while 15 peers started, trained 0 of 4 rounds)
    assert all(rows.values()), {n: [x["round"] for x in rs] for n, rs in rows.items()}
    # the victim and the forger are planned by nobody in the last round, except the forger by a leader that had not
    # read its proof yet: an exclusion takes effect through leaders as each reads the proof (TrustVerdicts), and a
    # peer still syncing in round 0 never saw the forger's round-0 no-show either. The victim, killed mid-exchange,
    # never announced a later round, so no gather after its kill holds it. This was a count (at most N - 2 peers):
    # CI failed once with 15 after a kill in round 1, which can only be the forger so planned.
    last_round = ROUNDS - 1
    last = [x for xs in after.values() for x in xs if x["round"] == last_round]
    assert last, sorted(digests)
    forger_in = any(x["round"] == last_round for x in swarm.rows("a0")) or (
        f"round {last_round}: grouped exchange" in swarm.text("a0")
    )
    assert all(x["peers"] <= N - 2 + forger_in for x in last), (kill_round, forger_in, [x["peers"] for x in last])
    assert f"round {last_round}:" not in swarm.text(victim), swarm.text(victim)[-2000:]
    forger = _peer_id(swarm, "a0")[:10]
    if forger_in:
        # ... and nobody that trained it held the forger's exclusion when the round began: its leader none (a leader
        # leaves every peer it excluded out of its plans), a follower no proof (past round 0 + 2 it refuses a plan
        # naming a peer excluded on a proof, TrustVerdicts.plan_problem; an exclusion on its own verified work, which
        # it may have logged first, does not refuse plans; nor a proof of round 1 in round 3). Each log is in time order.
        leaders = {_peer_id(swarm, n)[:10] for n in rest} & {x["leader"] for x in last}
        assert len(leaders) == len({x["leader"] for x in last}), ({x["leader"] for x in last}, victim)
        for n in rest:
            if not any(x["round"] == last_round for x in rows[n]):
                continue
            text = swarm.text(n)
            held = [
                m.start()
                for m in re.finditer(rf"verified work: {forger} is excluded from the plans this peer makes: (.*)", text)
                if _peer_id(swarm, n)[:10] in leaders
                or (
                    (k := re.match(r"owner \w+ proven \(round (\d+),", m.group(1))) and int(k.group(1)) + 2 < last_round
                )
            ]
            assert not held or held[0] > text.find(f"round {last_round}:"), (n, text[-3000:])

    # the forger is excluded by every honest survivor, on a proof, and nobody else is excluded by anyone
    excluded = re.compile(r"verified work: (\S+) is excluded from the plans this peer makes: (.*)")
    for n in rest:
        text = swarm.text(n)
        found = {m.group(1): m.group(2) for m in excluded.finditer(text)}
        assert set(found) == {forger}, (n, found)
        assert "Traceback" not in text and not _ERROR.search(text), text[-3000:]
    assert any(
        "proven" in re.search(rf"{forger} is excluded from the plans this peer makes: (.*)", swarm.text(n)).group(1)
        for n in rest
    ), {n: excluded.findall(swarm.text(n)) for n in rest}
    return None
