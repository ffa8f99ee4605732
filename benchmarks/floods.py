"""Request floods against a bootstrap and a peer on 127.0.0.1 (issue 12, "Bounded resources everywhere").

For each flood, a fresh bootstrap (``python -m bootstrap.cli``) and a fresh peer-like node (this
script with ``--serve peer``: DHT, collective, state server and link probe on one transport, joined
to the bootstrap, serving a state of ``--state-params`` parameters) are started. A clean phase
measures both; then the flood runs against both at once, bounded in count and time, while an honest
client keeps pinging both. Printed per flood and target: peak RSS (VmHWM) after the clean phase and
after the flood, their ratio, DHT ping p50/p99 during the clean phase and during the flood, and what
the flood achieved. The issue's goals: RSS within 1.5x of clean, ping p99 under 1 s.

Floods (all from this process, on 127.0.0.1, the same IP as the honest pinger: the worst case for
the per-IP limits):

* ``oversized``: ``--waves`` waves of 5 + 5 concurrent signed 100 MiB requests, each on its own
  connection (bootstrap: Ping and Store; peer: PushPart and Ping);
* ``connections``: 3,000 TCP connections to each target held open for ``--seconds`` (half send the
  HTTP/2 preface and stay idle, half send nothing);
* ``store``: one identity stores 64 KiB records (64 per request, 4 requests in flight) with a 24 h
  lifetime, unsigned under a plain key, unsigned under a run key and signed, up to 512 MiB offered;
* ``fake-pings``: 300 signed pings from distinct identities naming addresses nobody serves; then a
  fresh joiner joins through the bootstrap and counts fake and real contacts in Find answers.

``--ref REV`` also runs every flood against targets built from git revision REV (a temporary git
worktree), for before/after figures in one run.

Usage: python benchmarks/floods.py [--floods oversized,connections,store,fake-pings] [--seconds 10]
       [--waves 2] [--state-params 4000000] [--push-limit-mb MB] [--ref REV] [--json FILE]
       python benchmarks/floods.py --serve peer [--run-id RUN] [--bootstrap HOST:PORT]   (a target)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(os.environ.get("GEOMESH_ROOT") or Path(__file__).resolve().parent.parent)
sys.path.insert(0, str(ROOT))
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

RUN = "flood-bench"
MiB = 1 << 20
FLOODS = ("oversized", "connections", "store", "fake-pings")


# ============================================================================ the peer target
async def serve_peer(ns) -> None:
    """A peer-like node: every service a training peer serves, no training. Prints 'serving on ADDR'."""
    import torch

    from geomesh_p2p.exchange import CollectiveService
    from geomesh_p2p.dht import DHTNode
    from geomesh_p2p.net.identity import Identity
    from geomesh_p2p.net.links import LinkProbeService
    from geomesh_p2p.model.state import digest
    from geomesh_p2p.sync.download import Snapshot
    from geomesh_p2p.sync.server import StateServer
    from geomesh_p2p.net.transport import Transport
    from geomesh_p2p.net.transport_config import TransportConfig
    from geomesh_p2p.net.methods import COLLECTIVE_PUSH

    transport = Transport(Identity.generate(), ns.run_id, TransportConfig(host="127.0.0.1", port=0))
    dht = DHTNode(transport, republish_period_s=ns.republish_period)
    CollectiveService(transport)
    state = StateServer(transport)
    theta = torch.randn(ns.state_params)
    momentum = torch.zeros(ns.state_params)
    state.publish(Snapshot(0, theta, momentum, digest(theta, momentum)))
    LinkProbeService(transport)
    if ns.push_limit_mb is not None:  # as a collective that knows its largest part would set it
        transport.set_payload_limit(COLLECTIVE_PUSH, int(ns.push_limit_mb * MiB))
    address = await transport.start()
    if ns.bootstrap:
        await dht.join([ns.bootstrap])
    print(f"peer serving on {address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await dht.shutdown()
    await transport.stop(grace=0)


# ============================================================================ targets and measurement
def _status_kib(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


class Target:
    """A target process (stopped by PID); ``address`` from its 'serving on' line
    (:class:`geomesh_p2p.util.procs.ServingProcess`, its last 200 lines in ``lines``). RuntimeError when it
    does not start within 120 s."""

    def __init__(self, name: str, argv: list, cwd: Path, env: dict):
        # Imported here: the --serve children run this file against GEOMESH_ROOT, which may be an older tree.
        from geomesh_p2p.util.procs import ServingProcess

        self.name = name
        self._proc = ServingProcess(name, argv, cwd=cwd, env=env, timeout=120, keep_lines=200)
        self.p, self.lines, self.address = self._proc.p, self._proc.lines, self._proc.address
        self.peak_fds = 0

    @property
    def pid(self) -> int:
        return self.p.pid

    def hwm_mb(self) -> float:
        return _status_kib(self.pid, "VmHWM") / 1024

    def rss_mb(self) -> float:
        return _status_kib(self.pid, "VmRSS") / 1024

    def stop(self) -> None:
        """SIGTERM, SIGKILL after 20 s. Idempotent."""
        self._proc.stop(grace_s=20)


def start_targets(root: Path, tmp: Path, ns) -> tuple:
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "GRPC_VERBOSITY": "NONE",
        "PYTHONPATH": str(root),
        "GEOMESH_ROOT": str(root),
    }
    from geomesh_p2p.util.procs import bootstrap_argv  # here: see Target (a --serve child may run an older tree)

    boot = Target(
        "bootstrap",
        bootstrap_argv(
            RUN,
            tmp / f"boot-{random.getrandbits(32)}.key",
            *("--status-interval", "3600", "--log-level", "ERROR", "--republish-period", str(ns.republish_period)),
        )[1:],  # Target (ServingProcess) puts the interpreter first itself
        root,
        env,
    )
    try:
        argv = [
            str(Path(__file__).resolve()),
            "--serve",
            "peer",
            "--run-id",
            RUN,
            "--bootstrap",
            boot.address,
            "--state-params",
            str(ns.state_params),
            "--republish-period",
            str(ns.republish_period),
        ]
        if ns.push_limit_mb is not None and root == ROOT:
            argv += ["--push-limit-mb", str(ns.push_limit_mb)]
        peer = Target("peer", argv, root, env)
    except BaseException:
        boot.stop()
        raise
    return boot, peer


class Pinger:
    """An honest client in its own process (so that the flood's CPU work in this one does not delay it)
    pinging each target every ``interval`` s; it prints one line per ping, this process splits them by
    phase. A failure counts as its timeout."""

    def __init__(self, targets, interval: float = 0.05, timeout: float = 10.0):
        self.targets, self.interval, self.timeout = targets, interval, timeout
        argv = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--serve",
            "pinger",
            "--interval",
            str(interval),
            "--timeout",
            str(timeout),
        ] + [f"{t.name}={t.address}" for t in targets]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "GRPC_VERBOSITY": "NONE"}
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        self.samples: list = []  # (name, wall time sent, seconds, ok)
        self.ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()
        if not self.ready.wait(120):
            raise RuntimeError("the pinger did not start")
        self._t0 = time.time()

    def _pump(self) -> None:
        for line in self.p.stdout:
            parts = line.split()
            if parts and parts[0] == "ready":
                self.ready.set()
            elif len(parts) == 4:
                self.samples.append((parts[0], float(parts[1]), float(parts[2]), parts[3] == "ok"))

    def start(self) -> None:
        self._t0 = time.time()

    async def stop(self) -> dict:
        t1 = time.time()
        await asyncio.sleep(min(self.timeout, 2.0) + 0.5)  # pings sent before t1 report (late ones count as failed)
        out = {}
        for t in self.targets:
            xs = [(sec, ok) for name, sent, sec, ok in list(self.samples) if name == t.name and self._t0 <= sent < t1]
            lat = sorted(sec for sec, _ in xs)
            out[t.name] = {
                "n": len(lat),
                "failed": sum(not ok for _, ok in xs),
                "p50_ms": 1000 * lat[len(lat) // 2] if lat else None,
                "p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None,
            }
        return out

    async def close(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()


async def serve_pinger(ns) -> None:
    """The pinger process: one DHT ping to each NAME=ADDRESS every --interval s, one line per answer."""
    from geomesh_p2p.dht.state import DHT_PROTOCOL_VERSION
    from geomesh_p2p.net.identity import Identity
    from geomesh_p2p.net.transport import RpcError, Transport
    from geomesh_p2p.net.transport_config import TransportConfig
    from geomesh_p2p.net.methods import DHT_PING
    from geomesh_p2p.wire import dht_pb2

    targets = [a.split("=", 1) for a in ns.targets]
    transport = Transport(Identity.generate(), ns.run_id, TransportConfig(client_only=True))
    req = dht_pb2.PingRequest(dht_protocol=DHT_PROTOCOL_VERSION).SerializeToString()

    async def one(name, address):
        sent = time.time()
        t0 = time.perf_counter()
        try:
            await transport.call(address, DHT_PING, req, timeout=ns.timeout)
            ok = "ok"
        except RpcError:
            ok = "failed"
        sec = time.perf_counter() - t0 if ok == "ok" else max(ns.timeout, time.perf_counter() - t0)
        print(f"{name} {sent:.3f} {sec:.4f} {ok}", flush=True)

    for name, address in targets:  # connect first
        await one(name, address)
    print("ready", flush=True)
    tasks = set()
    while True:
        for name, address in targets:
            task = asyncio.ensure_future(one(name, address))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.sleep(ns.interval)


class FdSampler:
    """Peak number of open file descriptors of the targets, sampled every 0.2 s in a thread."""

    def __init__(self, targets):
        self.targets = targets
        self.peak = {t.name: 0 for t in targets}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for t in self.targets:
                self.peak[t.name] = max(self.peak[t.name], _fds(t.pid))
            self._stop.wait(0.2)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return self.peak


# ============================================================================ floods
def _sign(identity, method: str, payload: bytes) -> bytes:
    return identity.sign_message(run_id=RUN, round=0, kind=method, payload=payload).SerializeToString()


async def _signed_raw(address: str, msg: bytes, method: str, timeout: float = 30.0) -> str:
    """One call of a signed message on its own connection; returns the status code name."""
    import grpc

    from geomesh_p2p.wire import envelope_pb2

    opts = [
        ("grpc.max_send_message_length", 1 << 30),
        ("grpc.max_receive_message_length", 1 << 30),
        ("grpc.use_local_subchannel_pool", 1),
    ]
    async with grpc.aio.insecure_channel(address, options=opts) as ch:
        mc = ch.unary_unary(
            method, request_serializer=lambda b: b, response_deserializer=envelope_pb2.SignedMessage.FromString
        )
        try:
            await mc(msg, timeout=timeout)
            return "OK"
        except grpc.aio.AioRpcError as e:
            return e.code().name


def prepare_oversized(boot, peer, ns) -> list:
    """The signed messages of every wave, built before the flood starts (signing 100 MiB takes CPU)."""
    from geomesh_p2p.net.identity import Identity
    from geomesh_p2p.net.methods import COLLECTIVE_PUSH, DHT_PING, DHT_STORE
    from geomesh_p2p.wire import collective_pb2

    blob = bytes(100 * MiB)
    push = collective_pb2.PushPartRequest(contribution=blob).SerializeToString()
    plan = [(boot, DHT_PING, blob), (boot, DHT_STORE, blob), (peer, COLLECTIVE_PUSH, push), (peer, DHT_PING, blob)]
    waves = []
    for _ in range(ns.waves):
        waves.append(
            [(t, method, _sign(Identity.generate(), method, payload)) for t, method, payload in plan for _ in range(5)]
        )
    return waves


async def flood_oversized(boot, peer, ns, waves) -> dict:
    codes = {boot.name: collections.Counter(), peer.name: collections.Counter()}
    while waves:
        wave = waves.pop(0)
        calls = [_signed_raw(t.address, msg, method, timeout=max(30.0, ns.seconds)) for t, method, msg in wave]
        for (t, method, _), code in zip(wave, await asyncio.gather(*calls)):
            codes[t.name][f"{method.rsplit('/', 1)[1]}:{code}"] += 1
        del wave, calls
    return {k: dict(v) for k, v in codes.items()}


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # + empty SETTINGS


async def flood_connections(boot, peer, ns, n: int = 3000) -> dict:
    out = {}
    loop = asyncio.get_running_loop()
    held = {}

    def open_all(t):
        host, port = t.address.rsplit(":", 1)
        socks = []
        for i in range(n):
            try:
                s = socket.create_connection((host, int(port)), timeout=5)
                if i % 2:
                    s.sendall(PREFACE)
                socks.append(s)
            except OSError:
                break
        return socks

    results = await asyncio.gather(*(loop.run_in_executor(None, open_all, t) for t in (boot, peer)))
    for t, socks in zip((boot, peer), results):
        held[t.name] = socks
    await asyncio.sleep(max(1.0, ns.seconds))

    def count_closed(socks):
        closed = 0
        for s in socks:
            s.setblocking(False)
            try:
                while True:
                    d = s.recv(65536)
                    if d == b"":
                        closed += 1
                        break
            except BlockingIOError:
                pass
            except OSError:
                closed += 1
        return closed

    for t in (boot, peer):
        socks = held[t.name]
        out[t.name] = {"opened": len(socks), "closed_by_target": count_closed(socks)}
        for s in socks:
            s.close()
    return out


async def flood_store(boot, peer, ns) -> dict:
    from geomesh_p2p.dht.records import make_record
    from geomesh_p2p.net.identity import Identity
    from geomesh_p2p.net.transport import RpcError, Transport
    from geomesh_p2p.net.transport_config import TransportConfig
    from geomesh_p2p.net.methods import DHT_STORE
    from geomesh_p2p.wire import dht_pb2

    me = Identity.generate()
    client = Transport(me, RUN, TransportConfig(client_only=True, max_message_bytes=256 * MiB))
    value = bytes(64 << 10)
    out = {}
    per_target_bytes = 512 * MiB
    per_request = 64
    kinds = ["unsigned-plain", "unsigned-run-key", "signed"]

    async def one_target(t):
        stats = {k: {"offered": 0, "stored": 0} for k in kinds}
        refusals = collections.Counter()
        counter = [0]
        deadline = time.monotonic() + ns.seconds
        budget = per_target_bytes

        async def worker(w):
            nonlocal budget
            while budget > 0 and time.monotonic() < deadline:
                budget -= per_request * len(value)
                kind = kinds[counter[0] % len(kinds)]
                counter[0] += 1
                recs = []
                exp = time.time() + 24 * 3600 - 60
                for _ in range(per_request):
                    i = random.getrandbits(48)
                    if kind == "unsigned-plain":
                        recs.append(make_record(f"flood/{i}", value, exp, run_id=RUN))
                    elif kind == "unsigned-run-key":
                        recs.append(make_record(f"{RUN}/flood/{i}", value, exp, run_id=RUN))
                    else:
                        recs.append(make_record(f"{RUN}/flood/{i}", value, exp, owner=me, run_id=RUN))
                req = dht_pb2.StoreRequest(sender=dht_pb2.NodeInfo(peer_id=bytes(me.peer_id)), records=recs)
                stats[kind]["offered"] += len(recs)
                try:
                    reply = await client.call(t.address, DHT_STORE, req.SerializeToString(), timeout=30)
                    outcomes = dht_pb2.StoreResponse.FromString(reply.payload).outcomes
                    stats[kind]["stored"] += sum(o.stored for o in outcomes)
                    for o in outcomes:
                        if not o.stored:
                            refusals[o.reason[:50]] += 1
                except RpcError as e:
                    refusals[f"{e.code.name}: {e.reason[:40]}"] += 1

        await asyncio.gather(*(worker(w) for w in range(4)))
        return {"records": stats, "refusals": dict(refusals.most_common(3))}

    try:
        for t, res in zip((boot, peer), await asyncio.gather(one_target(boot), one_target(peer))):
            out[t.name] = res
    finally:
        await client.stop()
    # leave time for a republish period, so that records spread (or not) to the other node
    await asyncio.sleep(ns.republish_period * 1.5)
    return out


async def flood_fake_pings(boot, peer, ns, n: int = 300) -> dict:
    from geomesh_p2p.dht import DHTNode
    from geomesh_p2p.dht.state import DHT_PROTOCOL_VERSION
    from geomesh_p2p.net.identity import Identity
    from geomesh_p2p.net.transport import RpcError, Transport
    from geomesh_p2p.net.transport_config import TransportConfig
    from geomesh_p2p.net.methods import DHT_FIND, DHT_PING
    from geomesh_p2p.wire import dht_pb2

    fakes = {f"192.0.2.{i % 250 + 1}:{20000 + i}" for i in range(n)} | {f"127.0.0.1:{1 + i}" for i in range(n // 10)}
    fake_list = sorted(fakes)
    codes = {t.name: collections.Counter() for t in (boot, peer)}

    async def fake_ping(t, address):
        ident = Identity.generate()
        client = Transport(ident, RUN, TransportConfig(client_only=True))
        info = dht_pb2.NodeInfo(peer_id=bytes(ident.peer_id), address=address)
        req = dht_pb2.PingRequest(sender=info, dht_protocol=DHT_PROTOCOL_VERSION).SerializeToString()
        try:
            await client.call(t.address, DHT_PING, req, timeout=10)
            codes[t.name]["OK"] += 1
        except RpcError as e:
            codes[t.name][e.code.name] += 1
        finally:
            await client.stop()

    sem = asyncio.Semaphore(32)

    async def bounded(t, a):
        async with sem:
            await fake_ping(t, a)

    await asyncio.gather(*(bounded(t, a) for t in (boot, peer) for a in fake_list[:n]))
    await asyncio.sleep(min(ns.seconds, 8.0))  # contact checks (ping-backs) settle
    # A fresh client asks each target for the nodes nearest to random keys; a fresh joiner joins.
    asker = Transport(Identity.generate(), RUN, TransportConfig(client_only=True))
    out = {}
    try:
        for t in (boot, peer):
            fake = real = 0
            for _ in range(4):
                key = random.getrandbits(160).to_bytes(20, "big")
                req = dht_pb2.FindRequest(keys=[key]).SerializeToString()
                reply = await asker.call(t.address, DHT_FIND, req)
                for r in dht_pb2.FindResponse.FromString(reply.payload).results:
                    for info in r.nearest:
                        if info.address in fakes:
                            fake += 1
                        else:
                            real += 1
            out[t.name] = {"pings": dict(codes[t.name]), "find_fake": fake, "find_real": real}
    finally:
        await asker.stop()
    jt = Transport(Identity.generate(), RUN, TransportConfig(host="127.0.0.1", port=0))
    joiner = DHTNode(jt, rpc_timeout_s=2.0)
    await jt.start()
    try:
        try:
            await joiner.join([boot.address])
        except Exception as e:  # report, do not crash
            out["joiner_error"] = repr(e)
        contacts = joiner.contacts()
        out["joiner"] = {"contacts": len(contacts), "fake": sum(c.address in fakes for c in contacts)}
    finally:
        await joiner.shutdown()
        await jt.stop(grace=0)
    return out


PREPARE = {"oversized": prepare_oversized}
FLOOD_FUNCS = {
    "oversized": flood_oversized,
    "connections": flood_connections,
    "store": flood_store,
    "fake-pings": flood_fake_pings,
}


async def run_one(flood: str, root: Path, tmp: Path, ns) -> dict:
    boot, peer = start_targets(root, tmp, ns)
    targets = [boot, peer]
    pinger = None
    try:
        pinger = Pinger(targets)
        await asyncio.sleep(1.0)
        pinger.start()
        await asyncio.sleep(ns.clean_seconds)
        clean_ping = await pinger.stop()
        clean = {t.name: {"hwm_mb": t.hwm_mb(), "rss_mb": t.rss_mb(), "fds": _fds(t.pid)} for t in targets}
        extra = (PREPARE[flood](boot, peer, ns),) if flood in PREPARE else ()
        fds = FdSampler(targets)
        pinger.start()
        t0 = time.monotonic()
        detail = await FLOOD_FUNCS[flood](boot, peer, ns, *extra)
        flood_s = time.monotonic() - t0
        flood_ping = await pinger.stop()
        peak_fds = fds.stop()
        after = {t.name: {"hwm_mb": t.hwm_mb(), "rss_mb": t.rss_mb(), "alive": t.p.poll() is None} for t in targets}
        res = {"flood": flood, "seconds": flood_s, "detail": detail, "targets": {}}
        for t in targets:
            res["targets"][t.name] = {
                "clean_peak_mb": clean[t.name]["hwm_mb"],
                "flood_peak_mb": after[t.name]["hwm_mb"],
                "ratio": after[t.name]["hwm_mb"] / max(1.0, clean[t.name]["hwm_mb"]),
                "rss_after_mb": after[t.name]["rss_mb"],
                "alive": after[t.name]["alive"],
                "clean_fds": clean[t.name]["fds"],
                "peak_fds": peak_fds[t.name],
                "clean_ping": clean_ping[t.name],
                "flood_ping": flood_ping[t.name],
            }
        return res
    finally:
        if pinger is not None:
            await pinger.close()
        for t in targets:
            t.stop()


def _fmt(x, spec=".0f"):
    return "-" if x is None else format(x, spec)


def print_table(results: list) -> None:
    print()
    print(
        f"{'code':<8} {'flood':<12} {'target':<10} {'clean MB':>9} {'flood MB':>9} {'ratio':>6} "
        f"{'fds':>11} {'ping p50/p99 clean ms':>22} {'ping p50/p99 flood ms':>22} {'fail':>5}"
    )
    for r in results:
        for name, t in r["targets"].items():
            cp, fp = t["clean_ping"], t["flood_ping"]
            print(
                f"{r['code']:<8} {r['flood']:<12} {name:<10} {t['clean_peak_mb']:>9.0f} {t['flood_peak_mb']:>9.0f} "
                f"{t['ratio']:>6.2f} {str(t['clean_fds']) + '->' + str(t['peak_fds']):>11} "
                f"{_fmt(cp['p50_ms']) + ' / ' + _fmt(cp['p99_ms']):>22} "
                f"{_fmt(fp['p50_ms']) + ' / ' + _fmt(fp['p99_ms']):>22} {fp['failed']:>5}"
                + ("" if t["alive"] else "  (died)")
            )
    print()
    for r in results:
        print(f"{r['code']} {r['flood']} ({r['seconds']:.1f}s): {json.dumps(r['detail'])}")


async def bench(ns) -> list:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 16384  # 2 x 3,000 connections of the connection flood, and the rest
    if soft < want and (hard == resource.RLIM_INFINITY or hard >= want):
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    floods = [f for f in ns.floods.split(",") if f]
    for f in floods:
        if f not in FLOOD_FUNCS:
            raise SystemExit(f"unknown flood {f!r}; choose from {', '.join(FLOODS)}")
    variants = [("current", ROOT)]
    worktree = None
    tmp = Path(tempfile.mkdtemp(prefix="floods-"))
    if ns.ref:
        worktree = tmp / "ref"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(worktree), ns.ref],
            check=True,
            capture_output=True,
        )
        variants.insert(0, (ns.ref[:8], worktree))
    results = []
    try:
        for flood in floods:
            for code, root in variants:
                print(f"== {flood} against {code} ...", flush=True)
                r = await run_one(flood, root, tmp, ns)
                r["code"] = code
                results.append(r)
                for name, t in r["targets"].items():
                    print(
                        f"   {name}: peak {t['clean_peak_mb']:.0f} -> {t['flood_peak_mb']:.0f} MB "
                        f"(x{t['ratio']:.2f}), ping p99 {_fmt(t['clean_ping']['p99_ms'])} -> "
                        f"{_fmt(t['flood_ping']['p99_ms'])} ms",
                        flush=True,
                    )
    finally:
        if worktree is not None:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], capture_output=True
            )
    print_table(results)
    if ns.json:
        Path(ns.json).write_text(json.dumps(results, indent=1))
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--serve", choices=["peer", "pinger"], help="run a target node (or the pinger) instead")
    ap.add_argument("--interval", type=float, default=0.05, help="(pinger) seconds between pings")
    ap.add_argument("--timeout", type=float, default=10.0, help="(pinger) deadline of a ping, s")
    ap.add_argument("targets", nargs="*", help="(pinger) NAME=HOST:PORT")
    ap.add_argument("--run-id", default=RUN)
    ap.add_argument("--bootstrap", default=None)
    ap.add_argument(
        "--state-params",
        type=int,
        default=4_000_000,
        help="parameters of the state the peer serves (its memory: 8 bytes each, plus copies)",
    )
    ap.add_argument("--republish-period", type=float, default=5.0, help="DHT republish period of the targets, s")
    ap.add_argument(
        "--push-limit-mb",
        type=float,
        default=None,
        help="PushPart payload limit of the peer (as a collective that knows its largest part would "
        "set it with Transport.set_payload_limit; default: max_message_bytes, 128 MiB)",
    )
    ap.add_argument("--floods", default=",".join(FLOODS))
    ap.add_argument("--seconds", type=float, default=10.0, help="time bound of each flood")
    ap.add_argument("--clean-seconds", type=float, default=3.0, help="clean phase before each flood")
    ap.add_argument("--waves", type=int, default=2, help="waves of oversized requests")
    ap.add_argument("--ref", default=None, help="also run against this git revision (before/after)")
    ap.add_argument("--json", default=None)
    ns = ap.parse_args(argv)
    if ns.serve == "peer":
        asyncio.run(serve_peer(ns))
        return 0
    if ns.serve == "pinger":
        asyncio.run(serve_pinger(ns))
        return 0
    asyncio.run(bench(ns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
