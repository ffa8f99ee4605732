"""What a person watching a node wants: one table row per round, JSON lines, Prometheus gauges.

Idle accounting of a round (all in seconds of wall-clock, shown as % of the round):

* ``straggler_idle``: from the end of this peer's inner steps to the moment the last contributor
  of the round finished its own (each contribution states its sender's compute end): the time it
  waited because others were still computing. AWB drives this towards 0 for every peer.
* ``network_idle``: the rest of the non-compute time (end of compute to aggregate ready, minus the
  straggler idle): the time it waited on transfers, its own and the others'.

``phase_s`` (issue 17): seconds of wall-clock (monotonic) each phase of the round driver took in the
*cycle* that ends with this row: from the previous row of this peer to this one, so it also holds the
previous round's checkpoint and this round's gather (see :data:`PHASES`). ``cycle_s`` is that cycle's
length; ``compute_share`` = ``compute_s / cycle_s`` (the inner steps' share of this peer's time) and
``other_s`` the part of the cycle no phase accounts for. ``extra["phase_cpu_s"]`` (issue 27): the CPU seconds
every thread of the process used during each phase (a phase much longer than its CPU waited: for a core, or
for the other peers; the plan phase also holds inner steps started during the plan's settle).

``loop_stall_ms``: the worst event-loop stall of the round (:class:`geomesh_p2p.telemetry.looplag.LoopLagMonitor`):
while the loop is stalled this peer serves nothing (parts, state, DHT), so slower peers wait on it.
"""

from __future__ import annotations

import json
import math
import logging
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from geomesh_p2p.telemetry.metrics_http import start_metrics_server

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

log = logging.getLogger(__name__)


def json_safe(value):
    """``value`` with every non-finite float (NaN, +-inf), however deeply nested in dicts, lists and
    tuples, replaced by None: ``json.dumps`` would write ``NaN`` / ``Infinity``, which is not JSON
    (strict parsers and ``jq`` refuse the whole line). Dict keys are kept; tuples become lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


#: Phases of the round driver timed per cycle (``RoundRecord.phase_s`` keys, in the order they run).
#: ``top``: the loop top (announce, behind-check); ``gather``; ``plan`` (agreement, settle included);
#: ``train`` (inner steps); ``pseudo_gradient`` (delta and finiteness check); ``exchange``; ``outer_step``;
#: ``digest`` (commit: load, digest, snapshot); ``announce`` (round r+1's record); ``eval`` (the time the
#: round waited for evaluation: 0 when it runs in the background); ``digest_check``; ``checkpoint``
#: (the previous round's, written after its row); ``resync`` (state downloads: behind, or a digest mismatch).
PHASES = (
    "top",
    "gather",
    "plan",
    "train",
    "pseudo_gradient",
    "exchange",
    "outer_step",
    "digest",
    "announce",
    "eval",
    "digest_check",
    "checkpoint",
    "resync",
)

#: A round in which a peer does fewer than this share of its planned inner steps is flagged "underfilled".
UNDERFILLED_SHARE = 0.5


@dataclass
class RoundRecord:
    """One round as this peer saw it. Units: seconds, tokens, bytes; percentages of ``round_s``."""

    round: int
    peers: int
    leader: str
    batch_size: int
    inner_steps_planned: int
    inner_steps_done: int
    tokens: int
    train_loss: float
    eval_ppl: Optional[float]
    compute_s: float
    straggler_idle_s: float
    network_idle_s: float
    round_s: float
    bytes_sent: int
    bytes_received: int
    digest: str
    digest_agree: Optional[bool] = None
    contributors: int = 0  # distinct peers whose contribution was taken in at least one part
    missing_parts: int = 0
    # whether some part aggregated a token (round.rules.penalties.conclusive); None: not known (rows before 0.19.1)
    applied: Optional[bool] = None
    time: float = 0.0
    loop_stall_ms: Optional[float] = None  # worst event-loop stall of the round, ms (None: not measured)
    phase_s: dict = field(default_factory=dict)  # PHASES name -> seconds in this row's cycle (issue 17)
    cycle_s: Optional[float] = None  # seconds from this peer's previous row to this one (None: first row)
    eval_round: Optional[int] = None  # round whose end state eval_ppl measured (background eval lags)
    extra: dict = field(default_factory=dict)

    @property
    def underfilled(self) -> bool:
        """This peer trained less than ``UNDERFILLED_SHARE`` of the inner steps its plan gave it (issue 14
        #9: rounds that train nothing must not look healthy)."""
        return self.inner_steps_planned > 0 and self.inner_steps_done < UNDERFILLED_SHARE * self.inner_steps_planned

    @property
    def straggler_idle_pct(self) -> float:
        return 100.0 * self.straggler_idle_s / self.round_s if self.round_s > 0 else 0.0

    @property
    def network_idle_pct(self) -> float:
        return 100.0 * self.network_idle_s / self.round_s if self.round_s > 0 else 0.0

    @property
    def compute_share(self) -> Optional[float]:
        """``compute_s / cycle_s`` in [0, 1] (None before a cycle is known): the inner steps' share of this
        peer's wall-clock between two rows. Issue 17's goal is >= 0.92 on a 3-peer loopback swarm."""
        if not self.cycle_s or self.cycle_s <= 0:
            return None
        return min(1.0, max(0.0, self.compute_s / self.cycle_s))

    @property
    def other_s(self) -> Optional[float]:
        """Seconds of the cycle no timed phase accounts for (None before a cycle is known)."""
        if self.cycle_s is None:
            return None
        return max(0.0, self.cycle_s - sum(self.phase_s.values()))

    def to_json(self) -> str:
        """One JSON object (strict JSON: NaN/Inf become null, ``extra`` included)."""
        d = asdict(self)
        share = self.compute_share
        d["compute_share"] = round(share, 4) if share is not None else None
        other = self.other_s
        d["other_s"] = round(other, 4) if other is not None else None
        d["straggler_idle_pct"] = round(self.straggler_idle_pct, 2)
        d["network_idle_pct"] = round(self.network_idle_pct, 2)
        d["underfilled"] = self.underfilled
        return json.dumps(json_safe(d), sort_keys=True, allow_nan=False)


HEADER = (
    f"{'round':>5} {'peers':>5} {'batch':>5} {'H':>7} {'tokens':>8} {'loss':>7} {'eval ppl':>9} "
    f"{'strag%':>6} {'net%':>5} {'comp%':>5} {'sent':>9} {'recv':>9} {'time':>6} {'stall':>6} digest"
)


def _fmt_bytes(n: float) -> str:
    """``n`` bytes for the round table: B, KB, MB or GB (1024-based)."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return str(n)


def format_row(r: RoundRecord) -> str:
    """One fixed-width table row (see HEADER)."""
    ppl = f"{r.eval_ppl:9.2f}" if r.eval_ppl is not None else f"{'-':>9}"
    h = f"{r.inner_steps_done}/{r.inner_steps_planned}" + ("!" if r.underfilled else "")
    agree = {None: "", True: " ok", False: " MISMATCH"}[r.digest_agree]
    # a round whose exchange aggregated nobody's work (every part refused or missing): its state did not move, which
    # "ok" alone hid (fresh-user trial, session 29: a resumed leader's plan refused by the others)
    # (fresh user 53: contributions that all counted 0 tokens, each under its token floor, applied nothing either)
    nothing = (r.contributors == 0 and r.missing_parts > 0) or r.applied is False
    agree += " (nothing applied)" if nothing else ""
    loss = f"{r.train_loss:>7.3f}" if math.isfinite(r.train_loss) else f"{'-':>7}"
    share = r.compute_share
    comp = f"{100 * share:>5.1f}" if share is not None else f"{'-':>5}"
    stall = f"{r.loop_stall_ms:.0f}ms" if r.loop_stall_ms is not None and math.isfinite(r.loop_stall_ms) else "-"
    return (
        f"{r.round:>5} {r.peers:>5} {r.batch_size:>5} {h:>7} {r.tokens:>8} {loss} {ppl} "
        f"{r.straggler_idle_pct:>6.1f} {r.network_idle_pct:>5.1f} {comp} {_fmt_bytes(r.bytes_sent):>9} "
        f"{_fmt_bytes(r.bytes_received):>9} {r.round_s:>6.1f} {stall:>6} {r.digest[:8]}{agree}"
    )


class RoundLog:
    """Prints the round table, appends JSON lines (``--log-json``), feeds Prometheus (``--metrics-port``;
    port 0 picks a free one, see :attr:`metrics_port`). :meth:`close` stops the HTTP server."""

    def __init__(
        self,
        json_path: Optional[str] = None,
        metrics_port: Optional[int] = None,
        metrics_host: str = "127.0.0.1",
        print_fn=print,
    ):
        self.json_path = Path(json_path) if json_path else None
        if self.json_path:
            self.json_path.parent.mkdir(parents=True, exist_ok=True)
        self.print_fn = print_fn
        self._printed_header = False
        # --log-json on a full disk: one WARNING per kind of failure, one INFO when it works again (rows missed).
        # (Not telemetry.logonce.LogOnChange: events imports this module, and logonce imports events.)
        self._json_failing: Optional[tuple] = None
        self._json_missed = 0
        self._server: Optional[WSGIServer] = None
        self._thread: Optional[threading.Thread] = None
        self._gauges: dict[str, Any] = {}  # name -> prometheus_client Gauge
        if metrics_port is not None:
            self._start_prometheus(metrics_host, metrics_port)

    def _start_prometheus(self, host: str, port: int) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        g = lambda name, doc: Gauge(f"geomesh_{name}", doc, registry=self.registry)  # noqa: E731
        self._gauges = {
            "round": g("round", "last finished round"),
            "peers": g("peers", "participants of the last round"),
            "train_loss": g("train_loss", "mean inner-step loss of the last round"),
            "eval_ppl": g("eval_perplexity", "eval perplexity of the global weights"),
            # which round's weights it measured: the perplexity stays while rounds go by unevaluated (a fresh user
            # read a round-2 figure at geomesh_round 4, session 34)
            "eval_round": g("eval_round", "round whose end state geomesh_eval_perplexity measured"),
            "straggler_idle": g("straggler_idle_ratio", "straggler idle share of the last round"),
            "network_idle": g("network_idle_ratio", "network idle share of the last round"),
            "round_s": g("round_seconds", "wall time of the last round"),
            "loop_stall": g("loop_stall_seconds", "worst event-loop stall of the last round"),
            "compute_share": g("compute_share_ratio", "inner steps' share of this peer's last round cycle"),
        }
        # no evaluation yet: NaN, not the Gauge's 0 (a perplexity of 0 is impossible; dashboards showed it)
        self._gauges["eval_ppl"].set(float("nan"))
        self._gauges["eval_round"].set(float("nan"))
        self._phase = Gauge(
            "geomesh_round_phase_seconds",
            "seconds of each round-driver phase in the last cycle",
            ["phase"],
            registry=self.registry,
        )
        self._loop_stall = Histogram(
            "geomesh_round_loop_stall_seconds",
            "worst event-loop stall per round",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
            registry=self.registry,
        )
        self._tokens = Counter("geomesh_tokens", "tokens trained by this peer", registry=self.registry)
        self._underfilled = Counter(
            "geomesh_underfilled_rounds",
            f"rounds in which this peer trained less than {UNDERFILLED_SHARE:.0%} of its planned inner steps",
            registry=self.registry,
        )
        self._bytes_sent = Counter("geomesh_sent_bytes", "bytes sent in exchanges", registry=self.registry)
        self._bytes_recv = Counter("geomesh_received_bytes", "bytes received in exchanges", registry=self.registry)
        # bounded: timeouts on every read and write, connections capped in all and per client (issue 29 #1)
        self._server, self._thread = start_metrics_server(host, port, self.registry)
        log.info("Prometheus metrics on http://%s:%d/metrics", host, self.metrics_port)

    @property
    def metrics_port(self) -> Optional[int]:
        """The port the metrics server listens on (the one chosen when 0 was asked), or None."""
        return self._server.server_address[1] if self._server is not None else None

    def note_state_round(self, round: int) -> None:
        """This peer holds the state of ``round`` without having finished a round in this process (``--resume``):
        the ``geomesh_round`` gauge (last finished round) reads ``round - 1``, not 0, until the next row."""
        if self._gauges and round > 0:
            self._gauges["round"].set(round - 1)

    def add(self, r: RoundRecord) -> None:
        if not self._printed_header:
            self.print_fn(HEADER)
            self._printed_header = True
        self.print_fn(format_row(r))
        if self.json_path:
            try:
                with self.json_path.open("a") as f:
                    f.write(r.to_json() + "\n")
            except OSError as e:  # a full disk must not end the round (issue 29 #7): one WARNING per state
                kind = (type(e).__name__, e.errno)
                self._json_missed += 1
                log.log(
                    logging.WARNING if kind != self._json_failing else logging.DEBUG,
                    "round %d: cannot append to --log-json %s (%s); rows are missing there until it works again",
                    r.round,
                    self.json_path,
                    e.strerror or e,
                )
                self._json_failing = kind
            else:
                if self._json_failing is not None:
                    log.info(
                        "round %d: --log-json %s written again (%d row(s) missing)",
                        r.round,
                        self.json_path,
                        self._json_missed,
                    )
                self._json_failing, self._json_missed = None, 0
        if self._gauges:
            gz = self._gauges
            gz["round"].set(r.round)
            gz["peers"].set(r.peers)
            gz["train_loss"].set(r.train_loss)
            if r.eval_ppl is not None:
                gz["eval_ppl"].set(r.eval_ppl)
                gz["eval_round"].set(r.round if r.eval_round is None else r.eval_round)
            gz["straggler_idle"].set(r.straggler_idle_pct / 100)
            gz["network_idle"].set(r.network_idle_pct / 100)
            gz["round_s"].set(r.round_s)
            if r.loop_stall_ms is not None and math.isfinite(r.loop_stall_ms):
                gz["loop_stall"].set(r.loop_stall_ms / 1000)
                self._loop_stall.observe(r.loop_stall_ms / 1000)
            if r.compute_share is not None:
                gz["compute_share"].set(r.compute_share)
            for name, secs in r.phase_s.items():
                self._phase.labels(phase=name).set(secs)
            if r.underfilled:
                self._underfilled.inc()
            self._tokens.inc(r.tokens)
            self._bytes_sent.inc(r.bytes_sent)
            self._bytes_recv.inc(r.bytes_received)

    def close(self) -> None:
        """Stop the metrics HTTP server (its serving thread ends, the port is released). Idempotent."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._server = None
            self._thread = None
