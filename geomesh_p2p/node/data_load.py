"""The training data of a peer, loaded at start before its proof of work and DHT join (fresh user 47: a ``--data`` file
too short for ``--seq-len`` or not UTF-8 failed only after torch, the proof of work and the join, 10-15 s in, and
exited 1, not the 2 of a bad file). A local file is tokenized once into the on-disk token file that the rounds read
(:mod:`geomesh_p2p.data.tokens`), so loading it first costs nothing more than loading it later."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from geomesh_p2p.data import DataError, is_hf_spec, load_dataset
from geomesh_p2p.data.format import DataTooShortError
from geomesh_p2p.util.errors import StartInputError

if TYPE_CHECKING:
    from geomesh_p2p.node.peer import PeerNode

log = logging.getLogger("geomesh_p2p.node.peer")


def load_training_data(node: PeerNode) -> None:
    """Set ``node.dataset`` (a :class:`~geomesh_p2p.data.TokenDataset`) from ``--data`` unless it is set already:
    ``PeerNode.start`` calls it before the proof of work, ``training.build_training`` again (a no-op then). Worker
    thread (tokenizing takes seconds on a new file). One INFO line before (the load may take a while) and one after.

    Raises:
        StartInputError: a local ``--data`` file that cannot be used (not UTF-8, unsupported contents, empty), or
            any data too short for ``--seq-len`` (``DataTooShortError``): ``geomesh-peer join`` exits 2, as for a bad
            flag or file. A ``hf:`` dataset's other errors (the hub unreachable, a name it does not know) stay
            :class:`~geomesh_p2p.data.DataError` (exit 1: the hub's answer may change).
    """
    if getattr(node, "dataset", None) is not None:
        return
    c, r = node.cfg, node.run_cfg
    log.info(
        "loading the training data (%s) and its tokenizer (cached after the first run)...",
        c.data_path or "the shipped corpus",
    )
    t0 = time.monotonic()
    try:
        node.dataset = load_dataset(c.data_path, seq_len=r.seq_len, vocab_size=r.vocab_size)
    except DataError as e:
        if isinstance(e, DataTooShortError) or not is_hf_spec(c.data_path or ""):
            said = str(e)  # most name the file first ("tiny.txt: too few tokens ..."): say which flag gave it
            raise StartInputError(f"--data {said}" if c.data_path and said.startswith(c.data_path) else said) from None
        raise
    log.info("data loaded in %.1fs", time.monotonic() - t0)
