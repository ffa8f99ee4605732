"""The verified-work tests' world (tests/unit/test_verify*.py): the round under test on the real tiny model and
the shipped KJV corpus (seq_len 64, batch 8: the measured setting of the thresholds). Three peers train two
DiLoCo rounds with their own persistent AdamW, then the round under test: the accused "A" contributes honestly
with H = 5, 10, 20 inner steps, or one of the attacks of issue 11. The module fixtures (``world``,
``flipped_case``: ``pytest.fixture(scope="module")`` of :func:`world_fixture` / :func:`flipped_case_fixture` in each
test module) build it once per module; its training (~15 CPU-s) runs once per pytest session (:func:`world_fixture`).
"""

from __future__ import annotations

import copy
import hashlib
import types

import torch

from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.net.identity import Identity, canonical_header
from geomesh_p2p.plan.schema import PeerAssignment, RoundPlan
from geomesh_p2p.trust import verify as V
from geomesh_p2p.trust import verify_task as VT
from geomesh_p2p.wire import collective_pb2

L, B, ROUND = 64, 8, 2
CONTRIBUTION_KIND = "geomesh.collective/Contribution"
RUN = "verify-test"


class World:
    """The round under test: start weights, identities, every candidate contribution (fp32 deltas)."""


def _signed(
    ident: Identity, packet, part: int, start: int, end: int, round: int = ROUND, nonce: bytes | None = None
) -> bytes:
    """``ident``'s signed contribution of ``packet`` to ``part`` (SignedMessage bytes). An envelope carries the
    signing time and a fresh random nonce, so its bytes (and their SHA-256: an accountable round's commitments and
    screen seed) differ on every call; with ``nonce`` the envelope is re-signed with that nonce at a fixed time
    (``created_at`` of :func:`_plan`): the same bytes every run."""
    c = collective_pb2.PartContribution(
        round=round,
        part=part,
        start=start,
        end=end,
        tokens=packet.tokens,
        spec_id=b"s" * 32,
        encoding="sign",
        packet=packet.to_bytes(),
    )
    msg = ident.sign_message(run_id=RUN, round=round, kind=CONTRIBUTION_KIND, payload=c.SerializeToString())
    if nonce is not None:
        msg.envelope.nonce, msg.envelope.timestamp = nonce, 1e9
        msg.envelope.signature = ident.sign(canonical_header(msg.envelope))  # Ed25519: deterministic
    return msg.SerializeToString()


def _fixed_identity(name: str) -> Identity:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Identity(Ed25519PrivateKey.from_private_bytes(hashlib.sha256(f"verify-test/{name}".encode()).digest()))


#: the world's trained tensors (:func:`_train_world`), saved once per pytest session (see :func:`world_fixture`)
WORLD_CACHE = "verify-world.pt"


def _new_trainer(model, ds, peer_id: str):
    from geomesh_p2p.model.training import InnerTrainer

    return InnerTrainer(model, ds, seq_len=L, lr=1e-3, warmup_steps=20, total_steps=2000, seed=0, peer_id=peer_id)


def _train_world(ds, base, pid: dict[str, str]) -> dict:
    """The world's training (one intra-op thread; ~15 CPU-s): three peers' two DiLoCo rounds, then the round
    under test's contributions. Returns the tensors the tests read and B's inner optimizer state (``B_state``:
    :func:`world_fixture`'s ``honest_of`` trains from it)."""
    from geomesh_p2p.model.build import flat_params, load_flat_
    from geomesh_p2p.model.optim import OuterNesterov

    theta = flat_params(base)
    trainers = {n: _new_trainer(copy.deepcopy(base), ds, pid[n]) for n in pid}
    enc = lambda v: compression.encode(v, 2048, 0)  # noqa: E731
    outer = OuterNesterov(0.7, 0.9)
    for r in range(ROUND):
        deltas = {}
        for n, t in trainers.items():
            load_flat_(t.model, theta)
            t.run(round=r, inner_steps=10, batch_size=B)
            deltas[n] = theta - flat_params(t.model)
        agg = torch.stack([compression.decode(enc(d)) for d in deltas.values()]).mean(0)
        outer.step(theta, agg)
    states = {n: t.state_dict() for n, t in trainers.items()}

    def train(n: str, H: int, data_of: str | None = None) -> torch.Tensor:
        return _train_round(base, ds, theta, states[n], H, pid[data_of or n])

    return {
        "theta": theta,
        "prev_aggregate": agg,  # what the adversary's "stale" free rider sends: the last global update
        "others": {n: train(n, 10) for n in ("B", "C")},
        "honest": {H: train("A", H) for H in (5, 10, 20)},
        "wrong_data": train("A", 10, data_of="B"),  # A's own optimizer, B's batches
        "B_state": states["B"],
    }


def _train_round(base, ds, theta: torch.Tensor, state: dict, H: int, peer_id: str) -> torch.Tensor:
    """One peer's contribution to the round under test: ``H`` inner steps from ``theta`` with the inner optimizer
    ``state`` (not changed) on ``peer_id``'s batches; the fp32 delta ``theta - weights after``."""
    from geomesh_p2p.model.build import flat_params, load_flat_

    m = copy.deepcopy(base)
    load_flat_(m, theta)
    t = _new_trainer(m, ds, peer_id)
    t.load_state_dict(copy.deepcopy(state))
    t.run(round=ROUND, inner_steps=H, batch_size=B)
    return theta - flat_params(m)


def world_fixture(tmp_path_factory):
    """The :class:`World` (a generator: ``pytest.fixture(scope="module")`` of it in each test module). Four test
    modules use it, and under ``make test``'s xdist workers each module ran the same training in its own worker
    (~15 CPU-s each): its tensors are computed once per pytest session, by the first module that asks, and saved
    in the session's base temp folder (shared by its workers; a file lock orders them); the others load them
    (torch.save/load: the same bits). Nothing outlives the session's temp folder."""
    import fcntl
    import os

    from geomesh_p2p.data import load_dataset
    from geomesh_p2p.model.build import build_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        w = World()
        w.ds = load_dataset(None, seq_len=L)
        base = build_model("tiny", vocab_size=w.ds.vocab_size, seed=0)
        ids = {n: _fixed_identity(n) for n in ("A", "B", "C")}  # fixed keys: fixed batches, fixed values
        pid = {n: str(i.peer_id) for n, i in ids.items()}
        root = tmp_path_factory.getbasetemp()
        if os.environ.get("PYTEST_XDIST_WORKER"):
            root = root.parent  # an xdist worker's base temp is <session's>/popen-gwN
        with open(root / f"{WORLD_CACHE}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            cache = root / WORLD_CACHE
            if cache.exists():
                saved = torch.load(cache, weights_only=True)
            else:
                saved = _train_world(w.ds, base, pid)
                torch.save(saved, root / f"{WORLD_CACHE}.part")
                os.replace(root / f"{WORLD_CACHE}.part", cache)
        theta = saved["theta"]
        w.prev_aggregate = saved["prev_aggregate"]
        own: dict[str, torch.Tensor] = {}

        def honest_of(peer_id: str) -> torch.Tensor:
            """An honest H = 10 update of a verifier's identity on its own assigned batches (B's optimizer state):
            a verifier that contributed in the round has the loss-gain test's power reference. Trained with one
            intra-op thread, as the world (the same bits whichever module asks first), once per pytest session: saved
            next to the world's tensors for the other modules (five ask for screener V's: ~0.8 CPU-s each)."""
            if peer_id not in own:
                with open(root / f"{WORLD_CACHE}.lock", "w") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX)
                    path = root / f"{WORLD_CACHE}.honest-{hashlib.sha256(peer_id.encode()).hexdigest()[:32]}"
                    if path.exists():
                        own[peer_id] = torch.load(path, weights_only=True)
                    else:
                        n = torch.get_num_threads()
                        torch.set_num_threads(1)
                        try:
                            own[peer_id] = _train_round(base, w.ds, theta, saved["B_state"], 10, peer_id)
                        finally:
                            torch.set_num_threads(n)
                        part = path.parent / (path.name + ".part")
                        torch.save(own[peer_id], part)
                        os.replace(part, path)
            return own[peer_id]

        w.honest_of = honest_of
        w.b_state = saved["B_state"]  # trains other updates from the same state (tests/unit/test_gain_stages.py)
        w.theta, w.base, w.ids, w.pid = theta, base, ids, pid
        w.others, w.honest, w.wrong_data = saved["others"], saved["honest"], saved["wrong_data"]
        w.P = theta.numel()
        bounds = [0, 112 * 2048, 224 * 2048, 336 * 2048, w.P]
        w.part_ranges = list(zip(bounds[:-1], bounds[1:]))
        yield w
    finally:
        torch.set_num_threads(threads)


def _packets(
    w, contribution: torch.Tensor, H: int, others_H: int = 10, extra: dict | None = None, extra_H: int | None = None
):
    """sender PeerID -> part -> SignPacket, as relay mode hands them to every peer (``extra``'s of ``extra_H`` steps,
    default ``others_H``)."""
    out = {}
    for name, delta, steps in [("A", contribution, H)] + [(n, d, others_H) for n, d in w.others.items()]:
        out[w.pid[name]] = {
            j: compression.encode(delta[s:e].contiguous(), 2048, steps * B * L)
            for j, (s, e) in enumerate(w.part_ranges)
        }
    for p, d in (extra or {}).items():
        out[p] = {
            j: compression.encode(d[s:e].contiguous(), 2048, (extra_H or others_H) * B * L)
            for j, (s, e) in enumerate(w.part_ranges)
        }
    return out


def _plan(w, verifiers: dict[str, Identity], steps=None) -> RoundPlan:
    steps = steps or {}
    people = dict(w.pid)
    people.update({n: str(i.peer_id) for n, i in verifiers.items()})
    ids = sorted(people.values())
    owners = {w.pid["A"]: 0, w.pid["B"]: 1, w.pid["C"]: 2}
    rest = [p for p in ids if p not in owners]
    owners[rest[0]] = 3
    assignments = []
    for p in ids:
        name = next(n for n, q in people.items() if q == p)
        H = steps.get(name, 10)
        s, e = w.part_ranges[owners[p]] if p in owners else (0, 0)
        assignments.append(
            PeerAssignment(
                peer_id=p,
                address="127.0.0.1:1",
                batch_size=B,
                micro_batch=B,
                accum_steps=1,
                inner_steps=H,
                token_budget=B * L * H,
                part_start=s,
                part_end=e,
                predicted_compute_s=1.0,
                predicted_comm_s=0.1,
                predicted_idle_s=0.0,
            )
        )
    return RoundPlan(
        run_id=RUN,
        round=ROUND,
        leader=ids[0],
        method="geomesh",
        mode="relay",
        numel=w.P,
        seq_len=L,
        window_s=6.0,
        train_deadline=1e9 + 6,
        exchange_deadline=1e9 + 12,
        start_digest="digest-r2",
        created_at=1e9,
        assignments=assignments,
    )


def _verifier(w, ident, cfg, plan, packets):
    wv = V.WorkVerifier(
        cfg, identity=ident, run_id=RUN, model=copy.deepcopy(w.base), dataset=w.ds, seed=0, lr=1e-3, weight_decay=0.1
    )
    wv.keep_round(ROUND, theta=w.theta, plan=plan, part_ranges=w.part_ranges, packets=packets)
    return wv


def _drawn(w, accused: str, cfg, packets, tries=400):
    """An identity whose selection signature draws a check of ``accused`` (the selection is a pure
    function of the signature: try fresh keys until one draws it)."""
    for i in range(tries):
        v = _fixed_identity(f"verifier-{accused[:6]}-{i}")
        plan = _plan(w, {"V": v})
        sel = v.sign(VT.selection_message(RUN, ROUND, plan.start_digest))
        task = VT.derive_task(
            cfg, plan=plan, verifier=str(v.peer_id), selection=sel, packets=packets, part_ranges=w.part_ranges
        )
        if task is not None and task.accused == accused:
            return v, plan, task
    raise AssertionError("no identity drew the accused")


def flipped_case_fixture(world):
    """A verifier drawn to check A, A having sent -delta, and the evidence its check produced."""
    cfg = VT.VerifyConfig(share=1.0)
    bad = -world.honest[10]
    packets = _packets(world, bad, 10)
    v, plan, task = _drawn(world, world.pid["A"], cfg, packets)
    wv = _verifier(world, v, cfg, plan, packets)
    signed = {
        j: _signed(world.ids["A"], packets[world.pid["A"]][j], j, s, e) for j, (s, e) in enumerate(world.part_ranges)
    }
    ev = wv.check_round(ROUND, signed_of=lambda part, sender: signed[part] if sender == task.accused else None)
    return types.SimpleNamespace(cfg=cfg, packets=packets, v=v, plan=plan, task=task, wv=wv, ev=ev, signed=signed)


class FakeDHT:
    """The two DHTNode coroutines verify.py uses, over a dict; the owner rule as the real DHT applies it."""

    def __init__(self):
        self.data: dict[str, dict] = {}

    async def store(self, key, value, expiration_time, subkey=None, owner=None):
        from geomesh_p2p.dht.records import required_owner

        assert owner is not None and required_owner(key, subkey) == owner.peer_id
        self.data.setdefault(key, {})[subkey] = (value, expiration_time, owner.peer_id)
        return True

    async def get(self, key, latest=True, subkeys=None, quorum=None):
        return dict(self.data.get(key, {}))


class Counting:
    """The dataset, counting the batches drawn (each is one forward pass of the screen)."""

    def __init__(self, ds):
        self.ds, self.batches = ds, 0

    def __getattr__(self, name):
        return getattr(self.ds, name)

    def sample_batch(self, **kw):
        self.batches += 1
        return self.ds.sample_batch(**kw)
