"""Ctrl+C during the start-up profile (issue 14 #10): the peer stops at the next profile step, runs no
further batch size and no initial evaluation, and exits 0 (before: it waited for the whole profile and
the evaluation, 11-17 s at real size). A process test: steps are slowed with --speed-factor, and what
ran after the signal is counted from the log (no wall-clock assertion)."""

from __future__ import annotations

import re
import socket

import pytest
import torch

from tests.swarm_util import dead_address

pytestmark = pytest.mark.timeout(240)


def test_ctrl_c_during_the_profile_stops_at_the_next_step(swarm):
    # ~1 s per profile step (a 32-token step takes ~10 ms here), 4 sizes to measure: the full profile
    # and evaluation would take several seconds after the signal.
    swarm.peer("p0", "--speed-factor", "0.01", "--profile-batches", "1,2,4,8")  # port 0: no race for a port
    swarm.wait_for(lambda: "max batch" in swarm.text("p0"), 180, "the profile's batch-1 line")
    swarm.interrupt("p0")
    assert swarm.wait_exit(["p0"], 120) == {"p0": 0}
    text = swarm.text("p0")
    after = text[text.index("stop requested") :]
    m = re.search(r"\(profile stopped after (\d+) step\(s\): stop requested\)", after)
    assert m, text[-3000:]
    # The batch-1 step logged before the signal, and at most two more started before the signal reached
    # the node (the polling above); the full profile runs 1 + 4 sizes x 2 steps.
    assert 1 <= int(m.group(1)) <= 3, m.group(0)
    assert "tokens/s (" not in after, after  # no batch size measured after the signal
    assert "(initial)" not in text  # no initial evaluation
    assert "Traceback" not in text and "ERROR" not in text, text[-3000:]


def _one_line_failure(swarm, name: str) -> str:
    """The peer's exit status is not 0 and its output ends in one line that is not a traceback."""
    rc = swarm.wait_exit([name], 120)[name]
    text = swarm.text(name)
    assert rc not in (0, None) and "Traceback" not in text, (rc, text[-3000:])
    return text


def _after_start(text: str) -> list[str]:
    """The log's lines after join's line that says it is starting (before torch's import: session 15). Before it
    only the pre-flight ping's one WARNING when the --bootstrap does not answer (session 35: the ping runs before
    torch's import, so before that line)."""
    lines = text.strip().splitlines()
    i = next((k for k, line in enumerate(lines) if "geomesh-peer join: starting (" in line), None)
    assert i is not None and i <= 1, text[-3000:]
    assert all("--bootstrap " in line and "no answer" in line for line in lines[:i]), text[-3000:]
    return lines[i + 1 :]


def test_a_busy_metrics_port_is_one_line_before_the_dht_join(swarm):
    with socket.socket() as busy:  # held for the whole run: the port is in use
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        # Nothing listens at the bootstrap: had the join come first, it would fail after its retries.
        with dead_address() as dead:
            swarm.peer("m0", "--metrics-port", str(port), bootstrap=dead)
            text = _one_line_failure(swarm, "m0")
    # refused with the flags, before torch's import (session 33): not even join's "starting" line before it
    lines = text.strip().splitlines()
    assert lines == [
        f"geomesh-peer join: --metrics-port {port}: cannot listen on 127.0.0.1:{port}: the port is in use "
        "(another --metrics-port, or --metrics-port 0 for a free one)"
    ], text[-3000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_one_line_before_the_dht_join(swarm):
    # A bootstrap that accepts TCP and never answers: had the join come first, it would fail after its retries (one
    # where nothing listens fails before torch's import now: session 44)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        swarm.peer("c0", "--device", "cuda", bootstrap=f"127.0.0.1:{silent.getsockname()[1]}")
        text = _one_line_failure(swarm, "c0")
    assert swarm.procs["c0"].returncode == 2  # a flag this machine cannot serve: as for a bad flag
    lines = _after_start(text)
    assert len(lines) == 1 and lines[0].startswith(
        "geomesh-peer join: --device cuda: CUDA is not available on this machine"
    ), text[-3000:]
