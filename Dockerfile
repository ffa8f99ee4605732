# GeoMesh-P2P volunteer node.
#   docker build -t geomesh .
# CPU:   docker run --rm -it geomesh join --bootstrap HOST:PORT
# GPU:   docker run --rm -it --gpus all -p 31337:31337 geomesh join --bootstrap HOST:PORT --device cuda:0 \
#            --host 0.0.0.0 --advertise-host YOUR_PUBLIC_IP --port 31337
# Keep the identity across restarts: -v geomesh-home:/root/.geomesh
# For a CUDA build of torch pass --build-arg TORCH=torch (the default pins the CPU-friendly 2.13.0 wheel).
FROM python:3.11-slim

ARG TORCH=torch==2.13.0
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
WORKDIR /opt/geomesh

RUN apt-get update && apt-get install -y --no-install-recommends make && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md Makefile ./
COPY geomesh_p2p ./geomesh_p2p
COPY peer ./peer
COPY bootstrap ./bootstrap
# Same steps as `make setup`: torch first, then the project.
RUN make setup TORCH="$TORCH" VENV=/opt/venv
ENV PATH=/opt/venv/bin:$PATH

EXPOSE 31337
ENTRYPOINT ["geomesh-peer"]
CMD ["--help"]
