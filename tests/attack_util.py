"""Swarms of honest peers and red-team peers (tests.adversary) as OS processes on 127.0.0.1.

Shared by tests/test_attacks.py and benchmarks/attacks.py: :func:`run_scenario` starts ``n_honest``
honest peers (``peer.cli join``) and ``n_attackers`` attackers (``tests.adversary join --attack
A``), all with ``--rounds R``, waits for the honest ones to exit, and reads their per-round JSON rows.
The caller owns the :class:`AttackSwarm` and must call ``stop_all()`` (a fixture / finally does).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from tests.swarm_util import RUN_ID, ProcSwarm

#: Flags :func:`run_scenario` gives a ``forge-aggregate`` attacker (before ``attacker_extra``, whose flags win): a
#: stated bandwidth far above the loopback probe's (~0.9 Gbit/s; plans cap a claim at BANDWIDTH_SPREAD_CAP x the
#: median) makes the load balancer give it a part in round 0. A measured one left it no part once under CI load,
#: and after a flipped push in round 0 the support filter plans it out for the next 3 rounds: a 4-round test then
#: saw no forgery at all.
OWNS_A_PART = ("--upload-mbps", "10000", "--download-mbps", "10000")


class AttackSwarm(ProcSwarm):
    """A :class:`ProcSwarm` that can also start attackers."""

    def attacker(
        self,
        name: str,
        attack: str,
        *args: str,
        bootstrap: Optional[str] = None,
        port: int = 0,
        extra: Sequence[str] = (),
    ):
        return self.join(
            name, ["tests.adversary", "join", "--attack", attack], *args, *extra, bootstrap=bootstrap, port=port
        )

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values() if p.poll() is None]


def write_identity(path: Path, identity) -> None:
    """Store ``identity`` where ``Identity.load_or_create`` reads it (raw 32 bytes, mode 0600)."""
    from cryptography.hazmat.primitives import serialization

    raw = identity._private_key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(raw)


def rig_leaders(
    workdir: Path,
    honest: Sequence[str],
    attackers: Sequence[str],
    lead_rounds: int,
    run_id: str = RUN_ID,
    max_tries: int = 50_000,
) -> int:
    """Create identity files so that attackers lead as many of rounds ``0 .. lead_rounds-1`` as they can (leader
    election is rendezvous hashing over PeerIDs, so identities decide it; with every peer in the round; the last
    round's leader does not lead the next one: ``round/planning.last_round_leaders``, so one attacker leads every
    other round at most). Returns how many of those rounds an attacker leads."""
    from geomesh_p2p.net.identity import Identity
    from geomesh_p2p.round import leader_order

    hon = [Identity.load_or_create(workdir / f"{n}.key") for n in honest]
    best, best_n = None, -1
    for _ in range(max_tries):
        att = [Identity.generate() for _ in attackers]
        ids = [str(i.peer_id) for i in hon + att]
        bad = {str(i.peer_id) for i in att}
        n, last = 0, None
        for r in range(lead_rounds):  # the round's leader: rank first among all but the last round's (session 30)
            last = leader_order(run_id, r, [i for i in ids if i != last])[0]
            if r == 0 and last not in bad:
                break  # round 0 first: an attacker planned out after it (its update dropped) leads nothing later
            n += last in bad
        if n > best_n:
            best, best_n = att, n
        if n >= (lead_rounds if len(bad) > 1 else (lead_rounds + 1) // 2):  # one leader may not lead twice in a row
            break
    for name, ident in zip(attackers, best):
        write_identity(workdir / f"{name}.key", ident)
    return best_n


@dataclass
class Outcome:
    """One swarm run as the honest peers saw it."""

    attack: Optional[str]
    n_honest: int
    n_attackers: int
    rounds: int
    exit_codes: dict[str, Optional[int]]  # honest peers; None = still running at the timeout (then killed)
    attacker_exit_codes: dict[str, Optional[int]]
    rows: dict[str, list[dict]]  # honest peer -> its JSON rows
    attacker_acted: bool  # the attack reached its key step (adversary.KEY_ACTION) at least once
    wall_s: float
    attacker_log_tail: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def honest_exited(self) -> list[str]:
        """Honest peers that did not end cleanly (non-zero exit, or still running at the timeout)."""
        return [n for n, c in self.exit_codes.items() if c != 0]

    def ppl_by_round(self) -> dict[int, float]:
        """Round -> the worst honest eval perplexity of that round (inf for a null / non-finite one)."""
        out: dict[int, float] = {}
        for rows in self.rows.values():
            for x in rows:
                v = x.get("eval_ppl")
                v = float("inf") if v is None or not math.isfinite(v) else float(v)
                out[x["round"]] = max(out.get(x["round"], 0.0), v)
        return dict(sorted(out.items()))

    @property
    def final_ppl(self) -> float:
        """Worst honest eval perplexity after the last round (inf when no honest peer reached it)."""
        last = self.rounds - 1
        vals = [
            float("inf") if x.get("eval_ppl") is None else float(x["eval_ppl"])
            for rows in self.rows.values()
            for x in rows
            if x["round"] == last
        ]
        return max(vals) if vals else float("inf")

    def digest_mismatches(self) -> list[int]:
        """Rounds after which two honest peers logged different digests."""
        by_round: dict[int, set] = {}
        for rows in self.rows.values():
            for x in rows:
                by_round.setdefault(x["round"], set()).add(x["digest"])
        return sorted(r for r, d in by_round.items() if len(d) > 1)

    @property
    def digests_equal(self) -> bool:
        return not self.digest_mismatches()

    def completed_rounds(self) -> dict[str, int]:
        return {n: len(rows) for n, rows in self.rows.items()}


def run_scenario(
    swarm: AttackSwarm,
    attack: Optional[str],
    *,
    n_honest: int = 3,
    n_attackers: int = 1,
    rounds: int = 4,
    timeout_s: float = 240.0,
    lead_rounds: int = 0,
    extra: Sequence[str] = (),
    attacker_extra: Sequence[str] = (),
) -> Outcome:
    """Start the swarm in ``swarm.dir``, wait up to ``timeout_s`` for the honest peers to exit, collect.

    ``attack=None`` is the clean run (``n_attackers`` ignored). ``lead_rounds``: rig identities so that an
    attacker leads the first rounds (for ``rogue-leader``); a ``forge-aggregate`` or ``drop-owner`` attacker
    gets :data:`OWNS_A_PART` (so that it owns a part in round 0). ``extra``: more flags for every peer (run
    config flags must be the same everywhere). The processes are left to the caller's ``stop_all()``; honest
    peers still running at the timeout are reported with exit code None.
    """
    n_att = 0 if attack is None else n_attackers
    honest = [f"h{i}" for i in range(n_honest)]
    attackers = [f"a{i}" for i in range(n_att)]
    if n_att and lead_rounds:
        got = rig_leaders(swarm.dir, honest, attackers, lead_rounds)
        notes = [f"attackers lead {got} of rounds 0..{lead_rounds - 1} (rigged identities)"] if got else []
    else:
        notes = []
    if attack in ("forge-aggregate", "drop-owner"):
        attacker_extra = [*OWNS_A_PART, *attacker_extra]
    total = n_honest + n_att
    common = ["--rounds", str(rounds), "--min-peers", str(total), *extra]
    t0 = time.time()
    swarm.peer(honest[0], *common)  # port 0: it binds a free port and prints it
    entry = swarm.address(honest[0])
    # Interleave attackers with honest peers so that their start-up costs overlap the same way.
    order = honest[1:] + attackers
    for name in order:
        if name in attackers:
            swarm.attacker(name, attack, *common, bootstrap=entry, extra=attacker_extra)
        else:
            swarm.peer(name, *common, bootstrap=entry)
    deadline = t0 + timeout_s
    while time.time() < deadline:
        if all(swarm.procs[n].poll() is not None for n in honest):
            break
        time.sleep(0.5)
    codes = {n: swarm.procs[n].poll() for n in honest}
    # Attackers got --rounds too; give them a moment to finish on their own before stop_all.
    end = time.time() + 10
    while time.time() < end and any(swarm.procs[n].poll() is None for n in attackers):
        time.sleep(0.25)
    att_codes = {n: swarm.procs[n].poll() for n in attackers}
    text = "".join(swarm.text(n) for n in attackers)
    acted = True
    if attack:
        from tests.adversary import KEY_ACTION

        acted = any(
            e["attack"] == attack and e["action"] == KEY_ACTION[attack]
            for n in attackers
            for e in swarm.events(n, "adversary_acted")
        )
    return Outcome(
        attack=attack,
        n_honest=n_honest,
        n_attackers=n_att,
        rounds=rounds,
        exit_codes=codes,
        attacker_exit_codes=att_codes,
        rows={n: swarm.rows(n) for n in honest},
        attacker_acted=acted,
        wall_s=time.time() - t0,
        attacker_log_tail=text[-3000:],
        notes=notes,
    )


def honest_log_tails(swarm: ProcSwarm, outcome: Outcome, n: int = 1500) -> str:
    return "\n".join(f"--- {name}\n{swarm.text(name)[-n:]}" for name in outcome.exit_codes)
