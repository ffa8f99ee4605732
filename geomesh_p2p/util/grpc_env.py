"""gRPC's C-core logging for the command-line programs: quiet unless asked for.

Imports only ``os`` and ``sys``: it must run before grpc is first imported, which is when the C core reads
``GRPC_VERBOSITY`` (setting it later has no effect; the console scripts import grpc while their modules load).
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

__all__ = ["quiet_grpc_core"]


def quiet_grpc_core(argv: Optional[Sequence[str]] = None) -> bool:
    """Set ``GRPC_VERBOSITY=NONE`` unless the command line asks for ``--log-level DEBUG`` or the user set
    ``GRPC_VERBOSITY`` or ``GRPC_TRACE`` themselves (their choice wins). Returns whether it set it.

    Why: gRPC's C core prints its own lines (``E1130 ... add_port.cc:83] Failed to add port``,
    ``I1130 ... ssl_transport_security.cc] Handshake failed``) next to the programs' one-line errors and
    status lines. Call it before grpc is imported (the ``peer`` and ``bootstrap`` packages do on import).
    ``argv``: the command line (default ``sys.argv[1:]``).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    debug = any(
        a == "--log-level=DEBUG" or (a == "--log-level" and i + 1 < len(args) and args[i + 1] == "DEBUG")
        for i, a in enumerate(args)
    )
    if debug or "GRPC_VERBOSITY" in os.environ or "GRPC_TRACE" in os.environ:
        return False
    os.environ["GRPC_VERBOSITY"] = "NONE"
    return True
