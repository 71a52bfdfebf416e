# syntax=docker/dockerfile:1
# The image every folio node runs, on both deployment paths: `ray up cluster.yaml` (its docker: image) and the Helm
# chart's KubeRay RayService (helm/folio, image.repository/tag). It holds:
#   CUDA (devel: nvcc, so a node can rebuild folio, see cluster.yaml's FOLIO_PIP_SPEC) + Python
#   torch, the CUDA build, installed first and pinned (PIP_CONSTRAINT): no later pip step can replace it
#   Ray Serve (the cluster's Ray version must equal the one of the machine running `ray up` / KubeRay's rayVersion)
#   folio, built with --no-build-isolation so its native CUDA library compiles against that torch; its generated
#       gRPC modules (folio.proto.folio.v1.*_pb2*); the router and Serve deployments
#   the tiny demo model at /opt/folio/demo-model (a smoke test); real weights are mounted at /models
#
#   docker build -t ghcr.io/folio-project/folio:0.1.0 .          # no GPU needed to build, only to run
#   docker build --build-arg FOLIO_CUDA_ARCHS=9.0 ...            # Hopper only: a much shorter build
#
# Not built in folio's CI (its machines have no docker engine): tests/test_deploy.py checks the configs that name
# this image, not the image.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG RAY_VERSION=2.60.0
# Compute capabilities of the native CUDA library: Ampere, Ada, Hopper (PTX of the newest for later chips).
ARG FOLIO_CUDA_ARCHS="8.0;8.6;8.9;9.0"

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# Python 3.12 (Ubuntu 24.04's), a compiler for the native library, and what Ray's tooling calls on a node:
# wget (KubeRay's health probes), rsync / openssh-client (`ray up` file mounts), git (pip installs from git URLs).
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev build-essential git wget curl rsync openssh-client ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv $VIRTUAL_ENV \
    && echo 'export PATH=/opt/venv/bin:$PATH' > /etc/profile.d/folio-venv.sh
# (KubeRay and `ray up` run their commands in login shells: the venv stays first on PATH there too.)

# 1. torch first, the CUDA build, then pinned to exactly that build for every later pip call in this image and on
#    its nodes (PIP_CONSTRAINT is read by every pip; cluster.yaml's setup writes its own pin too).
RUN pip install --index-url ${TORCH_INDEX_URL} torch==${TORCH_VERSION} \
    && python -c 'import torch; assert torch.version.cuda, "not a CUDA build"; print("torch==" + torch.__version__)' \
        > /opt/torch-constraint.txt \
    && cat /opt/torch-constraint.txt
ENV PIP_CONSTRAINT=/opt/torch-constraint.txt

# 2. Build tools (setup.py's --no-build-isolation needs them present), Ray, boto3 (the AWS autoscaler on a head).
RUN pip install setuptools wheel "pybind11>=2.12" ninja "grpcio-tools>=1.60" "ray[serve]==${RAY_VERSION}" "boto3>=1.4.8"

# 3. folio. The build generates the gRPC modules (setup.py's build_py) and compiles folio._native_cpu and, nvcc
#    being here, folio._native_cuda against the torch above. A build that silently lost the CUDA module (no nvcc,
#    a CPU torch) fails the check below instead of shipping a CPU-only image. replicas/, router/ and protos/ install
#    as folio.serve, folio.router and folio.proto. The checks run from /: in /opt/folio/src the sources' folio/
#    directory (the engine alone) would shadow the installed package.
WORKDIR /opt/folio/src
COPY . .
RUN FOLIO_CUDA_ARCHS="${FOLIO_CUDA_ARCHS}" MAX_JOBS="$(nproc)" pip install --no-build-isolation ".[serve]" \
    && cd / \
    && python -c "import importlib.util as u; assert u.find_spec('folio._native_cuda'), 'folio._native_cuda was not built'" \
    && python -c "import folio, folio.serve.app, folio.router.ray_router, folio.serve.grpc_servicer, \
                  folio.proto.folio.v1.generation_pb2_grpc" \
    && python -c "import torch; print('torch', torch.__version__)" | grep -F "$(cut -d= -f3 /opt/torch-constraint.txt)"

# 4. The demo model (tiny, random weights, written by folio itself: nothing is downloaded). Real models: mount a
#    Hugging Face directory (config.json, safetensors, tokenizer.json) under /models.
RUN folio demo-model /opt/folio/demo-model && mkdir -p /models

# Ray's and Serve's ports: GCS 6379, dashboard 8265, client 10001, Serve HTTP 8000 (health), Serve gRPC 50051.
EXPOSE 6379 8265 10001 8000 50051
WORKDIR /opt/folio

# Docker's view of a node's health (`ray up` runs this image under docker; Kubernetes ignores HEALTHCHECK and runs
# the Helm chart's gRPC probes instead): the standard gRPC health service on this node's Serve gRPC proxy, SERVING
# while a generator replica of the application passes its health check (folio.serve.health). It asks without
# `application` metadata, which Serve routes to the only application deployed. A node without a Serve proxy (or
# the plain `bash` of CMD) reports unhealthy. FOLIO_GRPC_PORT: grpc_options.port, where that is not 50051.
ENV FOLIO_GRPC_PORT=50051
HEALTHCHECK --interval=30s --timeout=10s --start-period=600s --retries=3 \
    CMD python -c "import os, sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; r = g.HealthStub(grpc.insecure_channel('127.0.0.1:' + os.environ['FOLIO_GRPC_PORT'])).Check(h.HealthCheckRequest(service='folio.v1.Generation'), timeout=8); sys.exit(r.status != h.HealthCheckResponse.SERVING)"
# No ENTRYPOINT: `ray up` and KubeRay run their own `ray start` commands in the container.
CMD ["bash"]
