"""Run and node configuration (moved out of :mod:`geomesh_p2p.node`, which re-exports both).

:class:`RunConfig` is what every peer of a run shares (its hash is in every PeerRecord);
:class:`NodeConfig` is one peer's own settings.
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from geomesh_p2p.admission import DEFAULT_POW_BITS, MAX_POW_BITS

__all__ = ["RunConfig", "NodeConfig"]


class RunConfig(BaseModel):
    """What every peer of a run shares; its hash is in every PeerRecord and mismatches are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str = "geomesh-demo"
    model: str = Field("tiny", description="model preset, or the SHA-256 of --model-config's contents")
    model_config_json: Optional[str] = Field(None, description="contents of --model-config, if given")
    data: str = Field("kjv", description="'kjv' (shipped) or an identifier of --data's contents")
    vocab_size: int = 4096
    seq_len: int = 64
    seed: int = 0
    method: Literal["geomesh", "awb", "css", "diloco", "ddp"] = "geomesh"
    mode: Literal["relay", "reencode"] = Field(
        "relay", description="relay: every peer aggregates the signed contributions itself (an owner cannot forge "
                             "the update); reencode: the owner sends its re-encoded aggregate (fewer bytes; trusted owners)")
    aggregate_encoding: Literal["sign", "int8", "fp16"] = "sign"
    block_size: int = 2048
    error_feedback: bool = False
    clip_k: float = 4.0
    aggregation: Literal["mean", "meanmed", "vote"] = Field(
        "meanmed", description="rule of every part (geomesh_p2p.aggregation): robust 'meanmed' / 'vote', or 'mean'")
    weight_cap: Optional[float] = Field(1.0, gt=0, description="no contributor weighs more than this x the median weight")
    min_agreement: Optional[float] = Field(
        0.5, gt=0, le=1, description="robust rules drop a contribution agreeing with the consensus on fewer elements")
    quorum: float = Field(0.5, ge=0, le=1, description="a part result must aggregate this share of the participants")
    inner_optimizer: Literal["adamw", "lion"] = "adamw"
    inner_lr: float = 1e-3
    warmup_steps: int = 20
    total_inner_steps: int = 2000
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    target_batch: int = 8
    window_s: Optional[float] = 6.0
    uniform_inner_steps: int = 20
    comm_share: float = 0.1
    max_inner_steps: int = 200
    pow_bits: int = Field(DEFAULT_POW_BITS, ge=0, le=MAX_POW_BITS,
                          description="proof of work per identity (leading zero bits of SHA-256; admission.py); "
                                      "records without it are ignored. 0 = off (private runs use --allow-peers)")

    @model_validator(mode="after")
    def _ddp_uses_adamw(self) -> "RunConfig":
        if self.method == "ddp" and self.inner_optimizer != "adamw":
            raise ValueError("method 'ddp' applies AdamW to the averaged gradient; use inner_optimizer 'adamw'")
        return self

    def config_hash(self) -> str:
        """First 16 hex chars of SHA-256 of the canonical JSON of this config."""
        return hashlib.sha256(json.dumps(self.model_dump(), sort_keys=True).encode()).hexdigest()[:16]

    def diff(self, other: "RunConfig") -> list[str]:
        """Human-readable differences, e.g. ["inner_lr: 0.001 vs 0.0003"]."""
        a, b = self.model_dump(), other.model_dump()
        return [f"{k}: {a[k]!r} vs {b[k]!r}" for k in a if a[k] != b[k]]


class NodeConfig(BaseModel):
    """Per-peer settings (not shared). Units: seconds, bytes, bytes/s."""

    model_config = ConfigDict(extra="forbid")

    bootstrap: list[str] = Field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: Optional[str] = None
    client_only: bool = False
    identity: str = "~/.geomesh/identity.key"
    device: str = "auto"
    threads: Optional[int] = None
    data_path: Optional[str] = None
    model_config_file: Optional[str] = None
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 5
    checkpoint_keep: int = 3
    resume: bool = False
    on_empty_swarm: Literal["wait", "resume", "seed"] = Field(
        "wait", description="a bootstrap saw the run at round N > 0 but no peer of it is live: wait for one, "
                            "resume from --checkpoint-dir's newest checkpoint, or start from the seed at round 0")
    rounds: Optional[int] = None
    target_ppl: Optional[float] = None
    min_peers: int = 1
    wait_peers_s: float = 60.0
    speed_factor: float = 1.0
    memory_budget_bytes: Optional[int] = None
    upload_bps: Optional[float] = None
    download_bps: Optional[float] = None
    probe_bytes: int = Field(4 << 20, gt=0, le=4 << 20, description="bytes each way of the start-up link probe")
    min_link_sample_bytes: int = Field(64 << 10, ge=1, description="smallest round sample used to update a link EMA")
    ema_alpha: float = Field(0.3, gt=0, le=1, description="weight of a new measurement in the re-profiling EMAs")
    link_step_ratio: float = Field(4.0, ge=1, description="most a round's link sample may move the figure (x or /)")
    added_latency_s: float = 0.0
    profile_batches: list[int] = Field(default_factory=lambda: [4, 8, 16])
    amp: bool = Field(True, description="bf16 autocast for the forward pass on CUDA (ignored on CPU)")
    eval_batches: int = 8
    eval_every: int = Field(1, ge=1, description="evaluate every this many rounds (and at the last)")
    announce_period_s: float = 2.0
    plan_timeout_s: float = 4.0
    gather_wait_s: float = 4.0
    log_json: Optional[str] = None
    metrics_port: Optional[int] = None
    metrics_host: str = Field("127.0.0.1", description="interface of the Prometheus metrics (0.0.0.0: every one)")
    summary_json: Optional[str] = None
    allow_peers: Optional[list[str]] = Field(
        None, description="private run: base58 PeerIDs / public keys of the only peers this node deals with")

