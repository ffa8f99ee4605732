"""``python -m tests.redteam_join join ...``: ``peer.cli join`` with the verified-work draw share raised
(``GEOMESH_REDTEAM_SHARE``, default 0.5, and the worker's duty, ``GEOMESH_REDTEAM_DUTY``, default 0.5; red-team soak only: more honest checks per round, same thresholds).
Every peer of a swarm must run it with the same value (the draws are re-derived by the others)."""

from __future__ import annotations

import dataclasses
import os
import runpy
import sys

from geomesh_p2p.trust import verify_task as VT

_names = [f.name for f in dataclasses.fields(VT.VerifyConfig)]
_defaults = list(VT.VerifyConfig.__init__.__defaults__ or ())
_defaults[_names.index("share")] = float(os.environ.get("GEOMESH_REDTEAM_SHARE", "0.5"))
# the background worker's duty too, so that the drawn checks conclude within a short swarm's rounds
_defaults[_names.index("duty")] = float(os.environ.get("GEOMESH_REDTEAM_DUTY", "0.5"))
# one miscalibrated peer (``GEOMESH_REDTEAM_FORCE`` = the name of its key file, ``h0``): every loss-gain test it
# runs fails hard, as a lone honest false positive would (what does the swarm do with it?)
_force = os.environ.get("GEOMESH_REDTEAM_FORCE")
if _force and any(a.endswith(f"/{_force}.key") for a in sys.argv):
    for _k, _v in (("gain_t_hard", 1e9), ("gain_t_min", 1e9), ("gain_t_gap", -1e9)):
        _defaults[_names.index(_k)] = _v
VT.VerifyConfig.__init__.__defaults__ = tuple(_defaults)

if __name__ == "__main__":
    sys.argv[0] = "peer.cli"
    runpy.run_module("peer.cli", run_name="__main__", alter_sys=True)
