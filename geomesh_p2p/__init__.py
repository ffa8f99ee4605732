"""GeoMesh-P2P: volunteer LLM training with adaptive workload balancing and sign-compressed sync.

Method: GeoMesh (arXiv 2609.18388). Architecture and protocol: DESIGN.md.
"""

__version__ = "0.19.2"
#: 2: plans (plan.wire) and verified-work evidence (trust.evidence, wire v2) compact and chunked past one DHT
#: value (dht.chunked); 1: plain JSON plans, evidence as one signed value
PROTOCOL_VERSION = 2
