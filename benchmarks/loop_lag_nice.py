"""Do compute threads at a higher nice shorten the event loop's stalls? (issue 27, docs/real-size.md "Session 27").

``K`` processes start at once (several peers on one host), each an event loop with a 5 ms ticker that records how
late each tick wakes while ``asyncio.to_thread`` workers do ``kind``'s work (``benchmarks/loop_lag_switch.py``'s
``train``: AdamW steps of an MLP with torch's intra-op threads; ``pyloop``: small torch ops with Python between
them) for ``secs`` seconds. A negative ``N`` nices only the threads that run no Python (torch's OpenMP teams,
reniced ~1 s in) and leaves the GIL-taking workers at 0. With nice ``N`` the default executor's workers raise their own nice to ``N`` when they
start (``benchmarks/thread_priority.py``: ``nice_initializer``), so their OpenMP teams inherit it; the loop thread
stays at 0. Nice 0 and nice N are interleaved three times. Usage::

    PYTHONPATH=$PWD python benchmarks/loop_lag_nice.py [K=3] [N=10] [secs=6] [kind=train+pyloop]

Prints each setting's worst tick lateness over the K processes (max, p99, mean, ms) and the ratios nice-N / nice-0.
"""

import asyncio
import concurrent.futures
import json
import statistics
import subprocess
import sys
import threading
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from loop_lag_switch import lateness  # noqa: E402
from thread_priority import nice_initializer, renice_threads, thread_nice  # noqa: E402


def omp_only(nice: int, secs: float) -> None:
    """Raise the nice of the threads that run no Python (torch's OpenMP teams) once they exist, leaving every Python
    thread (the loop, the GIL-taking workers) at 0."""
    time.sleep(min(1.0, secs / 4))
    renice_threads(nice, keep=[t.native_id for t in threading.enumerate() if t.native_id is not None])


async def one(kind: str, secs: float, nice: int) -> dict:
    loop = asyncio.get_running_loop()
    init = nice_initializer(nice)
    if nice < 0:  # "omp only": a negative N names the OpenMP-only variant of nice -N
        init, nice = nice_initializer(0), -nice
        threading.Thread(target=omp_only, args=(nice, secs), daemon=True).start()
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(4, initializer=init))
    lags = await lateness(kind, secs)
    return {
        "max": max(lags) * 1e3,
        "p99": lags[int(0.99 * len(lags))] * 1e3,
        "mean": statistics.fmean(lags) * 1e3,
        "loop_nice": thread_nice(),
    }


def swarm(k: int, nice: int, secs: float, kind: str) -> dict:
    cmd = [sys.executable, __file__, "--child", str(nice), str(secs), kind]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(k)]
    res = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    return {
        "max": max(r["max"] for r in res),
        "p99": max(r["p99"] for r in res),
        "mean": statistics.fmean(r["mean"] for r in res),
    }


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        torch.set_num_threads(2)
        print(json.dumps(asyncio.run(one(sys.argv[4], float(sys.argv[3]), int(sys.argv[2])))))
        sys.exit(0)
    a = sys.argv[1:]
    k, n = int(a[0]) if a else 3, int(a[1]) if len(a) > 1 else 10
    secs, kind = float(a[2]) if len(a) > 2 else 6.0, a[3] if len(a) > 3 else "train+pyloop"
    out: dict = {0: [], n: []}
    for rep in range(3):  # interleaved: the machine's load drifts
        for nice in (0, n):
            r = swarm(k, nice, secs, kind)
            out[nice].append(r)
            print(
                f"{k} procs {kind} nice {nice:2d}, run {rep}: max {r['max']:7.1f} ms, p99 {r['p99']:6.1f} ms, "
                f"mean {r['mean']:5.2f} ms",
                flush=True,
            )
    for key in ("max", "p99", "mean"):
        base, low = [statistics.median(x[key] for x in out[v]) for v in (0, n)]
        print(f"median {key}: nice 0 {base:7.2f} ms, nice {n} {low:7.2f} ms, ratio {low / base:.2f}")
