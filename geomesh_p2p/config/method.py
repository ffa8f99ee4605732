"""One rule per training method: what ``RunConfig.method`` implies for the exchange, the plan and
the outer optimizer, decided in one place (issue 13).

Before this module, ``method in ("geomesh", "css")`` and ``method == "ddp"`` tests were repeated
in the node, the planner and the simulator; each copy had to agree with the others. Now they ask
:class:`MethodRule`:

* ``geomesh`` — AWB budgets (per-peer inner steps) + CSS sign-compressed pseudo-gradients.
* ``awb`` — AWB budgets, fp32 pseudo-gradients (Adaptive Batch-Size / workload balancing alone).
* ``css`` — uniform inner steps, sign-compressed pseudo-gradients (CSS alone).
* ``diloco`` — uniform inner steps, fp32 pseudo-gradients, Nesterov outer step
  (Douillard et al. 2023, arXiv 2311.08105).
* ``ddp`` — data-parallel baseline: one inner step per round, the exchanged vector is the batch's
  gradient and the "outer" step is AdamW on the swarm's mean gradient (2 state vectors of P).

Pure Python (no torch): the simulator and the planner import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

__all__ = [
    "METHODS",
    "BALANCED_METHODS",
    "COMPRESSED_METHODS",
    "ENCODINGS",
    "CODEC_HEADER_BYTES",
    "encoded_nbytes",
    "bytes_per_element",
    "MethodRule",
    "MODES",
    "AUTO_ACCOUNTABLE_FROM",
    "round_mode",
]

#: encodings a vector travels in: uncompressed fp32 and the codec's kinds (geomesh_p2p.exchange.codec)
ENCODINGS = ("fp32", "sign", "int8", "fp16")
#: the codec's fixed header (geomesh_p2p.exchange.codec._format.HEADER_SIZE; kept here so this module
#: imports no torch: the planner and the simulator's clock use it)
CODEC_HEADER_BYTES = 32

#: every method a run may use (``RunConfig.method``)
METHODS = ("geomesh", "awb", "css", "diloco", "ddp")
#: methods planned with AWB (per-peer step budgets); the others get the uniform plan
BALANCED_METHODS = frozenset({"geomesh", "awb"})
#: methods whose contributions are CSS sign packets; the others push fp32
COMPRESSED_METHODS = frozenset({"geomesh", "css"})

#: a run's exchange modes (``RunConfig.mode``); a round's (the plan's, the spec's) is one of the first three
MODES = ("relay", "reencode", "accountable", "auto")
#: ``--mode auto``: rounds of this many participants or more run ``accountable``, smaller ones ``relay``. The
#: crossover is measured (docs/collective.md, "Cheaper than relay from N = 4"): accountable with verified work's
#: fetches costs less than relay from 4 participants in the steady state and in the measurement, from 5 by every
#: figure (the model's screened rounds included), so 5.
AUTO_ACCOUNTABLE_FROM = 5


def round_mode(mode: str, n_participants: int, method: str = "geomesh") -> str:
    """The exchange mode of one round: ``mode`` itself unless it is ``"auto"``; then ``"accountable"`` for a
    sign-compressed ``method`` (:data:`COMPRESSED_METHODS`) in a round of at least :data:`AUTO_ACCOUNTABLE_FROM`
    participants (where it moves fewer bytes than relay: ~(3 - 2/N) P/8 against ~N P/8 per peer), else
    ``"relay"`` (cheaper below, and every reader sees every signed contribution). The same at every peer: it
    depends on the plan's participant count alone, which every follower checks.

    Raises ValueError for an unknown mode."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} ({', '.join(MODES)})")
    if mode != "auto":
        return mode
    return "accountable" if method in COMPRESSED_METHODS and n_participants >= AUTO_ACCOUNTABLE_FROM else "relay"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def encoded_nbytes(kind: str, numel: int, block_size: int, *, header: bool = True) -> int:
    """Exact bytes of ``numel`` fp32 elements encoded as ``kind`` — THE codec-size formula: the
    codec's packets (``compression.SignPacket.nbytes`` ...), the collective's part limits, the
    planner's payload estimate and the simulator's clock all call this.

    * ``"fp32"``: ``4 * P`` (raw little-endian fp32, no header: the baselines' contributions);
    * ``"sign"``: ``32 + ceil(P/8) + 4 * ceil(P/B)`` (1 bit per element, one fp32 scale per block);
    * ``"int8"``: ``32 + P + 4 * ceil(P/B)``;
    * ``"fp16"``: ``32 + 2 * P`` (no blocks).

    ``header=False`` leaves the 32-byte codec header out (the payload alone); an empty packet
    (``numel == 0``) is its header alone. Raises ValueError for an unknown ``kind``, ``numel`` < 0
    or ``block_size`` < 1.
    """
    if kind not in ENCODINGS:
        raise ValueError(f"unknown encoding {kind!r} ({', '.join(ENCODINGS)})")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if kind == "fp32":
        return 4 * numel
    head = CODEC_HEADER_BYTES if header else 0
    if kind == "sign":
        return head + _ceil_div(numel, 8) + 4 * _ceil_div(numel, block_size)
    if kind == "int8":
        return head + numel + 4 * _ceil_div(numel, block_size)
    return head + 2 * numel


def bytes_per_element(kind: str, block_size: int) -> float:
    """Payload bytes per element of ``kind`` in the long run (headers aside), from
    :func:`encoded_nbytes` of one block: an upper bound of ``encoded_nbytes(kind, n, B, header=False) / n``
    for every ``n`` that is a multiple of ``block_size`` (sign: ``ceil(B/8)/B + 4/B``)."""
    return encoded_nbytes(kind, block_size, block_size, header=False) / block_size


@dataclass(frozen=True)
class MethodRule:
    """What one method means for a round. Build with :meth:`from_run` (or :meth:`of`).

    Attributes:
        method: "geomesh", "awb", "css", "diloco" or "ddp".
        mode: "relay" (every peer aggregates the signed contributions), "reencode", "accountable"
            (reencode with receipts, committed results and validators: ``exchange.accountable``) or "auto"
            (per round, :func:`round_mode`: relay below :data:`AUTO_ACCOUNTABLE_FROM` participants, else
            accountable).
        compressed: contributions are sign packets (geomesh, css); else fp32.
        push_encoding: "sign" or "fp32": encoding of the contributions pushed to part owners.
        aggregate_encoding: reencode-mode encoding of an owner's aggregate: the run's
            ``aggregate_encoding`` ("sign", "int8", "fp16") when compressed, else "fp32".
        balanced: per-peer step budgets (AWB planner, ``plan.awb.plan_round``); else the same steps
            for everyone (``plan.uniform.plan_uniform``).
        uniform_inner_steps: inner steps of every peer in a uniform plan (1 for ddp: a sync every
            step); None for balanced methods (the planner picks each peer's).
        rule: the robust aggregation rule of every part (``aggregation.py``): the run's
            ``aggregation`` when compressed; "mean" for fp32 (the robust rules work on signs).
        block_size: codec block B (elements per fp32 scale).
        part_align: partition parts are multiples of this many elements: ``block_size`` when
            compressed (a part's blocks are the blocks of the whole vector), else 1.
        outer_state_slots: outer optimizer state in units of P fp32 elements: 1 (Nesterov
            momentum), 2 for ddp (AdamW's two moments).
        exchanges_gradient: ddp: the exchanged vector is the batch gradient, not
            ``theta - theta_after_inner_steps``.
        validators_per_part: accountable mode: validators drawn per part (each pulls the part's inputs).
    """

    method: str
    mode: str
    compressed: bool
    push_encoding: str
    aggregate_encoding: str
    balanced: bool
    uniform_inner_steps: Optional[int]
    rule: str
    block_size: int
    part_align: int
    outer_state_slots: int
    exchanges_gradient: bool
    validators_per_part: int = 1

    @classmethod
    def of(
        cls,
        method: str,
        *,
        mode: str = "relay",
        aggregate_encoding: str = "sign",
        aggregation: str = "meanmed",
        block_size: int = 2048,
        uniform_inner_steps: int = 20,
        validators_per_part: int = 1,
    ) -> "MethodRule":
        """The rule of ``method`` under these run settings (same meaning as ``RunConfig``'s fields).

        Raises ValueError for an unknown method or mode, or ``block_size`` / ``uniform_inner_steps`` < 1.
        """
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r} (known: {', '.join(METHODS)})")
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r} ({', '.join(MODES)})")
        if block_size < 1 or uniform_inner_steps < 1:
            raise ValueError(f"block_size={block_size} and uniform_inner_steps={uniform_inner_steps} must be >= 1")
        compressed = method in COMPRESSED_METHODS
        balanced = method in BALANCED_METHODS
        ddp = method == "ddp"
        return cls(
            method=method,
            mode=mode,
            compressed=compressed,
            push_encoding="sign" if compressed else "fp32",
            aggregate_encoding=aggregate_encoding if compressed else "fp32",
            balanced=balanced,
            uniform_inner_steps=None if balanced else (1 if ddp else uniform_inner_steps),
            rule=aggregation if compressed else "mean",
            block_size=block_size,
            part_align=block_size if compressed else 1,
            outer_state_slots=2 if ddp else 1,
            exchanges_gradient=ddp,
            validators_per_part=int(validators_per_part),
        )

    @classmethod
    def from_run(cls, run_cfg: Any) -> "MethodRule":
        """The rule of a ``geomesh_p2p.node.peer.RunConfig`` (fields ``method``, ``mode``,
        ``aggregate_encoding``, ``aggregation``, ``block_size``, ``uniform_inner_steps``)."""
        return cls.of(
            run_cfg.method,
            mode=run_cfg.mode,
            aggregate_encoding=run_cfg.aggregate_encoding,
            aggregation=run_cfg.aggregation,
            block_size=run_cfg.block_size,
            uniform_inner_steps=run_cfg.uniform_inner_steps,
            validators_per_part=getattr(run_cfg, "validators_per_part", 1),
        )

    def payload_bytes(self, numel: int, n_peers: int) -> int:
        """Planner estimate of the bytes one peer sends (and receives) in one exchange of a
        ``numel``-element vector among ``n_peers`` peers (``PlanConfig.payload_bytes``).

        fp32: ``2 * 4 * numel`` (push + pull of the whole vector, the butterfly all-reduce).
        Compressed: one sign packet of the whole vector ``S`` (:func:`encoded_nbytes`,
        headers aside); reencode: ``2 * S``; relay: ``S * n_peers`` (every contribution is relayed);
        accountable: ``(2 + V) * S + S / n_peers - V * S / n_peers`` (push, pull, each of the V validations per
        part pulls one part's inputs but the validator's own: ~S (n - 1) / n per peer per validator, and the
        owner's own contribution to its part's witness: one part; docs/collective.md, "Accountable mode");
        auto: that of the round's mode (:func:`round_mode` of ``n_peers``).
        """
        if not self.compressed:
            return 2 * encoded_nbytes("fp32", numel, self.block_size)
        s = encoded_nbytes("sign", numel, self.block_size, header=False)
        mode = round_mode(self.mode, n_peers, self.method)
        if mode == "accountable":
            v, n = self.validators_per_part, max(1, n_peers)
            return (2 + v) * s + s // n - v * (s // n)
        return 2 * s if mode == "reencode" else s * max(1, n_peers)
