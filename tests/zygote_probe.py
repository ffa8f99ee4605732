"""``python -m tests.zygote_probe [exit CODE | wait]``: what a process started as ``python -m`` sees, as one JSON
line (tests/e2e/test_zygote.py compares a forked child's line with a cold interpreter's); then exits with CODE, or
waits for a signal (a Ctrl+C ends it as an uncaught KeyboardInterrupt does)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys

if __name__ == "__main__":
    seen = {
        "name": __name__,
        "argv": sys.argv[1:],
        "argv0": os.path.basename(sys.argv[0]),
        "path0": sys.path[0],
        "cwd": os.getcwd(),
        "unbuffered": os.environ.get("PYTHONUNBUFFERED"),
        "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "stdin": sys.stdin.read(),
        "netns": os.readlink("/proc/self/ns/net"),  # the network namespace it runs in
        "project_imported": sorted(m for m in sys.modules if m.split(".")[0] in ("geomesh_p2p", "peer", "bootstrap")),
    }
    # the files the project's code runs from (a preloaded module's, or the one a cold import would load)
    seen["project_files"] = {m: importlib.util.find_spec(m).origin for m in ("geomesh_p2p", "geomesh_p2p.config.flags")}
    print(json.dumps(seen), flush=True)
    if sys.argv[1:2] == ["exit"]:
        sys.exit(int(sys.argv[2]))
    print("waiting", file=sys.stderr, flush=True)
    signal.pause()
