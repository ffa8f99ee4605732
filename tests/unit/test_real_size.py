"""Issue 13 at real size, the pieces that need no processes: the pseudo-gradient without a flattened copy,
the exchange window that grows with the model (CPU cost per element pass), the codec calibration and the
glibc release of freed memory."""

from __future__ import annotations

import types

import pytest

from geomesh_p2p.trust.verify_task import VerifyConfig
import torch

from geomesh_p2p.exchange.profile import measure_codec
from geomesh_p2p.model.memory import release_freed_memory
from geomesh_p2p.model.profile import profile_training
from geomesh_p2p.plan import planner
from geomesh_p2p.sync.server import UpdateLog
from geomesh_p2p.round.rules import EXCHANGE_COST_STEP
from tests.rules_util import make_rules
from geomesh_p2p.model.build import build_model, flat_params, pseudo_gradient

# one intra-op thread (conftest's one_thread): under make test's load (3 workers on 2 cores) spin-waiting OpenMP
# threads made this file's CPU steps many times slower; nothing asserted depends on the thread count
pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_thread")]


def _trained_tiny():
    model = build_model("tiny", vocab_size=64, seed=3)
    theta = flat_params(model)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(torch.full_like(p, 0.001 * (i + 1)))
    return model, theta


def test_pseudo_gradient_is_bitwise_theta_minus_flat_params():
    model, theta = _trained_tiny()
    d = pseudo_gradient(model, theta)
    ref = theta - flat_params(model)
    assert d.dtype == torch.float32 and d.shape == ref.shape
    assert torch.equal(d, ref)
    assert d.abs().sum() > 0


def test_pseudo_gradient_and_flat_params_refuse_a_wrong_size():
    model, theta = _trained_tiny()
    with pytest.raises(ValueError, match="elements"):
        pseudo_gradient(model, theta[:-1])
    with pytest.raises(ValueError, match="elements"):
        flat_params(model, out=torch.empty(theta.numel() + 1))


def test_flat_params_into_a_buffer_is_the_same_bytes_and_that_buffer():
    model, _ = _trained_tiny()
    buf = torch.full((flat_params(model).numel(),), float("nan"))
    got = flat_params(model, out=buf)
    assert got is buf
    assert torch.equal(buf, flat_params(model))


def test_exchange_passes_and_cpu_seconds():
    assert planner.exchange_passes(3, "relay") == 5
    assert planner.exchange_passes(3, "reencode") == 3
    assert planner.exchange_passes(1, "relay") == 3
    # gpt2-124m, 3 peers, relay, 4 ns per element pass: 88,988,160 x 4e-9 x 5
    assert planner.exchange_cpu_s(88_988_160, 3, "relay", 4e-9) == pytest.approx(1.7797632, rel=1e-12)
    with pytest.raises(ValueError):
        planner.exchange_passes(0, "relay")
    with pytest.raises(ValueError):
        planner.exchange_passes(2, "butterfly")
    with pytest.raises(ValueError):
        planner.exchange_cpu_s(10, 2, "relay", -1.0)


def test_exchange_timeout_floor_and_safety():
    assert planner.exchange_timeout(0.5, 1.5, 12.0) == 12.0  # 3 x 2 s is under the floor
    assert planner.exchange_timeout(1.0, 4.0, 12.0) == 15.0  # 3 x 5 s
    assert planner.exchange_timeout(1.0, 4.0, 12.0, safety=2.0) == 12.0
    with pytest.raises(ValueError):
        planner.exchange_timeout(-1.0, 0.0, 1.0)


def _policy_node(cost, numel=150_000_000, n_mode="relay"):
    """The node's planning rules (exchange window) and re-profiling (exchange cost) over a ``numel`` model."""
    return make_rules(
        types.SimpleNamespace(mode=n_mode, method="geomesh", window_s=30.0),
        types.SimpleNamespace(plan_timeout_s=4.0),
        numel=numel,
        ema=types.SimpleNamespace(upload_bps=1e8, download_bps=1e8),
        codec_s_per_element=cost,
    )


def test_exchange_window_grows_with_the_model_and_the_measured_cost():
    # llama-150m-sized vector, 3 peers, relay, 10 ns per pass: 3 x (2 x 1e8 B / 1e8 B/s + 1.5e8 x 1e-8 x 5)
    node = _policy_node(1e-8)
    assert node.planning.exchange_window(3, 100_000_000) == pytest.approx(3 * (2.0 + 7.5))
    # mode auto (the default) charges the round's mode: relay's passes at 3 peers, accountable's at 5
    auto = _policy_node(1e-8, n_mode="auto").planning
    assert auto.exchange_window(3, 100_000_000) == node.planning.exchange_window(3, 100_000_000)
    acct = _policy_node(1e-8, n_mode="accountable").planning
    assert (
        auto.exchange_window(5, 100_000_000) == acct.exchange_window(5, 100_000_000) == pytest.approx(3 * (2.0 + 6.0))
    )  # 4 passes
    assert _policy_node(1e-8, numel=1_000).planning.exchange_window(3, 1_000) == 12.0  # tiny model: the floor
    assert _policy_node(None).planning.exchange_window(3, 100_000_000) == 12.0  # not calibrated: the floor
    # a huge cost is capped at 90% of what followers accept for a 30 s window: 0.9 x (4 x 30 + 120) s
    assert _policy_node(1e-6).planning.exchange_window(3, 100_000_000) == pytest.approx(216.0)


def test_exchange_cost_ema_first_sample_replaces_then_bounded_steps(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("geomesh_p2p.round.rules.profiling.swarm_time", lambda: now[0])
    node = _policy_node(1e-9, numel=1_000_000)
    spec = types.SimpleNamespace(round=0, participants={"a": 1, "b": 1, "c": 1}, mode="relay", validators_per_part=1)
    link = types.SimpleNamespace(seconds=0.5)
    # 10 s call, the last contributor finished 2 s into it, 0.5 + 0.5 s on the network: 7 s of CPU over
    # 1e6 elements x 5 passes = 1.4 us per pass, clamped to 4 x the 1 ns calibration.
    ar = types.SimpleNamespace(wall_s=10.0, last_compute_end=now[0] - 8.0, upload=link, download=link)
    node.profile.update_exchange_cost(spec, ar)
    assert node.profile.codec_s_per_element == pytest.approx(1e-9 * EXCHANGE_COST_STEP)
    # then an EMA (alpha 0.5) of a sample within the step: 0.02 s of CPU -> 4 ns per pass
    ar2 = types.SimpleNamespace(wall_s=0.02, last_compute_end=0.0, upload=None, download=None)
    node.profile.update_exchange_cost(spec, ar2)
    assert node.profile.codec_s_per_element == pytest.approx(0.5 * 4e-9 + 0.5 * 4e-9)


def test_measure_codec_is_a_positive_cost_per_element():
    c = measure_codec(1 << 14, repeats=1)
    assert 0 < c < 1e-3
    with pytest.raises(ValueError):
        measure_codec(0)


def test_release_freed_memory_reports_whether_glibc_answered():
    assert isinstance(release_freed_memory(), bool)


class _FakeTransport:
    """What _build_training asks of the transport: the configured message size and payload limits."""

    def __init__(self):
        self.config = types.SimpleNamespace(max_message_bytes=1 << 30)
        self.limits = {}

    def set_payload_limit(self, method, n):
        self.limits[method] = n


@pytest.mark.timeout(120)
def test_build_training_profiles_the_model_in_place_and_holds_the_budget(monkeypatch):
    """The node profiles with model.profile.profile_training on its own model (no copy: the weights stay
    bit-identical), the budget reaches it, and the state buffer and codec cost are set up after it."""
    from geomesh_p2p.config.models import NodeConfig, RunConfig
    from geomesh_p2p.net.identity import Identity
    from geomesh_p2p.node.peer import PeerNode

    seen = {}
    real = profile_training

    def spy(model, seq_len, device, memory_bytes, **kw):
        seen["model"], seen["budget"], seen["extra"] = model, memory_bytes, kw.get("extra_bytes")
        seen["before"] = flat_params(model)
        return real(model, seq_len, device, memory_bytes, **kw)

    monkeypatch.setattr("geomesh_p2p.node.training.profile_training", spy)
    node = PeerNode(
        RunConfig(seq_len=32, mode="relay"),  # the figures below are relay's (auto adds accountable's kept pushes)
        NodeConfig(profile_batches=[1, 2], memory_budget_bytes=6 << 30, device="cpu"),
        identity=Identity.generate(),
    )
    node.transport = _FakeTransport()
    node.state_server = types.SimpleNamespace(serve=lambda gs: seen.setdefault("served", gs), updates=UpdateLog())
    node._build_training()
    assert seen["model"] is node.model  # profiled in place, not on a deep copy
    # session 45: the next steps and verified work's early write wait for the outer update's spill (none here)
    wait = node.trainer.grads.wait_release
    assert wait is not None and node.verified.before_early_write is wait and wait() is True
    assert seen["budget"] == 6 << 30
    # the rest of the run's static memory (issue 27), fp32: global weights + Nesterov momentum (8 B/param), a
    # verified-work check's weights + gradients (8, relay mode), and its kept contributions: 3 rounds x 2
    # contributors x (sign bits + one fp32 scale per 2048-element block); the exchange's buffers take the
    # gradients' place and the newest outer update is on disk (session 18: 4 B/param more before)
    n = node.numel
    kept = VerifyConfig().keep_rounds + 1  # the newest rounds and the one a background check holds
    assert seen["extra"] == 16 * n + kept * 2 * (-(-n // 8) + 4 * -(-n // 2048))
    assert torch.equal(flat_params(node.model), seen["before"])  # the profile left the weights as they were
    assert set(node.profiled_tps) <= {1, 2} and node.profiled_tps and node.max_batch >= 1
    assert seen["served"] is node.gstate and node.theta is node.gstate.theta
    assert node.codec_s_per_element > 0
    assert all(p.grad is None for p in node.model.parameters())


def test_build_training_refuses_a_budget_below_the_model_in_one_line():
    from geomesh_p2p.config.models import NodeConfig, RunConfig
    from geomesh_p2p.util.errors import UserFacingError
    from geomesh_p2p.net.identity import Identity
    from geomesh_p2p.node.peer import PeerNode

    node = PeerNode(
        RunConfig(seq_len=32),
        NodeConfig(profile_batches=[1], memory_budget_bytes=64 << 20, device="cpu"),
        identity=Identity.generate(),
    )
    node.transport = _FakeTransport()
    with pytest.raises(UserFacingError, match="cannot train tiny here: memory budget 0.0625 GiB is below"):
        node._build_training()
