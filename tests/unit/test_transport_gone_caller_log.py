"""gRPC core's ERROR for a unary reply to a caller that had gone (32 processes on 2 cores, session 28: a Find
reply after the caller's deadline logged ``ExecuteBatchError raised in core by servicer method`` with a
traceback). It is demoted to a DEBUG line; every other gRPC core error still logs as it did."""

from __future__ import annotations

import logging

import pytest

from geomesh_p2p.net import transport

pytestmark = [
    pytest.mark.timeout(30),
    pytest.mark.skipif(not transport._WRITE_FAILED, reason="this grpcio has no ExecuteBatchError"),
]

CORE = logging.getLogger("grpc._cython.cygrpc")
MSG = "ExecuteBatchError raised in core by servicer method [/geomesh.wire.Dht/Find]"


def _log_exception(exc: BaseException, msg: str) -> None:
    try:
        raise exc
    except BaseException:
        CORE.exception(msg)


def test_a_reply_to_a_gone_caller_is_dropped_at_info_and_a_debug_line_at_debug(caplog):
    (gone,) = transport._WRITE_FAILED
    with caplog.at_level(logging.INFO):
        _log_exception(gone("Failed execute_batch"), MSG)
        assert caplog.records == []
        _log_exception(RuntimeError("boom"), "Unexpected error in servicer")
        assert [(r.levelname, r.getMessage(), r.exc_info[0]) for r in caplog.records] == [
            ("ERROR", "Unexpected error in servicer", RuntimeError)
        ]
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="geomesh_p2p.net.transport"):
        _log_exception(gone("Failed execute_batch"), MSG)
    assert [(r.levelname, r.getMessage(), r.exc_info) for r in caplog.records] == [
        ("DEBUG", f"{MSG} (the caller had gone: reply not sent)", None)
    ]
