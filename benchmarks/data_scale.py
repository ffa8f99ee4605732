#!/usr/bin/env python3
"""Data of any size (issue 27): tokenizing a large local text file into the on-disk token file, against the
in-memory load it replaces, side by side in one run.

For a synthetic ASCII corpus of ``--size-mb`` MB (default 1,024) this prints, each measured in a fresh child
process from its own ``ru_maxrss``:

* **cold**: ``load_dataset(file)`` with an empty cache (hash, tokenizer trained on the head, tokenize in
  pieces, write ``tokens-<key>.bin``): seconds, token file bytes, peak RSS growth, and that growth over the
  token file's size (goal: <= 1.2x);
* **warm**: the same call again (the token file reused after re-hashing the source), then 2,000 training
  batches of 16 x 256 drawn from it: seconds and peak RSS growth;
* **in-memory baseline** (the code before issue 27: ``load_text`` + ``encode_corpus`` + an int32 array) on
  ``--baseline-mb`` MB (default 64): its RSS growth per byte of text, and what that rate means at
  ``--size-mb``.

Usage::

    PYTHONPATH=$PWD python benchmarks/data_scale.py                  # 1 GB: ~10 min on 2 cores
    PYTHONPATH=$PWD python benchmarks/data_scale.py --size-mb 128     # ~1.5 min
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

WORDS = (
    "the of and to in a is that for it as was with be by on not he I this are or his from at which but have an "
    "they you were her she there one all we their been has would when if more will no out so said what up its "
    "about into than them can only other new some could time these two may then do first any my now such like "
    "our over man me even most made after also did many before must through back years where much your way well"
).split()


def write_corpus(path: Path, size_mb: int, seed: int = 0) -> int:
    """Write ``size_mb`` MB of synthetic ASCII prose (16 distinct 1 MB blocks in a seeded order, with numbers
    and punctuation, so the tokenizer's word memo stays realistic); returns its size in bytes."""
    rng = np.random.default_rng(seed)
    blocks = []
    for _ in range(16):
        lines = []
        n = 0
        while n < 1 << 20:
            k = int(rng.integers(4, 18))
            words = rng.choice(WORDS, size=k)
            line = " ".join(words).capitalize() + rng.choice([".", ",", ";", "!", "?"]) + f" {int(rng.integers(1e4))}"
            lines.append(line)
            n += len(line) + 1
            if rng.random() < 0.1:
                lines.append("")
        blocks.append("\n".join(lines) + "\n")
    total = 0
    with open(path, "w") as f:
        while total < size_mb << 20:
            b = blocks[int(rng.integers(len(blocks)))]
            f.write(b)
            total += len(b)
    return total


CHILD = textwrap.dedent(
    """
    import json, resource, sys, time
    from pathlib import Path
    import numpy as np
    def rss(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    mode, path, cache = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    from geomesh_p2p.data import encode_corpus, get_tokenizer, load_dataset, load_text
    base = rss(); t0 = time.perf_counter(); out = {}
    if mode == "baseline":
        text = load_text(path)
        tok = get_tokenizer(text[: 32 << 20], cache_dir=cache)
        ids = np.asarray(encode_corpus(tok, text), dtype=np.int32)
        out["tokens"] = int(ids.size)
    else:
        ds = load_dataset(path, seq_len=256, cache_dir=cache)
        out["tokens"] = int(ds.ids.shape[0]); out["mapped"] = bool(ds.mapped)
        out["load_s"] = time.perf_counter() - t0; out["load_grew"] = rss() - base
        if mode == "warm":
            t1 = time.perf_counter()
            for step in range(2000):
                ds.sample_batch(seed=1, peer_id="p", round=0, step=step, batch_size=16, seq_len=256)
            out["batches_s"] = time.perf_counter() - t1
    out["s"] = time.perf_counter() - t0; out["grew"] = rss() - base
    print(json.dumps(out))
    """
)


def child(mode: str, path: Path, cache: Path) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(path), str(cache)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        raise SystemExit(f"{mode} child failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=1024, help="size of the large corpus in MB (default 1024)")
    ap.add_argument("--baseline-mb", type=int, default=64, help="size for the in-memory baseline (default 64)")
    ap.add_argument("--workdir", type=Path, default=None, help="where the corpus and cache go (default: a temp dir)")
    ns = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=ns.workdir) as d:
        work = Path(d)
        big, small = work / "big.txt", work / "small.txt"
        size = write_corpus(big, ns.size_mb)
        small_size = write_corpus(small, ns.baseline_mb, seed=1)
        cold = child("cold", big, work / "cache")
        [bin_path] = (work / "cache").glob("tokens-*.bin")
        token_bytes = bin_path.stat().st_size
        warm = child("warm", big, work / "cache")
        base = child("baseline", small, work / "cache-base")
    per_byte = base["grew"] / small_size
    mib = 1 << 20
    print(f"corpus: {size / mib:,.0f} MiB of text, {cold['tokens']:,} tokens; token file {token_bytes / mib:,.0f} MiB")
    print()
    print("| run | text MiB | seconds | peak RSS growth MiB | growth / token file | growth / text byte |")
    print("|---|---|---|---|---|---|")
    print(
        f"| cold: hash, train tokenizer, tokenize to the token file | {size / mib:,.0f} | {cold['s']:.0f} | "
        f"{cold['grew'] / mib:,.0f} | {cold['grew'] / token_bytes:.2f}x | {cold['grew'] / size:.2f} |"
    )
    print(
        f"| warm: re-hash, map the token file | {size / mib:,.0f} | {warm['load_s']:.1f} | "
        f"{warm['load_grew'] / mib:,.0f} | {warm['load_grew'] / token_bytes:.2f}x | {warm['load_grew'] / size:.3f} |"
    )
    print(
        f"| warm + 2,000 batches of 16 x 256 | {size / mib:,.0f} | {warm['s']:.1f} | {warm['grew'] / mib:,.0f} | "
        f"{warm['grew'] / token_bytes:.2f}x | {warm['grew'] / size:.3f} |"
    )
    print(
        f"| in-memory baseline (load_text + encode_corpus) | {small_size / mib:,.0f} | {base['s']:.0f} | "
        f"{base['grew'] / mib:,.0f} | - | {per_byte:.1f} |"
    )
    print()
    print(
        f"the in-memory load at {size / mib:,.0f} MiB: ~{per_byte * size / 2**30:,.1f} GiB by its rate; "
        f"the token file path: {cold['grew'] / mib:,.0f} MiB ({per_byte * size / max(1, cold['grew']):,.0f}x less)"
    )


if __name__ == "__main__":
    main()
