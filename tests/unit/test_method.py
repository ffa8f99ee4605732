"""MethodRule (geomesh_p2p.config.method): what each method implies, with real values; the one codec-size formula."""

import dataclasses

import pytest
import torch

from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.config.method import BALANCED_METHODS, MethodRule, bytes_per_element, encoded_nbytes
from geomesh_p2p.node.peer import RunConfig

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    "method,compressed,push,agg,balanced,steps,rule,align,slots,grad",
    [
        ("geomesh", True, "sign", "int8", True, None, "meanmed", 1024, 1, False),
        ("awb", False, "fp32", "fp32", True, None, "mean", 1, 1, False),
        ("css", True, "sign", "int8", False, 7, "meanmed", 1024, 1, False),
        ("diloco", False, "fp32", "fp32", False, 7, "mean", 1, 1, False),
        ("ddp", False, "fp32", "fp32", False, 1, "mean", 1, 2, True),
    ],
)
def test_rule_of_every_method(method, compressed, push, agg, balanced, steps, rule, align, slots, grad):
    cfg = RunConfig(
        method=method,
        mode="reencode",
        aggregate_encoding="int8",
        aggregation="meanmed",
        block_size=1024,
        uniform_inner_steps=7,
    )
    m = MethodRule.from_run(cfg)
    assert (m.method, m.mode, m.compressed, m.push_encoding, m.aggregate_encoding) == (
        method,
        "reencode",
        compressed,
        push,
        agg,
    )
    assert (m.balanced, m.uniform_inner_steps, m.rule, m.part_align, m.block_size) == (
        balanced,
        steps,
        rule,
        align,
        1024,
    )
    assert (m.outer_state_slots, m.exchanges_gradient) == (slots, grad)
    assert m.balanced == (method in BALANCED_METHODS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.method = "css"  # frozen


def test_rule_refuses_unknown_values():
    with pytest.raises(ValueError, match="unknown method 'sgd'"):
        MethodRule.of("sgd")
    with pytest.raises(ValueError, match="unknown mode"):
        MethodRule.of("geomesh", mode="gossip")
    with pytest.raises(ValueError, match="block_size"):
        MethodRule.of("geomesh", block_size=0)


def test_payload_bytes_per_method():
    P, B = 1_000_000, 2048
    sign = 125_000 + 4 * 489  # ceil(P/8) + 4*ceil(P/B)
    assert MethodRule.of("geomesh", mode="relay", block_size=B).payload_bytes(P, 5) == 5 * sign
    assert MethodRule.of("css", mode="reencode", block_size=B).payload_bytes(P, 5) == 2 * sign
    assert MethodRule.of("geomesh", mode="relay", block_size=B).payload_bytes(P, 0) == sign
    for m in ("diloco", "awb", "ddp"):
        assert MethodRule.of(m, block_size=B).payload_bytes(P, 5) == 8 * P


@pytest.mark.parametrize("numel", [0, 1, 7, 8, 9, 1000, 2048, 2049, 5000, 65537])
@pytest.mark.parametrize("block", [1, 3, 64, 256, 2048])
def test_encoded_nbytes_is_the_length_of_real_encoded_bytes(numel, block):
    v = torch.randn(numel, generator=torch.Generator().manual_seed(numel + block))
    assert encoded_nbytes("sign", numel, block) == len(compression.encode(v, block, 3).to_bytes())
    assert encoded_nbytes("int8", numel, block) == len(compression.encode_int8(v, block, 3).to_bytes())
    assert encoded_nbytes("fp16", numel, block) == len(compression.encode_fp16(v, 3).to_bytes())
    assert encoded_nbytes("fp32", numel, block) == len(v.numpy().astype("<f4").tobytes()) == 4 * numel
    assert encoded_nbytes("sign", numel, block, header=False) == compression.sign_payload_nbytes(numel, block)


def test_encoded_nbytes_edges_and_per_element():
    assert encoded_nbytes("sign", 0, 256) == 32 and encoded_nbytes("fp32", 0, 256) == 0
    with pytest.raises(ValueError, match="numel"):
        encoded_nbytes("sign", -1, 256)
    with pytest.raises(ValueError, match="unknown encoding"):
        encoded_nbytes("bf16", 10, 256)
    assert bytes_per_element("sign", 2048) == 0.125 + 4 / 2048
    assert bytes_per_element("int8", 2048) == 1 + 4 / 2048
    assert bytes_per_element("fp16", 2048) == 2.0
    assert bytes_per_element("fp32", 2048) == 4.0
    assert bytes_per_element("sign", 3) == 5 / 3  # ceil(3/8) + 4 bytes per 3-element block
