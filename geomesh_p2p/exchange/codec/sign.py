"""Sign codec of Compressed Sign Synchronization (CSS), GeoMesh (arXiv 2609.18388).

A float vector v of P elements is sent as

* one sign bit per element, packed 8 to a byte, and
* one fp32 scale per block of B consecutive elements: the mean of |v| over the block
  (the last block, which may be shorter, averages over its real elements only);

and decodes to ``scale[block(i)] * (+1 | -1)``: a scaled signSGD message
(Bernstein et al. 2018, "signSGD: compressed optimisation for non-convex problems").

Conventions (part of the wire format):

* **Sign of zero.** Bit 1 means negative, bit 0 non-negative. An element is negative iff
  ``v < 0``, so both ``+0.0`` and ``-0.0`` encode as ``+`` and decode to ``+scale``.
* **Bit order.** Little-endian within a byte: element ``8k + j`` is bit ``j`` (value ``1 << j``)
  of byte ``k`` (numpy ``packbits(..., bitorder="little")``). Unused high bits of the last
  byte are 0, and a packet whose padding bits are not 0 is rejected.
* **Decoding** is one fp32 multiply per element, ``scale * (+1.0 or -1.0)``, which is exact,
  so every machine and device decodes the same bytes to bit-identical values.
* **Encoding** is deterministic for a given machine; the block sums behind the scales are
  fp32 reductions whose rounding may differ in the last place between CPU vector widths and
  GPUs. The bytes a sender produced are the reference everyone decodes.

Wire layout of a sign packet: the 32-byte header (see ``_format``) with kind 1, then
``4 * ceil(P/B)`` bytes of scales (fp32 little-endian), then ``ceil(P/8)`` bytes of signs.
Total ``32 + ceil(P/8) + 4*ceil(P/B)`` bytes: for B = 2048 and large P that is 4P / 31.5.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from geomesh_p2p.config.method import encoded_nbytes

from geomesh_p2p.exchange.codec._format import (
    DEFAULT_BLOCK_SIZE,
    HEADER_SIZE,
    KIND_SIGN,
    CodecError,
    block_packet_bytes,
    as_flat_fp32,
    ceil_div,
    check_block_packet,
    check_block_size,
    check_length,
    check_tokens,
    raise_non_finite,
    read_array,
    unpack_header,
)

__all__ = ["SignPacket", "encode", "decode", "sign_payload_nbytes"]

# Work is split into chunks that start on a byte and block boundary, so that each chunk's
# temporaries stay in cache and the vector itself is read (encode) or written (decode) once in
# main memory. On CPU every torch op must run inline in its thread: an OpenMP team per op costs
# a fork/join barrier, which on shared cores waits for whichever thread was descheduled.
#
# * Serial worker threads (the default where torch's OpenMP runtime allows it): pool threads whose
#   own OpenMP thread count is 1 (``_make_thread_serial``; other threads keep theirs) run chunks of
#   up to ``_SERIAL_CHUNK`` elements, taken from a shared counter (a descheduled thread holds up
#   one chunk, not a fixed share). Large chunks amortise the 2-12 us of Python, dispatch and GIL
#   hand-over per op (torch.sum's is the largest); the chunk and its scratch sit in L2/L3.
# * Otherwise chunks hold fewer than at::internal::GRAIN_SIZE (32768) elements, so the ops run
#   inline in any thread, on a pool of threads with fixed shares (the caller's thread included).
#
# torch ops release the GIL, so the threads run in parallel. On CUDA chunks only bound temporaries.
_GRAIN = 32768
_SERIAL_CHUNK = 1 << 18  # elements (1 MiB of fp32): fastest of 2**15 .. 2**20 on the 2-core test VM
_SERIAL_MIN = 1 << 18  # fewer elements: no hand-over to the pool (it costs ~0.1 ms)
_CPU_BIG_CHUNK = 1 << 19  # lcm(8, B) >= _GRAIN without serial threads: OpenMP ops in the caller
_CUDA_CHUNK = 1 << 24
_MAX_ALIGN = 1 << 22  # lcm(8, B) above this: one unchunked segment
_MIN_CHUNKS_PER_WORKER = 4

# x * _GATHER puts the low bits of the 8 bytes of x (bytes 0..7 = elements 0..7, each 0 or 1)
# into bits 56..63, element j at bit 56 + j; every other partial product lands elsewhere and
# no two overlap, so there are no carries. The product wraps modulo 2**64.
_GATHER = 0x0102040810204080


def sign_payload_nbytes(numel: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Payload bytes of a sign packet: ``ceil(P/8) + 4 * ceil(P/B)`` (header not included;
    ``geomesh_p2p.config.method.encoded_nbytes``, the one codec-size formula)."""
    return encoded_nbytes("sign", numel, block_size, header=False)


@dataclass(frozen=True)
class SignPacket:
    """One sign-compressed vector (a peer's pseudo-gradient part, or a re-encoded aggregate).

    Attributes:
        numel: P, number of fp32 elements encoded (>= 0).
        block_size: B, elements per scale block (1 <= B < 2**32).
        tokens: n_i, tokens the sender trained on (>= 0); the aggregation weight.
        signs: uint8 CPU tensor [ceil(P/8)]; element 8k+j is bit j of byte k, 1 = negative.
        scales: float32 CPU tensor [ceil(P/B)]; mean |v| of each block, finite and >= 0.

    Construction validates shapes, dtypes, device, scales and padding bits (CodecError).
    Source: GeoMesh CSS (arXiv 2609.18388), scaled signSGD.
    """

    numel: int
    block_size: int
    tokens: int
    signs: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self):
        numel = check_block_packet(self, "signs", torch.uint8, 8)
        rem = numel % 8
        if rem and int(self.signs[-1]) >> rem:
            raise CodecError(f"padding bits of the last sign byte must be 0 (P % 8 = {rem})")

    @property
    def num_blocks(self) -> int:
        return ceil_div(self.numel, self.block_size)

    def nbytes(self) -> int:
        """Exact size of :meth:`to_bytes` in bytes: ``32 + ceil(P/8) + 4 * ceil(P/B)``."""
        return encoded_nbytes("sign", self.numel, self.block_size)

    def to_bytes(self) -> bytes:
        """Serialize: header (kind 1), fp32 LE scales, packed signs. See the module doc."""
        return block_packet_bytes(KIND_SIGN, self, self.signs, "u1")

    @classmethod
    def from_bytes(cls, data: bytes) -> "SignPacket":
        """Parse bytes from :meth:`to_bytes`. Raises CodecError for a truncated or over-long
        buffer, bad magic/version/kind, block_size 0, NaN/Inf/negative scales, or non-zero
        padding bits."""
        _, numel, block_size, tokens, view = unpack_header(data, KIND_SIGN)
        if block_size == 0:
            raise CodecError("sign packet with block_size 0")
        nb = ceil_div(numel, block_size)
        ns = ceil_div(numel, 8)
        check_length(view, HEADER_SIZE + 4 * nb + ns, "sign")
        scales = read_array(view, HEADER_SIZE, "<f4", nb)
        signs = read_array(view, HEADER_SIZE + 4 * nb, "u1", ns)
        return cls(numel, block_size, tokens, signs, scales)


# ----------------------------------------------------------------------------------------
# encode


def _plan(device: torch.device, numel: int, block_size: int) -> tuple[int, int, bool]:
    """(chunk elements, worker threads, serial) for a vector; chunk 0 means one unchunked segment.
    ``serial``: the chunks run on serial pool threads (``_run_serial``), else on ``_run_parallel``."""
    align = 8 * block_size // math.gcd(8, block_size)
    if align > _MAX_ALIGN or numel < 2 * align:
        return 0, 1, False
    if device.type != "cpu":
        return max(align, _CUDA_CHUNK // align * align), 1, False
    threads = torch.get_num_threads()
    big = max(align, _SERIAL_CHUNK // align * align)
    if threads == 1 and numel >= 2 * big:  # the caller's ops run inline already
        return big, 1, False
    if threads > 1 and numel >= max(_SERIAL_MIN, 2 * align) and _serial_threads_work():
        # At least 2 chunks per thread, so that the shared counter can even out their progress.
        chunk = max(align, min(_SERIAL_CHUNK, numel // (2 * threads)) // align * align)
        return chunk, min(threads, numel // chunk), True
    if align >= _GRAIN:
        return max(align, _CPU_BIG_CHUNK // align * align), 1, False
    chunk = (_GRAIN - 1) // align * align
    workers = max(1, min(threads, numel // chunk // _MIN_CHUNKS_PER_WORKER))
    return chunk, workers, False


class _Workspace:
    """Scratch buffers for one chunk of ``n`` elements. On CPU the storage is per thread and
    kept across calls (a chunk smaller than an earlier one uses the front of its buffers, so
    parts of varying sizes allocate, and page-fault, nothing new); on CUDA it lives for one
    call. Each buffer is allocated on first use, so a decode never pays for the encode's fp32
    temporaries."""

    _SPECS = {  # name: (dtype, elements per chunk element)
        "neg": (torch.bool, 1),
        "words": (torch.int64, 8),
        "f32": (torch.float32, 1),
        "idx": (torch.int32, 8),
    }

    def __init__(self, n: int, device: torch.device, store: dict[str, torch.Tensor] | None = None):
        self.n = n
        self.device = device
        self._store: dict[str, torch.Tensor] = {} if store is None else store

    def get(self, name: str) -> torch.Tensor:
        """The buffer ``name``: ``ceil(n / per)`` elements of its dtype (see ``_SPECS``), contiguous."""
        dtype, per = self._SPECS[name]
        need = ceil_div(self.n, per)
        buf = self._store.get(name)
        if buf is None or buf.numel() < need:
            buf = torch.empty(need, dtype=dtype, device=self.device)
            self._store[name] = buf
        return buf[:need]


_tls = threading.local()


def _workspace(n: int, device: torch.device) -> _Workspace:
    if device.type != "cpu":
        return _Workspace(n, device)
    store = getattr(_tls, "store", None)
    if store is None:
        store = _tls.store = {}
    return _Workspace(n, device, store)


_POOL: ThreadPoolExecutor | None = None
_POOL_PID = 0
_POOL_LOCK = threading.Lock()


def _pool(workers: int, serial: bool) -> ThreadPoolExecutor:
    """The shared pool (``serial``: the codec's pool of serial threads) with >= ``workers`` threads."""
    global _POOL, _POOL_PID, _SERIAL_POOL, _SERIAL_POOL_PID
    with _POOL_LOCK:
        pool, pid = (_SERIAL_POOL, _SERIAL_POOL_PID) if serial else (_POOL, _POOL_PID)
        # A new pool after a fork too: the child has none of the parent's threads.
        if pool is None or pool._max_workers < workers or pid != os.getpid():
            name = "geomesh-codec-serial" if serial else "geomesh-codec"
            pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
            if serial:
                _SERIAL_POOL, _SERIAL_POOL_PID = pool, os.getpid()
            else:
                _POOL, _POOL_PID = pool, os.getpid()
        return pool


def _run_parallel(fn, nchunks: int, workers: int) -> None:
    """Call ``fn(lo, hi)`` on contiguous ranges covering [0, nchunks), on ``workers`` threads."""
    if workers <= 1:
        fn(0, nchunks)
        return
    pool = _pool(workers, serial=False)
    bounds = [(nchunks * k // workers, nchunks * (k + 1) // workers) for k in range(workers)]
    futures = [pool.submit(fn, lo, hi) for lo, hi in bounds[1:]]
    fn(*bounds[0])  # the caller's thread takes the first range
    for f in futures:
        f.result()


# ----------------------------------------------------------------------------------------
# serial worker threads

_SERIAL_POOL: ThreadPoolExecutor | None = None
_SERIAL_POOL_PID = 0
_SERIAL_OK: bool | None = None
# torch.get_num_threads as imported (tests replace the module attribute to vary the worker count;
# the check below needs the real per-thread figure).
_torch_get_num_threads = torch.get_num_threads


@functools.cache
def _omp_set_num_threads():
    """``omp_set_num_threads`` of the OpenMP runtime torch is linked with, or None (no OpenMP
    backend, or its symbol not visible in the process). Looked up once."""
    if "OpenMP" not in torch.__config__.parallel_info().split("ATen parallel backend:")[-1]:
        return None
    try:
        fn = ctypes.CDLL(None).omp_set_num_threads
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], None
    return fn


def _make_thread_serial() -> bool:
    """Make torch CPU ops called from this thread run inline (``at::get_num_threads() == 1`` here).

    With torch's OpenMP backend ``at::get_num_threads()`` is the calling thread's OpenMP
    ``nthreads`` setting, which ``omp_set_num_threads`` changes for that thread alone (the
    process-wide figure, other threads and ``torch.get_num_threads()`` elsewhere are untouched;
    ``torch.set_num_threads`` would change the default every new thread starts with). Only
    called on the codec's own pool threads and a probe thread. Returns whether it worked."""
    done = getattr(_tls, "serial", None)
    if done is None:
        done = False
        fn = _omp_set_num_threads()
        if fn is not None:
            _torch_get_num_threads()  # torch's lazy per-thread init first, or it would undo ours
            fn(1)
            done = _torch_get_num_threads() == 1
        _tls.serial = done
    return done


def _serial_threads_work() -> bool:
    """Whether ``_make_thread_serial`` works in this process (probed once, on a throwaway thread)."""
    global _SERIAL_OK
    if _SERIAL_OK is None:
        box: list[bool] = []
        t = threading.Thread(target=lambda: box.append(_make_thread_serial()), name="geomesh-codec-probe")
        t.start()
        t.join()
        _SERIAL_OK = bool(box and box[0])
    return _SERIAL_OK


def _run_serial(setup, ntasks: int, workers: int) -> None:
    """Run tasks ``0 .. ntasks-1`` on ``workers`` serial pool threads; the caller waits.

    Each thread calls ``step = setup()`` once (its scratch buffers and views), then ``step(i)`` for
    the next index of a shared counter until none is left: a thread that is descheduled (shared
    cores) holds up one task, not a fixed share of them. Exceptions propagate to the caller."""
    counter = itertools.count()  # next() is atomic under the GIL

    def loop() -> None:
        _make_thread_serial()
        step = setup()
        i = next(counter)
        while i < ntasks:
            step(i)
            i = next(counter)

    futures = [_pool(workers, serial=True).submit(loop) for _ in range(workers)]
    for f in futures:
        f.result()


def _run_chunks(setup, nch: int, covered: int, total: int, workers: int, serial: bool) -> int:
    """Run a codec's chunk steps (``step = setup(); step(c)``) over its ``nch`` whole chunks: on serial pool
    threads (:func:`_run_serial`; the tail past ``covered`` elements is one more task, so ``total`` is
    returned) or, without them, in ``workers`` contiguous ranges (:func:`_run_parallel`; the caller does
    the tail, so ``covered`` is returned). Returns the elements done."""
    if serial:
        _run_serial(setup, nch + (covered < total), workers)
        return total

    def work(lo: int, hi: int) -> None:
        step = setup()
        for c in range(lo, hi):
            step(c)

    _run_parallel(work, nch, workers)
    return covered


def _encode_segment(vs: torch.Tensor, signs: torch.Tensor, sums: torch.Tensor, block_size: int) -> None:
    """Generic path: sign bits and per-block |v| sums of a segment of any length that starts
    on a byte and block boundary (``signs``/``sums``: the segment's slices of the outputs)."""
    n = vs.numel()
    n8 = n - n % 8
    if vs.device.type == "cpu":
        # numpy's SIMD compare and packbits (zero padding bits, the wire's bit order).
        signs.numpy()[:] = np.packbits(np.less(vs.numpy(), 0), bitorder="little")
    elif n8:
        # 8 bools (bytes 0/1) viewed as one int64, gathered into its top byte.
        words = torch.mul(torch.lt(vs[:n8], 0).view(torch.int64), _GATHER)
        signs[: n8 // 8].copy_(words.view(torch.uint8).view(-1, 8)[:, 7])
    if n8 < n and vs.device.type != "cpu":
        tail = torch.lt(vs[n8:], 0).to(torch.uint8)
        weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=vs.device)
        signs[n8 // 8 :].copy_((tail * weights[: n - n8]).sum(dtype=torch.uint8).reshape(1))
    nfull = n // block_size
    if nfull:
        # Same arithmetic as the chunked path (abs, then a row sum), so a block's scale
        # does not depend on which path computed it.
        absv = torch.abs(vs[: nfull * block_size])
        torch.sum(absv.view(nfull, block_size), 1, out=sums[:nfull])
    if nfull * block_size < n:
        sums[nfull:].copy_(vs[nfull * block_size :].abs().sum().reshape(1))


def _block_abs_sums(v: torch.Tensor, block_size: int, dtype=torch.float32) -> torch.Tensor:
    """Plain per-block sums of |v| in ``dtype``; used for the fp32-overflow fallback."""
    n = v.numel()
    nfull = n // block_size
    parts = []
    if nfull:
        parts.append(v[: nfull * block_size].to(dtype).abs().view(nfull, block_size).sum(dim=1))
    if nfull * block_size < n:
        parts.append(v[nfull * block_size :].to(dtype).abs().sum().reshape(1))
    return torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=v.device)


def _encode_chunked(
    v: torch.Tensor, signs: torch.Tensor, sums: torch.Tensor, block_size: int, chunk: int, workers: int, serial: bool
) -> int:
    """Fast path over the chunks of ``v``; returns how many elements it covered (with ``serial``
    all of them: the last, partial chunk is one more task for the worker threads)."""
    P = v.numel()
    nch = P // chunk
    covered = nch * chunk
    nbc = chunk // block_size
    v_chunks = v[:covered].view(nch, chunk).unbind(0)
    s_chunks = signs[: covered // 8].view(nch, chunk // 8).unbind(0)
    u_chunks = sums[: nch * nbc].view(nch, nbc).unbind(0)
    device = v.device
    cpu = device.type == "cpu"
    # CPU: numpy views of the same memory for the sign bits (numpy's compare and packbits are
    # SIMD loops and release the GIL; torch's bool compare is not vectorised).
    vn_chunks = v[:covered].numpy().reshape(nch, chunk) if cpu else None
    sn_chunks = signs[: covered // 8].numpy().reshape(nch, chunk // 8) if cpu else None

    def setup():
        ws = _workspace(chunk, device)
        neg = ws.get("neg")
        neg64 = neg.view(torch.int64)
        negn = neg.numpy() if cpu else None
        words = ws.get("words")
        top = words.view(torch.uint8).view(-1, 8)[:, 7]
        f32 = ws.get("f32")
        f32b = f32.view(nbc, block_size)
        tabs, tsum, lt, mul, less, packbits = torch.abs, torch.sum, torch.lt, torch.mul, np.less, np.packbits

        def step(c: int) -> None:
            if c == nch:  # the partial last chunk
                _encode_segment(v[covered:], signs[covered // 8 :], sums[covered // block_size :], block_size)
                return
            vc = v_chunks[c]
            # The first op reads the chunk from main memory; the ones after it read the cache.
            tabs(vc, out=f32)
            tsum(f32b, 1, out=u_chunks[c])  # per-block sum of |v|
            if vn_chunks is not None and sn_chunks is not None and negn is not None:  # CPU
                less(vn_chunks[c], 0, out=negn)  # -0.0 < 0 is False
                sn_chunks[c] = packbits(negn, bitorder="little")
            else:
                lt(vc, 0.0, out=neg)  # one kernel on a GPU (-0.0 < 0 is False)
                mul(neg64, _GATHER, out=words)  # 8 bytes -> the top byte of a word
                s_chunks[c].copy_(top)

        return step

    return _run_chunks(setup, nch, covered, P, workers, serial)


def encode(v: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE, tokens: int = 0) -> SignPacket:
    """Sign-compress a vector.

    Args:
        v: float tensor of any shape (flattened in row-major order; non-fp32 dtypes are
            converted to fp32 first), on CPU or CUDA. Work runs on ``v``'s device; only the
            packed signs and the scales are moved to the CPU.
        block_size: B, elements per scale (default 2048).
        tokens: n_i, the token count the sender trained on (>= 0).

    Returns:
        SignPacket with signs uint8 [ceil(P/8)] and scales fp32 [ceil(P/B)] on the CPU;
        serialized size ``32 + ceil(P/8) + 4*ceil(P/B)`` bytes.

    Raises:
        CodecError: if ``v`` holds NaN or Inf (no packet is produced), is not a floating
            tensor, or block_size/tokens are out of range.

    Work (CPU): chunks of up to 256K elements on the codec's serial worker threads; per chunk one
    read of ``v`` from main memory (``torch.abs``), then in cache the block sums (``torch.sum``
    of the rows: the scales' exact rounding), ``numpy.less`` and ``numpy.packbits``.

    Source: GeoMesh CSS (arXiv 2609.18388): per block, packed signs and the mean |v|.
    """
    block_size = check_block_size(block_size)
    tokens = check_tokens(tokens)
    v = as_flat_fp32(v).resolve_neg()  # a negated view has no numpy view (CPU sign bits)
    device = v.device
    P = v.numel()
    nb = ceil_div(P, block_size)
    signs = torch.empty(ceil_div(P, 8), dtype=torch.uint8, device=device)
    sums = torch.empty(nb, dtype=torch.float32, device=device)

    chunk, workers, serial = _plan(device, P, block_size)
    covered = _encode_chunked(v, signs, sums, block_size, chunk, workers, serial) if chunk else 0
    if covered < P:
        _encode_segment(v[covered:], signs[covered // 8 :], sums[covered // block_size :], block_size)

    # Mean |v|: full blocks divide by B, the last one by its real length (on CPU in numpy,
    # single threaded: cheaper than an OpenMP-parallel op for ceil(P/B) elements).
    last = P - (nb - 1) * block_size if nb else 0
    scales = sums.cpu()
    signs = signs.cpu()
    if nb:
        a = scales.numpy()
        np.divide(a[: nb - 1], np.float32(block_size), out=a[: nb - 1])
        np.divide(a[nb - 1 :], np.float32(last), out=a[nb - 1 :])
        if not np.isfinite(a).all():
            raise_non_finite(v)
            # All inputs finite but an fp32 block sum overflowed: redo the sums in fp64.
            counts = torch.full((nb,), float(block_size), dtype=torch.float64, device=device)
            counts[-1] = last
            scales = (_block_abs_sums(v, block_size, torch.float64) / counts).to(torch.float32).cpu()
    return SignPacket(P, block_size, tokens, signs, scales)


# ----------------------------------------------------------------------------------------
# decode

_LUT: dict[torch.device, torch.Tensor] = {}
_LUT_LOCK = threading.Lock()


def slice_packet(p: SignPacket, start: int, end: int) -> SignPacket:
    """The packet of elements ``[start, end)`` of ``p`` (what encoding ``v[start:end]`` alone gives).

    ``start`` must be a multiple of the block size and of 8, and ``end`` too unless it is ``p.numel``
    (parts of the collective are aligned to the block). Copies the bytes (O(end - start) / 8).

    Raises:
        CodecError: a misaligned or out-of-range slice.
    """
    B = p.block_size
    if not (0 <= start < end <= p.numel) or start % B or start % 8 or (end != p.numel and (end % B or end % 8)):
        raise CodecError(f"slice [{start}, {end}) of {p.numel} elements is not aligned to blocks of {B} and bytes")
    return SignPacket(
        end - start,
        B,
        p.tokens,
        p.signs[start // 8 : ceil_div(end, 8)].clone(),
        p.scales[start // B : ceil_div(end, B)].clone(),
    )


def _sign_lut(device: torch.device) -> torch.Tensor:
    """int64 [256]: entry b holds 8 int8 values (native byte order), byte j = -1 if bit j of b is
    set else +1. One 8-byte gather expands a packed byte into the 8 signs of its elements: a
    table of 2 KiB (L1 on a CPU, cached on a GPU), against a [256, 8] fp32 table of 32-byte rows."""
    lut = _LUT.get(device)
    if lut is None:
        bits = (np.arange(256, dtype=np.int64)[:, None] >> np.arange(8)) & 1
        pm = np.ascontiguousarray((1 - 2 * bits).astype(np.int8))  # [256, 8], +1 / -1
        lut = torch.from_numpy(pm.view(np.int64).reshape(256).copy()).to(device)
        with _LUT_LOCK:
            _LUT[device] = lut
    return lut


def _decode_range(
    signs: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor,
    lut: torch.Tensor,
    block_size: int,
    ws: _Workspace,
    accumulate: bool,
) -> None:
    """Decode ``out.numel()`` elements (a range starting on a byte and block boundary) into
    ``out`` (fp32, contiguous), or add them to it if ``accumulate``.

    ``signs``/``scales`` are the range's slices (uint8 [>= ceil(n/8)], fp32 [>= ceil(n/B)]);
    ``ws`` holds scratch for ``ws.n >= n`` elements. Passes: a gather of n/8 words from the
    256-entry table (+-1 as int8), an int8 -> fp32 conversion, one multiply by the block's scale
    (``scale * (+-1.0)``, exact) or, when accumulating, one fused ``out += (+-1.0) * scale``."""
    n = out.numel()
    nbytes = ceil_div(n, 8)
    nfull = n // block_size
    idx = ws.get("idx")[:nbytes]
    words = ws.get("words")[:nbytes]
    idx.copy_(signs[:nbytes])
    torch.index_select(lut, 0, idx, out=words)
    pm8 = words.view(torch.int8)[:n]  # +1 / -1 per element
    if accumulate:
        pm = ws.get("f32")[:n]
        pm.copy_(pm8)
        if nfull:
            out[: nfull * block_size].view(nfull, block_size).addcmul_(
                pm[: nfull * block_size].view(nfull, block_size), scales[:nfull, None]
            )
        if nfull * block_size < n:
            out[nfull * block_size :].add_(pm[nfull * block_size :] * scales[nfull])
        return
    if out.device.type != "cpu" and nfull * block_size == n:
        # A GPU kernel reads the int8 signs and converts them on the fly: one pass over out.
        torch.mul(pm8.view(nfull, block_size), scales[:nfull, None], out=out.view(nfull, block_size))
        return
    out.copy_(pm8)  # +1.0 / -1.0
    if nfull:
        out[: nfull * block_size].view(nfull, block_size).mul_(scales[:nfull, None])
    if nfull * block_size < n:
        out[nfull * block_size :].mul_(scales[nfull])


def _decode_chunked(
    signs: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor,
    lut: torch.Tensor,
    block_size: int,
    chunk: int,
    workers: int,
    serial: bool,
    accumulate: bool,
) -> int:
    """Fast path over the chunks; returns how many elements it covered (with ``serial`` all of
    them: the last, partial chunk is one more task for the worker threads)."""
    P = out.numel()
    nch = P // chunk
    covered = nch * chunk
    nbc = chunk // block_size
    s_chunks = signs[: covered // 8].view(nch, chunk // 8).unbind(0)
    ob_chunks = out[:covered].view(nch, nbc, block_size).unbind(0)
    u_chunks = scales[: nch * nbc].view(nch, nbc, 1).unbind(0)
    device = out.device
    cpu = device.type == "cpu"

    def setup():
        # The per-chunk step is a few op calls on prebuilt views: Python work per chunk is
        # what the worker threads serialise on (the GIL), so none is done there.
        ws = _workspace(chunk, device)
        idx = ws.get("idx")
        words = ws.get("words")
        pm8 = words.view(torch.int8)
        pm8b = pm8.view(nbc, block_size)
        f32b = ws.get("f32").view(nbc, block_size) if cpu or accumulate else None
        index_select, mul = torch.index_select, torch.mul

        def step(c: int) -> None:
            if c == nch:  # the partial last chunk
                _decode_range(
                    signs[covered // 8 :],
                    scales[covered // block_size :],
                    out[covered:],
                    lut,
                    block_size,
                    ws,
                    accumulate,
                )
                return
            idx.copy_(s_chunks[c])
            index_select(lut, 0, idx, out=words)  # 8 signs (+1 / -1 as int8) per packed byte
            if f32b is None:  # GPU: the int8 signs are read and converted in the kernel
                mul(pm8b, u_chunks[c], out=ob_chunks[c])
                return
            # CPU (a mixed int8 * fp32 op would convert through a temporary) and accumulate:
            # +-1.0 in cached scratch, times the block scale, then one write (or read-add-write)
            # of out in main memory. scale * (+-1.0) is exact, so out + that is bitwise what
            # adding a decoded vector gives.
            f32b.copy_(pm8b)
            if not accumulate:
                mul(f32b, u_chunks[c], out=ob_chunks[c])
            elif cpu:
                f32b.mul_(u_chunks[c])  # 2 vectorised passes in cache: faster than one addcmul_ on CPU
                ob_chunks[c].add_(f32b)
            else:
                ob_chunks[c].addcmul_(f32b, u_chunks[c])  # one kernel: out += (+-1.0) * scale

        return step

    return _run_chunks(setup, nch, covered, P, workers, serial)


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    return a.index is None or b.index is None or a.index == b.index


def decode(p: SignPacket, device=None, out: torch.Tensor | None = None, *, accumulate: bool = False) -> torch.Tensor:
    """Decode a sign packet to ``scale * (+1 | -1)`` per element.

    Args:
        p: the packet.
        device: where to build the result (default: ``out``'s device, else CPU).
        out: optional preallocated contiguous fp32 tensor with P elements to write into
            (avoids allocating P * 4 bytes).
        accumulate: add the decoded values to ``out`` (``out += decode(p)``, bit-identical to
            decoding into a second buffer and ``add_``) instead of overwriting it, without a
            full-size temporary; requires ``out``.

    Returns:
        fp32 tensor [P] (``out`` itself if given). Each element is one exact fp32 multiply
        ``scale * (+1.0 | -1.0)``, bit-identical on every device.

    Raises:
        CodecError: if ``out`` has the wrong dtype, size, device or is not contiguous, or
            ``accumulate`` is set without ``out``.

    Work: the vector is decoded in cache-sized chunks (CPU: up to 256K elements on the codec's serial
    worker threads, see ``_plan``; CUDA: 16M), so ``out`` is written (and, when accumulating,
    read) once in main memory; the signs are expanded by one 8-byte table gather per packed byte.
    """
    if not isinstance(p, SignPacket):
        raise CodecError(f"decode expects a SignPacket, got {type(p).__name__}")
    P = p.numel
    if accumulate and out is None:
        raise CodecError("accumulate=True needs out= (the buffer to add to)")
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype != torch.float32:
            raise CodecError("out must be a float32 tensor")
        if out.numel() != P or not out.is_contiguous():
            raise CodecError(f"out must be contiguous with {P} elements, got shape {list(out.shape)}")
        if device is not None and not _same_device(torch.device(device), out.device):
            raise CodecError(f"out is on {out.device} but device={device} was requested")
        device = out.device
        result = out
        flat = out.view(-1)
    else:
        device = torch.device("cpu") if device is None else torch.device(device)
        result = flat = torch.empty(P, dtype=torch.float32, device=device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if P == 0:
        return result
    B = p.block_size
    signs = p.signs.to(device)
    scales = p.scales.to(device)
    lut = _sign_lut(device)
    chunk, workers, serial = _plan(device, P, B)
    covered = _decode_chunked(signs, scales, flat, lut, B, chunk, workers, serial, accumulate) if chunk else 0
    if covered < P:
        rest = P - covered
        _decode_range(
            signs[covered // 8 :], scales[covered // B :], flat[covered:], lut, B, _Workspace(rest, device), accumulate
        )
    return result
