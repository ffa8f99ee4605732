"""The attack suite of issue 11: 3 honest peers + 1 red-team peer (tests.adversary) as OS processes.

Each test runs a tiny-model swarm for ``ROUNDS`` rounds and asserts, for the honest peers: none exits
non-zero, all end at the last round, their weight digests are equal after every round, and their eval
perplexity after the last round is below ``PPL_LIMIT`` -- a bound that clean runs meet and that the first
version (no defences) never met under these attacks. It also checks that the attacker really acted (its
log says so), so an attack bypassed by a refactor cannot pass as "defeated".

Measured on 2 shared cores with these flags against the first version (commit af4213f, before the
defences; ``ROUNDS`` = 4; eval ppl after round 3, worst honest peer; reencode mode unless said):

==========================  ==============  ===============================================
run                         first version   note
==========================  ==============  ===============================================
clean, 3 honest peers       440-571         4 runs (reencode and relay); 660-960 after round 2
flipmax                     143,056         grows every round (4.2k, 8.3k, 43k, 143k)
forge-aggregate (reencode)  64,932          peaked at 1.3e8 after round 1
forge-aggregate (relay)     1,018 / 2,917   drops / tampers with the others' contributions
forge-aggregate (relay,     all 3 exit      1e246 after round 0, then every honest peer exits
  --forge-push flipmax)                     with OverflowError (math.exp): the variant run here
rogue-leader                6.6e8           leading rounds 0 and 1 only
inflate                     4,380           no progress from the initial ~4.5k
stale                       7,241           (slow set: 1.5k after round 2)
zeros                       899             (slow set: too close to clean in 4 rounds)
flip                        769             (slow set)
noise                       678             (slow set)
==========================  ==============  ===============================================

Only the attacks that separate from a clean run within a few rounds are run here (the whole file must stay
within ~4 minutes on 2 cores); the others (``SLOW_ATTACKS``) need ``benchmarks/attacks.py``'s 15 rounds to
show and run here only with ``GEOMESH_ALL_ATTACKS=1``. Every test has a timeout and its fixture stops every
process it started, pass or fail. Two fast tests at the end check the red-team behaviours themselves
(what each attack pushes, and that a forging owner's results are forged yet signed by it).
"""

from __future__ import annotations

import os

import pytest

from tests.attack_util import AttackSwarm, honest_log_tails, run_scenario

ROUNDS = 4
#: Worst honest eval perplexity allowed after ROUNDS rounds: clean runs of 3 honest peers ended at 440-571,
#: the undefended first version at >= 4,380 under every attack of FAST_ATTACKS (as run here).
PPL_LIMIT = 1000.0
#: The window PPL_LIMIT was measured with (the shared FAST flags now use 1.5 s): its perplexities need those steps.
#: And the evaluation PPL_LIMIT was measured with (8 batches; the FAST flags evaluate 2).
WINDOW = ["--window-s", "2.5", "--speed-factor", "1", "--eval-batches", "8"]  # full speed: the bound needs the steps
#: Seconds a swarm may take before its honest peers count as hung (a 4-round run takes 45-60 s on 2 idle
#: cores, up to ~120 s when other jobs share them; at load 12-20 the four start-ups alone took ~80 s and the
#: run did not end within 200 s: a hang guard, so generous).
SWARM_TIMEOUT_S = 400

FAST_ATTACKS = ["flipmax", "forge-aggregate", "rogue-leader", "inflate"]
#: Flags of the attacker. In relay mode (the default) a forging owner can only drop contributions; keeping
#: only its own 1000x one makes the forgery count (a plain flipped one moved the first version only to ~1k).
#: (run_scenario also makes it claim the bandwidth that gives it a part in round 0: attack_util.OWNS_A_PART.)
ATTACKER_FLAGS = {"forge-aggregate": ["--forge-push", "flipmax"]}
SLOW_ATTACKS = ["flip", "zeros", "stale", "noise", "stealth-flip", "partial"]

_ALL = os.environ.get("GEOMESH_ALL_ATTACKS") == "1"
_slow = pytest.mark.skipif(
    not _ALL, reason="shows only over more rounds: benchmarks/attacks.py (or GEOMESH_ALL_ATTACKS=1)"
)


@pytest.fixture
def swarm(tmp_path):
    s = AttackSwarm(tmp_path)
    try:
        yield s
    finally:
        s.stop_all()


@pytest.mark.timeout(SWARM_TIMEOUT_S + 60)
@pytest.mark.parametrize("attack", FAST_ATTACKS + [pytest.param(a, marks=_slow) for a in SLOW_ATTACKS])
def test_one_attacker_of_four_does_not_poison_or_split_the_honest_peers(swarm, attack):
    # rogue-leader: identities are rigged so that the attacker leads every round (else it is luck).
    o = run_scenario(
        swarm,
        attack,
        n_honest=3,
        n_attackers=1,
        rounds=ROUNDS,
        timeout_s=SWARM_TIMEOUT_S,
        lead_rounds=ROUNDS if attack == "rogue-leader" else 0,
        attacker_extra=ATTACKER_FLAGS.get(attack, []),
        extra=WINDOW,
    )
    logs = honest_log_tails(swarm, o)
    assert o.attacker_acted, (
        f"the attack never reached its key step (adversary.KEY_ACTION), so nothing was tested "
        f"(e.g. a forger that owned no part: give it more rounds):\n{o.attacker_log_tail}"
    )
    assert not o.honest_exited, f"honest peers exited {o.exit_codes} (None: still running at the timeout)\n{logs}"
    # Each honest peer ends the run in step with the others (it may sit out a round and re-sync meanwhile): it trained
    # the last round, or was planned out of it (a push the load made late: the no-part penalty, f24960e) and re-synced
    # to the state the others reached, exit 0 above; at least two honest peers trained it.
    last = {n: rows[-1]["round"] if rows else None for n, rows in o.rows.items()}
    out = {n: ROUNDS - 1 in swarm.planned_out(n) for n in o.rows}
    assert all(r == ROUNDS - 1 or out[n] for n, r in last.items()), f"last round logged: {last}, out {out}\n{logs}"
    assert sum(r == ROUNDS - 1 for r in last.values()) >= 2, f"last round logged: {last}\n{logs}"
    assert o.digests_equal, f"honest digests differ after rounds {o.digest_mismatches()}\n{logs}"
    assert o.final_ppl < PPL_LIMIT, (
        f"{attack}: honest eval ppl {o.final_ppl:.4g} after {ROUNDS} rounds "
        f"(limit {PPL_LIMIT:g}; per round {o.ppl_by_round()})"
    )


# ------------------------------------------------------------------ the red-team behaviours themselves (fast)


def _adversary(attack, tmp_path):
    from tests.adversary import AdversaryNode
    from geomesh_p2p.net.identity import Identity
    from geomesh_p2p.node.peer import NodeConfig, RunConfig

    return AdversaryNode(RunConfig(), NodeConfig(identity=str(tmp_path / "a.key")), Identity.generate(), attack=attack)


def test_poisoned_contributions_are_what_the_attacks_say(tmp_path):
    from types import SimpleNamespace

    import torch

    from tests.adversary import FLIPMAX_FACTOR, MAX_TOKENS

    delta = torch.linspace(-1, 1, 4096)

    def spec_for(node):
        return SimpleNamespace(round=3, participants={node.me: 5000})

    n = _adversary("flip", tmp_path)
    out, claim = n.poison(spec_for(n), delta, 1000)
    assert torch.equal(out, -delta) and claim == 1000
    n = _adversary("flipmax", tmp_path)
    out, claim = n.poison(spec_for(n), delta, 1000)
    assert torch.equal(out, delta * FLIPMAX_FACTOR) and claim == MAX_TOKENS
    n = _adversary("zeros", tmp_path)
    out, claim = n.poison(spec_for(n), delta, 1000)
    assert not out.any() and claim == MAX_TOKENS
    n = _adversary("noise", tmp_path)
    out, claim = n.poison(spec_for(n), delta, 1000)
    assert abs(float(out.norm()) - float(delta.norm())) < 1e-3 * float(delta.norm()) and claim == 5000
    assert float(torch.nn.functional.cosine_similarity(out, delta, dim=0)) < 0.2
    n = _adversary("stale", tmp_path)
    assert not n.poison(spec_for(n), delta, 0)[0].any()  # no previous update yet
    n.remember_update(delta * 0.5)
    out, claim = n.poison(spec_for(n), delta * 7, 0)
    assert torch.equal(out, delta * 0.5) and claim == 5000


def test_forged_owner_results_are_signed_by_the_owner_and_forged(tmp_path):
    import torch

    from geomesh_p2p.exchange import codec as compression
    from geomesh_p2p.exchange import CONTRIBUTION_KIND, RESULT_KIND
    from geomesh_p2p.net.identity import Identity
    from geomesh_p2p.wire import collective_pb2, envelope_pb2

    n = _adversary("forge-aggregate", tmp_path)
    v = torch.linspace(-1, 1, 4096)

    def signed(res):
        return n.identity.sign_message(
            run_id="r", round=2, kind=RESULT_KIND, payload=res.SerializeToString()
        ).SerializeToString()

    def read(b):
        m = envelope_pb2.SignedMessage.FromString(b)
        assert m.envelope.sender == bytes(n.identity.peer_id) and m.envelope.kind == RESULT_KIND
        return collective_pb2.PartResult.FromString(m.payload)

    # reencode: -20x the aggregate it should serve
    honest = collective_pb2.PartResult(
        round=2,
        part=0,
        start=0,
        end=4096,
        mode="reencode",
        aggregate_encoding="sign",
        aggregate=compression.encode(v, block_size=2048, tokens=9).to_bytes(),
    )
    forged = read(n.forge_result(signed(honest)))
    got = compression.decode_any(compression.packet_from_bytes(forged.aggregate))
    want = compression.decode(compression.encode(v, block_size=2048, tokens=9)) * -20
    assert torch.allclose(got, want, rtol=1e-5)

    # relay: only its own contribution survives
    other = Identity.generate()

    def contribution(ident):
        return collective_pb2.Contribution(
            signed_message=ident.sign_message(
                run_id="r", round=2, kind=CONTRIBUTION_KIND, payload=b"x"
            ).SerializeToString()
        )

    relay = collective_pb2.PartResult(
        round=2,
        part=0,
        start=0,
        end=4096,
        mode="relay",
        contributions=[contribution(other), contribution(n.identity)],
        contributors=[bytes(other.peer_id), bytes(n.identity.peer_id)],
        tokens=[5, 6],
    )
    forged = read(n.forge_result(signed(relay)))
    senders = [envelope_pb2.SignedMessage.FromString(c.signed_message).envelope.sender for c in forged.contributions]
    assert senders == [bytes(n.identity.peer_id)] and list(forged.tokens) == [6]
