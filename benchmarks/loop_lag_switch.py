"""Does a shorter GIL switch interval shorten the event loop's stalls? (issue 27, docs/real-size.md "Session 25").

The loop runs a 5 ms ticker and records how late each tick wakes while worker threads (``asyncio.to_thread``, as the
node runs its heavy phases) do ``kind``'s work for 6 s: ``outer`` (the fused Nesterov outer step over 20M fp32),
``pyloop`` (2,000 small in-place torch ops per pass with Python between them, like a per-parameter loop), ``train``
(AdamW steps of a 2-layer MLP with torch's 2 intra-op threads); ``a+b`` runs both at once. Usage::

    PYTHONPATH=$PWD python benchmarks/loop_lag_switch.py train+pyloop

Prints the ticks' lateness (max, 99th percentile and mean, ms) at the interpreter's default interval (5 ms) and at
0.5 ms, side by side, three times interleaved.
"""

import asyncio
import statistics
import sys
import time

import torch

from geomesh_p2p.model.optim import OuterNesterov, outer_step_per_part


def work(kind, secs):
    end = time.perf_counter() + secs
    if kind == "outer":
        P = 20_000_000
        theta = torch.zeros(P)
        agg = torch.randn(P) * 1e-3
        o = OuterNesterov(lr=0.7, momentum=0.9)
        while time.perf_counter() < end:
            outer_step_per_part(o, theta, agg, [(0, P)], 1)
    elif kind == "pyloop":  # many small torch ops with Python between them (per-parameter loops)
        ts = [torch.randn(1000) for _ in range(2000)]
        while time.perf_counter() < end:
            for t in ts:
                t.mul_(1.0001).add_(1e-6)
    elif kind == "train":
        m = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512))
        x = torch.randn(64, 512)
        opt = torch.optim.AdamW(m.parameters())
        while time.perf_counter() < end:
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()


async def lateness(kind: str, secs: float) -> list[float]:
    """The lateness (seconds, sorted) of a 5 ms ticker on the running loop while ``work`` runs each ``+``-joined
    workload of ``kind`` in the loop's default executor for ``secs`` seconds (the first 0.2 s left out)."""
    lags: list[float] = []

    async def ticker():
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(0.005)
            lags.append(time.perf_counter() - t0 - 0.005)

    tk = asyncio.create_task(ticker())
    await asyncio.sleep(0.2)
    lags.clear()
    await asyncio.gather(*(asyncio.to_thread(work, k, secs) for k in kind.split("+")))
    tk.cancel()
    return sorted(lags)


async def main(kind, secs=6.0):
    lags = await lateness(kind, secs)
    return max(lags) * 1e3, lags[int(0.99 * len(lags))] * 1e3, statistics.fmean(lags) * 1e3


if __name__ == "__main__":
    kind = sys.argv[1] if len(sys.argv) > 1 else "train+pyloop"
    torch.set_num_threads(2)
    for rep in range(3):  # interleaved: the machine's load drifts
        for si in (0.005, 0.0005):
            sys.setswitchinterval(si)
            mx, p99, mean = asyncio.run(main(kind))
            print(
                f"{kind} switch {si * 1e3:4.1f} ms, run {rep}: max {mx:6.1f} ms, p99 {p99:5.1f} ms, mean {mean:4.2f} ms"
            )
