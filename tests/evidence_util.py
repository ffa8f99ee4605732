"""Synthetic verified-work evidence of any number of parts for tests of its wire form (no model, no
check run: fast). The evidence is valid: signed by its verifier, its selection the verifier's signature
of the round, its task consistent, and each part's contribution a small sign packet really signed by the
accused, whose digest the evidence names."""

from __future__ import annotations

import torch

from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.trust.evidence import Evidence
from geomesh_p2p.trust.verify_check import FAIL, packet_digest
from geomesh_p2p.trust.verify_task import VerifyTask, selection_message
from geomesh_p2p.wire import collective_pb2

CONTRIBUTION_KIND = "geomesh.collective/Contribution"
START_DIGEST = "ab" * 32


def signed_contribution(
    ident: Identity, run_id: str, round: int, part: int, start: int, end: int, seed: int = 0
) -> tuple[bytes, str]:
    """The accused's signed PartContribution (SignedMessage bytes) of a random sign packet over
    ``[start, end)``, and the packet's digest."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + part)
    packet = compression.encode(torch.randn(end - start, generator=g), 64, 1)
    c = collective_pb2.PartContribution(
        round=round, part=part, start=start, end=end, tokens=1, spec_id=b"s" * 32, encoding="sign",
        packet=packet.to_bytes(),
    )  # fmt: skip
    signed = ident.sign_message(run_id=run_id, round=round, kind=CONTRIBUTION_KIND, payload=c.SerializeToString())
    return signed.SerializeToString(), packet_digest(packet)


def big_evidence(
    n_parts: int,
    *,
    run_id: str,
    round: int = 4,
    part_elems: int = 128,
    verifier: Identity | None = None,
    accused: Identity | None = None,
    seed: int = 0,
) -> Evidence:
    """Evidence against ``accused`` over ``n_parts`` parts of ``part_elems`` elements each, with every
    part's signed contribution attached (``ev.contributions``). ``ev.verifier_key`` is left empty (as
    for evidence made by a check, before :meth:`Evidence.open` fills it)."""
    v = verifier or Identity.generate()
    a = accused or Identity.generate()
    ranges = tuple((j * part_elems, (j + 1) * part_elems) for j in range(n_parts))
    packets, contributions = {}, {}
    for j, (s, e) in enumerate(ranges):
        contributions[j], packets[j] = signed_contribution(a, run_id, round, j, s, e, seed)
    task = VerifyTask(
        round=round,
        verifier=str(v.peer_id),
        accused=str(a.peer_id),
        parts=tuple(range(n_parts)),
        ranges=ranges,
        steps_done=40,
        steps=(1, 7, 12, 19, 25, 33, 38, 39),
        controls=4,
        batch_size=8,
        seq_len=64,
        element_seed=123456789,
        n_elements=1 << 18,
        full_test=True,
    )
    return Evidence(
        run_id=run_id,
        round=round,
        verifier=str(v.peer_id),
        accused=str(a.peer_id),
        start_digest=START_DIGEST,
        selection=v.sign(selection_message(run_id, round, START_DIGEST)),
        task=task,
        packets=packets,
        basis=[(str(v.peer_id), "cd" * 32)],
        plain=0.12,
        trace=0.31,
        outcome=FAIL,
        reason="plain 0.120 < 0.55",
        contributions=contributions,
    )
