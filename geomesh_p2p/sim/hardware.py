"""Hardware profiles of the simulator: peers (relative speed, memory, links) and the workloads.

A profile is a YAML file (shipped: ``paper4``, ``homogeneous4``, ``volunteer32`` in
``geomesh_p2p/sim/profiles/``; users can write their own and pass its path). It names two
workloads (DESIGN.md, "Measuring"):

* the **reference** workload whose time is *charged*: a stated model (e.g. the GeoMesh paper's
  150M-parameter LLaMA-style model, arXiv 2609.18388), its parameter count (bytes on the wire
  follow from it), its sequence length, the tokens/s a speed-1.0 GPU reaches on it and a memory
  model (bytes that do not depend on the batch + bytes per sequence) from which each peer's
  largest batch follows;
* the **trained** proxy whose *convergence* is measured: a small model preset (``tiny``) trained
  for real on the shipped corpus, on the same per-peer inner steps the planner assigns and on
  batches scaled down from the reference batches by a constant (``batch_div``), so the ratios
  between peers' token budgets are kept.

Units in the YAML: GB (10**9 bytes) for memory, Mbit/s (10**6 bits/s) for links, milliseconds for
latency, tokens/s for throughput. In Python: bytes, bytes/s, seconds (see :class:`SimPeer`).

Errors: :func:`load_profile` raises :class:`ProfileError` whose one-line message names the file
and the offending field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from geomesh_p2p.util.errors import UserFacingError
from geomesh_p2p.schema.peer import PeerRecord

__all__ = [
    "ProfileError",
    "Profile",
    "PeerSpec",
    "ReferenceSpec",
    "TrainSpec",
    "PlanSpec",
    "SimPeer",
    "load_profile",
    "parse_profile",
    "shipped_profiles",
    "PROFILE_DIR",
    "GB",
    "MBIT",
]

GB = 10**9
MBIT = 1e6 / 8  # bytes/s per Mbit/s
PROFILE_DIR = Path(__file__).with_name("profiles")


class ProfileError(UserFacingError, ValueError):
    """A profile that cannot be used; the message is one line naming the file and the field."""


class _Strict(BaseModel):
    # strict: a profile's value of the wrong type is refused, naming the field (true was taken for 1 and "8" for 8.0;
    # an int is still a float); unknown fields too
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)


class ReferenceSpec(_Strict):
    """The workload whose time is charged (never trained here)."""

    model: str = Field(description="what it stands for, e.g. '150M LLaMA-style (GeoMesh paper)'")
    params: int = Field(ge=1, description="parameters P; bytes on the wire = P x bytes per element")
    seq_len: int = Field(ge=1, description="tokens per sequence")
    peak_tokens_per_s: float = Field(gt=0, description="tokens/s of a speed-1.0 GPU at a saturating batch")
    batch_half: float = Field(
        default=2.0,
        ge=0,
        description="throughput at batch b is peak*speed*b/(b+batch_half): small batches use the GPU less",
    )
    fixed_memory_gb: float = Field(
        ge=0, description="GB that do not depend on the batch (weights, grads, optimizer, global copy)"
    )
    activation_gb_per_seq: float = Field(gt=0, description="GB of activations per sequence in the batch")
    measured_batches: list[int] = Field(
        default=[1, 2, 4, 8, 16, 32, 64, 128, 256],
        description="batch sizes profiled (those that fit go into each PeerRecord.tokens_per_s)",
    )


class TrainSpec(_Strict):
    """The proxy that is really trained (its perplexity is the convergence figure)."""

    preset: str = Field(default="tiny", description="geomesh_p2p.model.training preset")
    seq_len: int = Field(default=64, ge=2, description="tokens per training sequence")
    batch_div: float = Field(
        default=8.0, gt=0, description="trained sequences per step = round(reference batch / batch_div), >= 1"
    )
    rounds: int = Field(
        default=60,
        ge=1,
        description="token budget of every method, in DiLoCo rounds: rounds x DiLoCo's tokens per round",
    )
    inner_lr: float = Field(default=1e-3, gt=0, description="inner AdamW peak lr (Lion: see lion_lr)")
    lion_lr: float = Field(default=3e-4, gt=0, description="inner Lion peak lr when a method asks for Lion")
    warmup_frac: float = Field(default=0.02, ge=0, lt=1, description="share of each peer's inner steps in warm-up")
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    outer_lr: float = Field(default=0.7, gt=0, description="outer Nesterov lr (DiLoCo)")
    outer_momentum: float = Field(default=0.9, ge=0, lt=1)
    async_outer_lr: Optional[float] = Field(
        default=None, gt=0, description="outer lr of the async mode (None: outer_lr)"
    )
    block_size: int = Field(default=2048, ge=1, description="codec block (elements per scale)")
    clip_k: Optional[float] = Field(default=4.0, gt=0, description="scale clipping of the collective (k x median)")
    eval_batches: int = Field(default=12, ge=1, description="held-out batches per evaluation")
    eval_batch_size: int = Field(default=16, ge=1)
    seed: int = 0


WindowRule = Literal["comm_share", "match_diloco"]


class PlanSpec(_Strict):
    """Planner settings (geomesh_p2p.plan.schema.PlanConfig) for the reference workload."""

    target_batch: int = Field(default=32, ge=1, description="sequences per inner step (a floor for AWB)")
    inner_steps: int = Field(default=20, ge=1, description="H of the uniform plan (diloco, css, async)")
    comm_share: float = Field(default=0.1, gt=0, le=1, description="AWB window: comm is this share of T")
    window: dict[str, WindowRule] = Field(
        default={"awb": "match_diloco", "geomesh": "comm_share"},
        description="window rule per balanced method: 'comm_share' (T = max comm / comm_share) or"
        " 'match_diloco' (T such that the group trains DiLoCo's tokens per round)",
    )
    min_inner_steps: int = Field(default=1, ge=1)
    max_inner_steps: int = Field(default=500, ge=1)
    window_slack: float = Field(default=0.05, ge=0, le=0.5)

    @model_validator(mode="after")
    def _known_methods(self) -> "PlanSpec":
        for k in self.window:
            if k not in ("awb", "geomesh"):
                raise ValueError(f"window rule given for {k!r}; only 'awb' and 'geomesh' are balanced")
        return self


class PeerSpec(_Strict):
    """One peer (or ``count`` identical ones) of a profile."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    gpu: str = Field(default="", description="GPU model, for the tables")
    speed: float = Field(gt=0, description="throughput relative to the speed-1.0 reference GPU")
    memory_gb: float = Field(gt=0, description="GPU memory usable for training, GB")
    up_mbps: float = Field(gt=0, description="upload bandwidth, Mbit/s")
    down_mbps: Optional[float] = Field(default=None, gt=0, description="download, Mbit/s (default: up_mbps)")
    latency_ms: float = Field(default=0.0, ge=0, description="one-way latency to the WAN core, ms")
    client_only: bool = Field(default=False, description="behind NAT: owns no collective part")
    count: int = Field(default=1, ge=1, le=1024, description="replicate this peer (names get -1, -2, ...)")
    region: str = ""


class Profile(_Strict):
    """A whole profile (see the module docstring)."""

    name: str
    description: str = ""
    source: str = ""
    reference: ReferenceSpec
    train: TrainSpec = TrainSpec()
    plan: PlanSpec = PlanSpec()
    target_ppl: Optional[float] = Field(default=None, gt=1, description="perplexity for 'time to target'")
    speed_jitter: float = Field(
        default=0.0, ge=0, le=1, description="per-round lognormal sigma of each peer's speed (0: steady)"
    )
    peers: list[PeerSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> "Profile":
        names = [p.name for p in self.peers]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"duplicate peer name {dup[0]!r}")
        if all(p.client_only for p in self.peers):
            raise ValueError("every peer is client_only: nobody can own a collective part")
        return self

    # ----------------------------------------------------------------------------- derived
    def sim_peers(self) -> list["SimPeer"]:
        """The expanded peers, in profile order (= sorted peer_id order). Raises ProfileError when a
        peer's memory cannot hold one reference sequence."""
        out: list[SimPeer] = []
        ref = self.reference
        for spec in self.peers:
            for k in range(spec.count):
                name = spec.name if spec.count == 1 else f"{spec.name}-{k + 1}"
                idx = len(out)
                free = spec.memory_gb - ref.fixed_memory_gb
                max_batch = int(math.floor(free / ref.activation_gb_per_seq + 1e-9)) if free > 0 else 0
                if max_batch < 1:
                    raise ProfileError(
                        f"profile {self.name}: peer {name}: memory_gb={spec.memory_gb} cannot hold one"
                        f" sequence of the reference model (needs {ref.fixed_memory_gb + ref.activation_gb_per_seq} GB)"
                    )
                out.append(
                    SimPeer(
                        peer_id=f"p{idx:03d}-{name}",
                        name=name,
                        gpu=spec.gpu or spec.name,
                        speed=spec.speed,
                        memory_bytes=int(spec.memory_gb * GB),
                        max_batch=max_batch,
                        up_bps=spec.up_mbps * MBIT,
                        down_bps=(spec.down_mbps or spec.up_mbps) * MBIT,
                        latency_s=spec.latency_ms / 1000.0,
                        client_only=spec.client_only,
                        region=spec.region,
                    )
                )
        return out


@dataclass(frozen=True)
class SimPeer:
    """One simulated peer. Units: bytes, bytes/s, seconds; ``speed`` relative to the reference GPU."""

    peer_id: str
    name: str
    gpu: str
    speed: float
    memory_bytes: int
    max_batch: int
    up_bps: float
    down_bps: float
    latency_s: float
    client_only: bool
    region: str = ""

    def tokens_per_s(self, ref: ReferenceSpec, batch: float, speed_factor: float = 1.0) -> float:
        """Reference-workload tokens/s at ``batch`` sequences: ``peak*speed*b/(b+batch_half)``."""
        return ref.peak_tokens_per_s * self.speed * speed_factor * batch / (batch + ref.batch_half)

    def record(self, ref: ReferenceSpec, speed_factor: float = 1.0) -> PeerRecord:
        """The PeerRecord this peer would announce for the reference workload (what the planner
        sees). ``speed_factor`` scales the measured throughput (re-profiling under jitter)."""
        measured = [b for b in ref.measured_batches if b <= self.max_batch] or [self.max_batch]
        return PeerRecord(
            peer_id=self.peer_id,
            address=None if self.client_only else f"sim://{self.name}",
            device=self.gpu,
            memory_bytes=self.memory_bytes,
            tokens_per_s={b: self.tokens_per_s(ref, b, speed_factor) for b in measured},
            max_batch=self.max_batch,
            upload_bps=self.up_bps,
            download_bps=self.down_bps,
            version="sim",
            run_config_hash="sim",
            timestamp=0.0,
        )


# --------------------------------------------------------------------------------- loading


def shipped_profiles() -> list[str]:
    """Names of the profiles shipped with the package."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def _fmt_loc(loc) -> str:
    out = ""
    for x in loc:
        out += f"[{x}]" if isinstance(x, int) else (f".{x}" if out else str(x))
    return out or "(top level)"


def parse_profile(text: str, source: str = "<profile>") -> Profile:
    """Parse YAML text into a :class:`Profile`; ProfileError (one line, naming ``source``) otherwise."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ProfileError(f"profile {source}: invalid YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"profile {source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        prof = Profile.model_validate(data)
    except ValidationError as e:
        errs = e.errors()
        first = errs[0]
        msg = first.get("msg", "invalid").replace("\n", " ")
        if first.get("type") == "missing":
            msg = "missing required field"
        elif first.get("type") == "extra_forbidden":
            msg = "unknown field"
        more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
        raise ProfileError(f"profile {source}: {_fmt_loc(first.get('loc', ()))}: {msg}{more}") from None
    try:
        prof.sim_peers()
    except ProfileError as e:
        raise ProfileError(str(e).replace(f"profile {prof.name}:", f"profile {source}:", 1)) from None
    return prof


def load_profile(name_or_path: Union[str, Path]) -> Profile:
    """A shipped profile by name (``paper4``) or a YAML file by path.

    Raises ProfileError: unknown name, unreadable file, invalid YAML or an invalid field.
    """
    s = str(name_or_path)
    p = Path(s).expanduser()
    looks_like_path = p.suffix in (".yaml", ".yml") or "/" in s or p.is_file()
    if not looks_like_path:
        shipped = PROFILE_DIR / f"{s}.yaml"
        if not shipped.is_file():
            raise ProfileError(
                f"unknown profile {s!r} (shipped: {', '.join(shipped_profiles())}; or give a path to a .yaml file)"
            )
        p = shipped
    if not p.is_file():
        raise ProfileError(f"profile file not found: {p}")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ProfileError(f"cannot read profile file {p}: {e}") from None
    return parse_profile(text, source=str(p) if looks_like_path else p.name)
