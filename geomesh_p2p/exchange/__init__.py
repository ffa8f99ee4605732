"""Compressed sign synchronization (CSS) over gRPC: a reduce-scatter / all-gather of signed parts.

Source: GeoMesh (arXiv 2609.18388), "Compressed sign synchronization"; the partition and the
push-to-owner / pull-from-owner pattern follow hivemind's butterfly all-reduce
(``hivemind.averaging.allreduce``) and its ``load_balance_peers`` (``hivemind.averaging.load_balancing``).
DESIGN.md, "Round r" step 4 (Exchange) and step 6 (Failures), "Identity and trust".

One round, one group (see docs/collective.md for the whole protocol and its rules):

* The flat fp32 pseudo-gradient of ``numel`` elements is split into contiguous parts, one per
  *owner* (:class:`PartOwner`, sizes from :func:`make_partition`). Client-only peers own nothing.
* Every participant signs and **pushes** part ``j`` (sign-encoded, with its token count) to owner
  ``j`` (``PushPart``; the owner's own part is accepted locally, no RPC).
* The owner **closes** part ``j`` when every participant has pushed it or at ``spec.deadline``;
  later pushes are refused (``FAILED_PRECONDITION``) and those senders are left out of that part.
* Every participant **pulls** part ``j`` from its owner (``PullPart``, long poll, re-polled until
  ``spec.pull_deadline``). The owner answers with a :class:`PartResult` *signed by the owner*:
  ``relay`` -> the senders' own signed contributions and whom it took; ``reencode`` -> the
  token-weighted mean it computed, encoded as sign / int8 / fp16 (or fp32 for the baseline);
  ``accountable`` -> as reencode, plus signed receipts of the pushes and a result committed to its inputs,
  re-checked after the round by drawn validators (:mod:`.accountable`, :mod:`.audit`; BTARD, Gorbunov et
  al., ICML 2022).
* Every RPC is started by the side that needs the other (senders push, readers pull), so a
  client-only peer only ever makes outbound calls.

Determinism. The mean of a part is :func:`token_weighted_mean` over the contributions sorted by raw
PeerID bytes, with one fixed sequence of fp32 operations (each one IEEE rounding, no fused
kernels), so relay-mode peers and a reencode-mode owner compute bit-identical vectors, and every
peer ends with the same aggregate bitwise. Robustness rules (same everywhere): token counts are
``min(claimed, cap)``; per block, each contributor's scale is clipped to ``clip_k x`` the median of
that block's scales over the part's contributors.

Failures. A sender that does not deliver part ``j`` before the deadline is absent from part ``j``
(every peer uses the owner's list). A part whose owner is gone -- no result by ``pull_deadline``,
from the owner or from any other serving peer that cached the owner's signed result -- is a zero
update for that range, logged, and listed in :attr:`AllReduceResult.missing_parts`.

Modules (issue 13): :mod:`.spec` (owners, parts, splitting, the spec), :mod:`.aggregate` (the
token-weighted mean and aggregate encode / decode: pure tensor code), :mod:`.messages` (build /
sign / check contributions and part results: pure, synchronous), :mod:`.owner` (server side),
:mod:`.client` (``all_reduce`` and its retry loops). Every public name is importable from here.
"""

from __future__ import annotations

from geomesh_p2p.exchange.robust import token_weighted_mean
from geomesh_p2p.exchange.aggregate import decode_aggregate, encode_aggregate, fp32_to_bytes, fp32_view
from geomesh_p2p.exchange.client import _RETRY_PULL, _RETRY_PUSH, _held  # noqa: F401  (older names)
from geomesh_p2p.exchange.client import AllReduceResult, CollectiveService
from geomesh_p2p.exchange.groups import GroupedCollective, GroupLayout, group_layout
from geomesh_p2p.exchange.messages import CONTRIBUTION_KIND, RESULT_KIND, Contribution
from geomesh_p2p.exchange.accountable import RECEIPT_KIND, ProofError, ProofVerdict, verify_proof
from geomesh_p2p.exchange.audit import Finding
from geomesh_p2p.exchange.owner import _OwnedPart, _RoundState  # noqa: F401  (verify.py reads _rounds)
from geomesh_p2p.exchange.owner import OwnerService
from geomesh_p2p.exchange.partition import (
    AGGREGATE_ENCODINGS,
    MODES,
    PUSH_ENCODINGS,
    CollectiveSpec,
    PIPELINE_PART_BYTES,
    PartOwner,
    _pid_bytes,  # noqa: F401
    _pid_str,  # noqa: F401
    _short,  # noqa: F401
    make_partition,
    max_part_elements,
    split_owners,
)

__all__ = [
    "CollectiveService",
    "GroupedCollective",
    "GroupLayout",
    "group_layout",
    "CollectiveSpec",
    "PartOwner",
    "AllReduceResult",
    "OwnerService",
    "Contribution",
    "make_partition",
    "max_part_elements",
    "split_owners",
    "token_weighted_mean",
    "PIPELINE_PART_BYTES",
    "CONTRIBUTION_KIND",
    "RESULT_KIND",
    "RECEIPT_KIND",
    "ProofError",
    "ProofVerdict",
    "verify_proof",
    "Finding",
    "MODES",
    "PUSH_ENCODINGS",
    "AGGREGATE_ENCODINGS",
    "fp32_to_bytes",
    "fp32_view",
    "encode_aggregate",
    "decode_aggregate",
]

# Names of the single-module version, kept importable for older code and tests.
_Contribution = Contribution
_fp32_to_bytes = fp32_to_bytes
_encode_aggregate = encode_aggregate
_decode_aggregate = decode_aggregate


def _fp32_from_bytes(data: bytes, numel: int):
    """Raw little-endian fp32 -> a writable fp32 tensor [numel] (a copy); CodecError on a wrong
    length or NaN/Inf. (The exchange itself uses the zero-copy :func:`fp32_view`.)"""
    return fp32_view(data, numel).clone()
