"""Sign codec throughput against torch.clone, measured side by side in one run.

    python benchmarks/codec.py [--numel 124000000] [--repeats 5] [--block-size 2048] [--device cpu]
                               [--markdown docs/codec-benchmark.md]

Throughput is GB/s of fp32 input (4 * P bytes / seconds), median over the repeats; each repeat
times every operation once, interleaved, so machine noise hits them alike. Baselines:
``torch.clone`` (allocates a new tensor, as encode/decode do) and ``copy_`` into a preallocated
tensor (pure memory bandwidth). Goals (issue 17): encode >= 0.8x copy_ and decode into a
preallocated buffer >= 0.8x copy_ (the older DESIGN goals against clone are printed too).
``--device cuda`` times the same functions (``encode``/``decode`` pick chunk sizes per device).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from geomesh_p2p.exchange.codec import SignPacket, decode, encode  # noqa: E402

NOTES = """
Notes:
- Throughput counts the fp32 input (4 * P bytes) over wall time; ratios are against
  ``torch.clone`` timed in the same repeats. ``clone`` and ``decode (new tensor)`` both write
  496 MB of freshly allocated memory, so both pay the kernel's first-touch page faults, which on
  a small VM cost more than the copy itself (compare ``copy_ (prealloc)``). ``decode (out=)``
  writes into a reused buffer, as a peer that keeps its aggregate buffer does.
- The CPU column is process CPU time over all threads (kernel time included): on a shared
  machine it is the steadier figure, since wall time also counts time spent descheduled.
- The CPU path splits the vector into chunks of up to 256K elements (1 MiB of fp32) that run on a pool
  of torch.get_num_threads() Python threads whose own OpenMP thread count is 1, so every torch op
  runs inline (no OpenMP fork/join per op; torch and numpy release the GIL inside ops); the threads
  take chunks from a shared counter. Without a per-thread OpenMP count (another parallel backend)
  chunks of < 32768 elements run inline on the same number of threads.
- Passes over main memory (CPU): encode reads the fp32 input once and writes P/8 + 4P/B bytes;
  decode reads P/8 + 4P/B bytes and writes the fp32 output once; decode with accumulate=True reads
  and writes the buffer once. In cache, per element, encode makes 3 more passes (torch.sum of the
  |v| rows, numpy.less, numpy.packbits over bytes) after the |v| pass that reads main memory, and
  decode 2 (int8 -> fp32 of the gathered +-1, then the scale multiply that writes the output)
  after the gather of P/8 8-byte table words; accumulate 3 (convert, multiply, add). copy_ reads
  4 and writes 4 bytes per element: the floor for encode is the 4-byte read plus its passes in
  cache, for decode the 4-byte write plus its passes in cache. On CUDA (16M-element chunks, each op
  one kernel over HBM) encode makes 4 element passes (abs, row sum, lt, packing multiply) and
  decode 2 (the gather of P/8 words, one multiply of int8 signs by the block scale).
"""

ENCODE_GOAL = 1.0  # x clone (DESIGN)
DECODE_GOAL = 0.8  # x clone (DESIGN)
COPY_GOAL = 0.8  # x copy_ into a preallocated tensor, encode and decode (out=) (issue 17)


def _timer(device: torch.device):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(fn):
        """(wall seconds, process CPU seconds over all threads, result)."""
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        res = fn()
        sync()
        return time.perf_counter() - t0, time.process_time() - c0, res

    return timed


def run(numel: int, repeats: int, block_size: int, device: str, seed: int = 0) -> list[str]:
    load0 = os.getloadavg()
    dev = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    v = torch.randn(numel, generator=gen).to(dev)
    timed = _timer(dev)
    pre = torch.empty_like(v)
    out = torch.empty_like(v)
    acc = torch.zeros_like(v)

    p = encode(v, block_size)  # warm-up (workspace, LUT)
    decode(p, device=dev, out=out)
    data = p.to_bytes()
    assert len(data) == p.nbytes()

    names = [
        "torch.clone",
        "copy_ (prealloc)",
        "encode",
        "decode (new tensor)",
        "decode (out=)",
        "decode (out=, accumulate)",
        "to_bytes",
        "from_bytes",
    ]
    ops = {
        "torch.clone": lambda: v.clone(),
        "copy_ (prealloc)": lambda: pre.copy_(v),
        "encode": lambda: encode(v, block_size),
        "decode (new tensor)": lambda: decode(p, device=dev),
        "decode (out=)": lambda: decode(p, device=dev, out=out),
        "decode (out=, accumulate)": lambda: decode(p, device=dev, out=acc, accumulate=True),
        "to_bytes": lambda: p.to_bytes(),
        "from_bytes": lambda: SignPacket.from_bytes(data),
    }
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(repeats):
        for n in names:  # one of each per repeat, interleaved
            t, c, res = timed(ops[n])
            times[n].append(t)
            cpu[n].append(c)
            del res

    fp32_bytes = 4 * numel
    med = {n: statistics.median(ts) for n, ts in times.items()}
    med_cpu = {n: statistics.median(ts) for n, ts in cpu.items()}
    clone = med["torch.clone"]
    lines = [
        f"P = {numel:,} fp32 elements, block size {block_size}, device {dev} "
        f"({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}), "
        f"median of {repeats} interleaved repeats; load average before/after "
        f"{load0[0]:.2f} / {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs",
        "",
        f"compressed {p.nbytes():,} bytes / fp32 {fp32_bytes:,} bytes = 1/{fp32_bytes / p.nbytes():.2f} "
        f"({p.nbytes() / fp32_bytes:.4f})",
        "",
        "| operation | median ms | GB/s of fp32 | x torch.clone | CPU ms (all threads) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for n in names:
        t = med[n]
        lines.append(f"| {n} | {t * 1e3:.1f} | {fp32_bytes / t / 1e9:.2f} | {clone / t:.2f} | {med_cpu[n] * 1e3:.0f} |")
    enc, dec = clone / med["encode"], clone / med["decode (new tensor)"]
    cenc, cdec = med["copy_ (prealloc)"] / med["encode"], med["copy_ (prealloc)"] / med["decode (out=)"]
    # The same ratios by process CPU time: on shared cores the steadier figure (see the notes).
    ucenc = med_cpu["copy_ (prealloc)"] / max(med_cpu["encode"], 1e-9)
    ucdec = med_cpu["copy_ (prealloc)"] / max(med_cpu["decode (out=)"], 1e-9)

    def verdict(x, goal):
        return f"goal >= {goal}x: {'met' if x >= goal else 'MISSED'}"

    lines += [
        "",
        f"against copy_ into a preallocated tensor (issue 17): encode {cenc:.2f}x ({verdict(cenc, COPY_GOAL)}), "
        f"decode (out=) {cdec:.2f}x ({verdict(cdec, COPY_GOAL)}); by CPU time encode {ucenc:.2f}x, "
        f"decode (out=) {ucdec:.2f}x; "
        f"against clone (DESIGN): encode {enc:.2f}x ({verdict(enc, ENCODE_GOAL)}), "
        f"decode {dec:.2f}x ({verdict(dec, DECODE_GOAL)})",
    ]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=124_000_000, help="elements (default: GPT-2 small, 124M)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=2048)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--markdown", metavar="PATH", help="also write the results as markdown to PATH")
    args = ap.parse_args(argv)
    lines = run(args.numel, args.repeats, args.block_size, args.device, args.seed)
    print("\n".join(lines))
    if args.markdown:
        cmd = "python benchmarks/codec.py " + " ".join(argv if argv is not None else sys.argv[1:])
        with open(args.markdown, "w") as f:
            f.write("# Sign codec benchmark\n\n")
            f.write(f"Reproduce with:\n\n```\n{cmd}\n```\n\n")
            f.write("\n".join(lines) + "\n")
            f.write(NOTES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
