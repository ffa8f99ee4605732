"""The ``geomesh-peer`` application: a thin CLI over :mod:`geomesh_p2p` (no protocol logic here).

Importing this package quiets gRPC's C core (:func:`quiet_grpc_core`): the console scripts import grpc
while their modules load, and the C core reads ``GRPC_VERBOSITY`` only once, when grpc is first imported.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence


def quiet_grpc_core(argv: Optional[Sequence[str]] = None) -> bool:
    """Set ``GRPC_VERBOSITY=NONE`` unless the command line asks for ``--log-level DEBUG`` or the user set
    ``GRPC_VERBOSITY`` or ``GRPC_TRACE`` themselves (their choice wins). Returns whether it set it.

    Why here: gRPC's C core prints its own lines (``E1130 ... add_port.cc:83] Failed to add port``,
    ``I1130 ... ssl_transport_security.cc] Handshake failed``) next to this project's one-line errors, and
    it reads the variable when grpc is first imported, which the entry points do before ``main`` runs; so
    this runs when the package is imported. ``argv``: the command line (default ``sys.argv[1:]``).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    debug = any(a == "--log-level=DEBUG" or (a == "--log-level" and i + 1 < len(args) and args[i + 1] == "DEBUG")
                for i, a in enumerate(args))
    if debug or "GRPC_VERBOSITY" in os.environ or "GRPC_TRACE" in os.environ:
        return False
    os.environ["GRPC_VERBOSITY"] = "NONE"
    return True


quiet_grpc_core()
