"""Honest plans refused by honest followers whose view differs from the leader's (red team 37, session 38): random
honest swarms (tests/integration/test_plan_views_redteam37.random_swarm, 2-10 peers) planned from one view and checked
(full check) from a view that differs by one thing the protocol allows; prints the refusals of each perturbation.

    PYTHONPATH=$PWD python benchmarks/plan_views.py --seeds 400
"""

from __future__ import annotations

import argparse
import collections
import inspect
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from geomesh_p2p.plan.planner import check_plan, make_plan  # noqa: E402
from tests.integration.test_plan_bounds import KW, T0, by_id  # noqa: E402
from tests.integration.test_plan_views_redteam37 import NUMEL, random_swarm  # noqa: E402

HAS_UNSEEN = "unseen" in inspect.signature(check_plan).parameters


def perturbed(kind: str, seed: int):
    """(leader's records, follower's records, cfg, leader's map, follower's map, follower's unseen rates) or None."""
    recs, cfg, sup, R = random_swarm(seed)
    lead, follow, lmap, fmap, unseen = recs, recs, sup, sup, {}
    if kind == "follower lacks one rate":
        if not sup:
            return None
        gone = R.choice(sorted(sup))
        fmap = {p: v for p, v in sup.items() if p != gone}
        # it missed the part listing it: its last plan's rate (at least the delivered one) is unseen
        unseen = {gone: sup[gone] * R.uniform(1.0, 1.5)}
    elif kind == "leader without a map":
        lmap = None
    elif kind == "record 1-2x newer at the leader":
        i = R.randrange(len(recs))
        g = R.uniform(1.0, 2.0)
        r = recs[i]
        lead = (
            recs[:i]
            + [r.model_copy(update={"tokens_per_s": {b: g * v for b, v in r.tokens_per_s.items()}})]
            + recs[i + 1 :]
        )
    elif kind == "links moved 1/4-4x at the leader":
        i = R.randrange(len(recs))
        g = math.exp(R.uniform(math.log(0.25), math.log(4.0)))
        r = recs[i]
        lead = (
            recs[:i]
            + [r.model_copy(update={"upload_bps": g * r.upload_bps, "download_bps": g * r.download_bps})]
            + recs[i + 1 :]
        )
    return lead, follow, cfg, lmap, fmap, unseen


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=400)
    args = ap.parse_args()
    kinds = ("same view", "follower lacks one rate", "leader without a map", "record 1-2x newer at the leader",
             "links moved 1/4-4x at the leader")  # fmt: skip
    for kind in kinds:
        refused, n, why = 0, 0, collections.Counter()
        for seed in range(args.seeds):
            got = perturbed(kind, seed)
            if got is None:
                continue
            lead, follow, cfg, lmap, fmap, unseen = got
            try:
                plan = make_plan(lead, cfg, numel=NUMEL, supported_tokens_per_s=lmap, **KW)
            except ValueError:
                continue
            n += 1
            extra = {"unseen": unseen} if HAS_UNSEEN else {}
            reason = check_plan(plan, by_id(follow), cfg, now=T0, supported=fmap, **extra)
            if reason is not None:
                refused += 1
                why[" ".join(str(reason).split()[3:7])] += 1
        print(f"{kind}: {refused} of {n} refused; {why.most_common(3)}")


if __name__ == "__main__":
    main()
