# syntax=docker/dockerfile:1
# GeoMesh-P2P volunteer node (a peer, or a bootstrap with --entrypoint geomesh-bootstrap). How to build
# and run it, reachable or behind NAT, CPU or CUDA: docs/docker.md. In short:
#   docker build -t geomesh-p2p .                       # CPU image (torch from PyTorch's CPU index)
#   docker run --rm -it -p 31337:31337 -v geomesh-id:/home/geomesh/.geomesh geomesh-p2p \
#       join --bootstrap bootstrap.example.org:31337 --host 0.0.0.0 --port 31337 --advertise-host 203.0.113.7
# CUDA image: --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128, run with --gpus all.
# tests/test_dockerfile.py checks this file's invariants (no engine runs in CI).

ARG PYTHON_IMAGE=python:3.11-slim

# ---------------------------------------------------------------- build: a venv with torch + the project
FROM ${PYTHON_IMAGE} AS build
# PyTorch's CPU index: plain torch from PyPI is the CUDA build (several GB of nvidia-* wheels).
# For a CUDA image pass the index of your CUDA version, e.g. https://download.pytorch.org/whl/cu128.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH=torch==2.13.0
# optional extras, comma-separated: hf (--data hf:...), lion (--inner-optimizer lion), sim (geomesh-sim --plot)
ARG EXTRAS=
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from TORCH_INDEX only, so that installing the project finds it satisfied and pulls no other build
RUN pip install --index-url "$TORCH_INDEX" "$TORCH"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY geomesh_p2p ./geomesh_p2p
COPY peer ./peer
COPY bootstrap ./bootstrap
# a regular (non-editable) install: the runtime stage gets the venv and not the source
RUN pip install "/src${EXTRAS:+[$EXTRAS]}" && geomesh-peer --version

# ---------------------------------------------------------------- runtime: the venv, a non-root user
FROM ${PYTHON_IMAGE} AS runtime
# Caches (tokenizers, token ids; Hugging Face and torch downloads) go to the identity volume, so the
# container also runs with a read-only root file system (docker run --read-only --tmpfs /tmp, docs/docker.md).
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 \
    MALLOC_ARENA_MAX=2 XDG_CACHE_HOME=/home/geomesh/.geomesh/cache
COPY --from=build /opt/venv /opt/venv
# The volumes' mount points exist and belong to the user, so fresh named volumes are writable by it.
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin geomesh \
    && mkdir -p /home/geomesh/.geomesh /data /checkpoints \
    && chown geomesh:geomesh /home/geomesh/.geomesh /data /checkpoints
USER geomesh
WORKDIR /home/geomesh
# identity keys (~/.geomesh: identity.key, bootstrap.key, their proof-of-work caches, the caches above),
# training text, checkpoints: the only places the node writes (with /tmp for `export` of a model config)
VOLUME ["/home/geomesh/.geomesh", "/data", "/checkpoints"]
# 31337: gRPC (a peer's --port, a bootstrap's default); 9100: Prometheus (--metrics-port 9100)
EXPOSE 31337 9100
ENTRYPOINT ["geomesh-peer"]
CMD ["--help"]
