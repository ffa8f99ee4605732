"""GeoMesh-P2P: volunteer LLM training with adaptive workload balancing and sign-compressed sync.

Method: GeoMesh (arXiv 2609.18388). Architecture and protocol: DESIGN.md.
"""

__version__ = "0.1.0"
#: 2: plans on the wire as geomesh_p2p.plan.wire (compact, chunked past one DHT value); 1: plain JSON plans
PROTOCOL_VERSION = 2
