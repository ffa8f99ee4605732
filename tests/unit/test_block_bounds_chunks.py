"""Issue 27 (session 44): :func:`geomesh_p2p.model.optim.block_bounds` reads the aggregate a chunk of whole blocks
at a time (``BOUNDS_CHUNK``) instead of taking ``|g|`` of the whole part: the same bits as the whole-part
computation for any length, block size and chunk, NaNs and infinities included."""

import pytest
import torch

import geomesh_p2p.model.optim as optim

pytestmark = pytest.mark.timeout(60)


def whole(g: torch.Tensor, block: int, c: float) -> torch.Tensor:
    """The computation before: ``|g|`` of the whole vector, then each block's max (the last one may be shorter)."""
    n, nfull = g.numel(), g.numel() // block
    parts = [torch.abs(g[: nfull * block]).view(nfull, block).amax(dim=1)] if nfull else []
    if nfull * block < n:
        parts.append(torch.abs(g[nfull * block :]).amax().reshape(1))
    return torch.mul(torch.cat(parts) if parts else torch.zeros(0), float(c))


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000, 1 << 20])
def test_chunked_bounds_are_the_whole_parts_bits(chunk, monkeypatch):
    monkeypatch.setattr(optim, "BOUNDS_CHUNK", chunk)
    g = torch.Generator().manual_seed(chunk)
    for n, block in ((0, 8), (5, 8), (64, 8), (1001, 16), (70_000, 2048), (4096, 2048)):
        x = torch.randn(n, generator=g) * 3
        if n > 10:
            x[3], x[n - 2] = float("nan"), float("-inf")
        got, want = optim.block_bounds(x, block, 0.8), whole(x, block, 0.8)
        assert got.shape == (-(-n // block),) and got.dtype == torch.float32
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (n, block, chunk)  # the bits, NaNs too
    assert optim.block_bounds(torch.tensor([1.0, -3.0, 2.0, 0.5]), 2, 2.0).tolist() == [6.0, 4.0]
