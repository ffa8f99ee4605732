"""Virtual-time simulator of GeoMesh and its baselines (``geomesh-sim``).

* :mod:`~geomesh_p2p.sim.hardware` — YAML hardware profiles (peers, links, reference workload).
* :mod:`~geomesh_p2p.sim.link_time` — bytes of an exchange and the virtual time it is charged.
* :mod:`~geomesh_p2p.sim.methods` — method names (ddp, diloco, awb, css, geomesh, async) and variants.
* :mod:`~geomesh_p2p.sim.engine` — the simulator: real training, planner, codec, collective
  arithmetic and outer optimizer; charged time.
* :mod:`~geomesh_p2p.sim.report` — tables, JSON, plots; :mod:`~geomesh_p2p.sim.cli` — the command.

Heavy modules (torch, transformers) are imported only by the engine.
"""

from geomesh_p2p.sim.link_time import ExchangeBytes, Link, RoundTiming, charge_round, encoded_nbytes, exchange_bytes
from geomesh_p2p.sim.hardware import Profile, ProfileError, load_profile, parse_profile, shipped_profiles
from geomesh_p2p.sim.methods import BASE_METHODS, MethodError, MethodSpec, parse_method, parse_methods

__all__ = [
    "ExchangeBytes",
    "Link",
    "RoundTiming",
    "charge_round",
    "encoded_nbytes",
    "exchange_bytes",
    "Profile",
    "ProfileError",
    "load_profile",
    "parse_profile",
    "shipped_profiles",
    "BASE_METHODS",
    "MethodError",
    "MethodSpec",
    "parse_method",
    "parse_methods",
]
