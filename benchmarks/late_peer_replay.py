"""A slow honest peer that is late whenever its budget is over a share of its first one, replayed through one
leader's round rules (session 49; docs/security.md "A late peer gets less work, not a bench"): 4 peers of the same
record, the slow one's pushes reach the owners after the parts closed (no part lists it) whenever its token budget
is over ``--cap`` x its first budget. No processes and no clock: the plans and part results every peer would hold.
Prints the participants per round, the slow peer's planned-out and late rounds and the tokens it delivered. Runs on
any release (before session 49 the late peer is benched 3 rounds at each miss and comes back at the same budget).

    PYTHONPATH=$PWD python benchmarks/late_peer_replay.py --cap 0.6 --rounds 24
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from geomesh_p2p.config.models import NodeConfig, RunConfig  # noqa: E402
from geomesh_p2p.net.identity import Identity  # noqa: E402
from geomesh_p2p.round.rules import Reprofiler  # noqa: E402
from geomesh_p2p.trust.standing import Standing  # noqa: E402
from tests.records_util import peer_record  # noqa: E402
from tests.rules_util import make_rules  # noqa: E402

START = 5  # every peer delivered in rounds 0..4 at its record's rate


def replay(cap: float, rounds: int) -> dict:
    """{"participants": per round, "planned_out": rounds, "late": rounds, "delivered": tokens, "first": tokens}."""
    recs = [
        peer_record(i, address=f"127.0.0.1:{7000 + k}", tokens_per_s={4: 600.0, 8: 1000.0}, round=START)
        for k, i in enumerate(Identity.generate() for _ in range(4))
    ]
    ids = [x.peer_id for x in recs]
    slow = ids[3]
    standing = Standing()
    for r in range(START):
        standing.credit(r, ids)
    run = RunConfig(seq_len=32, window_s=5.0)
    node = make_rules(run, NodeConfig(), me=ids[0], round=START, numel=200_000, standing=standing)
    node.profile.supported_tps = (START - 1, {p: 1000.0 for p in ids})
    out: dict = {"participants": [], "planned_out": 0, "late": 0, "delivered": 0, "first": None}
    for _ in range(rounds):
        plan = node.planning.build_plan(recs, ids[0])
        budget = next((a.token_budget for a in plan.assignments if a.peer_id == slow), None)
        out["first"] = out["first"] or budget
        late = budget is not None and budget > cap * out["first"]
        out["participants"].append(len(plan.participants()))
        out["planned_out"] += budget is None
        out["late"] += late
        out["delivered"] += budget if budget is not None and not late else 0
        listed = [(a.peer_id, a.token_budget) for a in plan.assignments if not (late and a.peer_id == slow)]
        ar = SimpleNamespace(contributors={0: listed}, missing_parts=[])
        node.after_exchange(SimpleNamespace(round=plan.round, owners=[]), plan, ar)
        node.profile.supported_tps = (plan.round, Reprofiler.delivered_rates(plan, ar))
        node.state.round = plan.round + 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cap", type=float, nargs="+", default=[0.6, 0.3], help="late over this share of the first budget")
    ap.add_argument("--rounds", type=int, default=24)
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    for cap in args.cap:
        o = replay(cap, args.rounds)
        n, first = args.rounds, o["first"]
        print(
            f"cap {cap}: participants per round {''.join(map(str, o['participants']))}; slow peer: planned out "
            f"{o['planned_out']}/{n}, late {o['late']}/{n}, delivered {o['delivered']} tokens "
            f"({o['delivered'] / (first * n):.0%} of {n} budgets of {first})"
        )


if __name__ == "__main__":
    main()
