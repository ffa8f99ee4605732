"""Session 54: alternatives to the per-batch ``low`` rule (partial work, issue 28) measured on ``verify_gain.py --rows``
files, without training again. ``low`` keeps the lowest ``max(2, ceil(share x k), ceil(min_rows / rows))`` of the ``k``
drawn settled batches (``rows`` per batch); the shipped rule is share 0.5, min_rows 0. Prints, per file, rule, H and
candidate (honest and partial work), ``low``'s minimum and 1st percentile and the share of 400 draws a round that fail
/ fail or mark by the whole t and ``low`` together (no power reference)::

    PYTHONPATH=$PWD python benchmarks/verify_gain.py --batch 8 --rows rows8.json      # and --batch 4, --seq-len 32
    PYTHONPATH=$PWD python benchmarks/verify_gain_low_rules.py rows8.json,rows4.json
"""

import json
import math
import random
import sys

from geomesh_p2p.trust.gain import gain_of, welch_t
from geomesh_p2p.trust.verify_task import VerifyConfig

cfg = VerifyConfig()


def low(asg, ctrl, js, H, share, min_rows, min_tokens=0, seq_len=0):
    """``low`` of the drawn steps ``js`` of a claim of ``H`` steps under the rule (share, min_rows, min_tokens: the
    lowest batches holding at least that many tokens of ``seq_len`` a row); None: fewer than 2 settled batches."""
    kept = [asg[j] for j in js if j < H - cfg.gain_settle_steps]
    if len(kept) < 2:
        return None
    means = [sum(b) / len(b) for b in kept]
    order = sorted(range(len(kept)), key=lambda j: (means[j], j))
    n = max(2, math.ceil(share * len(kept) - 1e-9), math.ceil(min_rows / len(kept[0])))
    if min_tokens:
        n = max(2, math.ceil(min_tokens / (len(kept[0]) * seq_len)))
    return welch_t([g for j in order[:n] for g in kept[j]], [g for b in ctrl for g in b])


RULES = [(0.5, 0, 0), (0.25, 12, 0), (0, 0, 1024), (0, 0, 1536)]


def main() -> None:
    for path in sys.argv[1].split(","):
        d = json.load(open(path))
        for share, mr, mt in RULES:
            rng, out = random.Random(0), {}
            for key, v in d["rows"].items():
                _, H, name = key.split("/", 2)
                ctrl, asg, H = v["control"][: d["m"]], v["assigned"], int(H)
                if H == 5 or not (name.startswith("honest") or name.startswith("partial")):
                    continue
                for _ in range(400):
                    js = sorted(rng.sample(range(H), min(d["k"], H)))
                    g = gain_of([asg[j] for j in js], ctrl)
                    lo = low(asg, ctrl, js, H, share, mr, mt, d.get("seq_len", 64))
                    old = 2 if g.t < cfg.gain_t_hard else 1 if g.t < cfg.gain_t_min else 0
                    by_low = 0 if lo is None or lo >= cfg.gain_low_min else 2 if lo < cfg.gain_low_hard else 1
                    out.setdefault((H, name), []).append((lo, max(old, by_low) if g.t >= cfg.gain_t_hard else old))
            print(f"{path} batch {d['batch']} seq {d.get('seq_len')} share {share} min_rows {mr} min_tokens {mt}")
            for (H, name), rows in sorted(out.items()):
                lows = sorted(x[0] for x in rows if x[0] is not None)
                fail = sum(x[1] >= 2 for x in rows) / len(rows)
                mark = sum(x[1] >= 1 for x in rows) / len(rows)
                print(f"  H={H:2d} {name:14s} low min {lows[0]:6.2f} p1 {lows[len(lows) // 100]:6.2f} "
                      f"fail/mark {fail:.3f}/{mark:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
