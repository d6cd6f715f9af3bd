# syntax=docker/dockerfile:1
# Two images from one Dockerfile (pick one with --target):
#   docker build --target engine   -t ddtree-engine:0.1.0 .    # CUDA base, torch, `ddtree serve`  (pip install .[engine])
#   docker build --target operator -t ddtree-operator:0.1.0 .  # slim Python, kopf, no torch      (pip install .[operator])
# The Helm chart's values engine.image / operator.image name these images.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# torch wheels from PyPI bring their own CUDA libraries; the base only has to match the driver.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04

# ---- the project source, without the rest of the build context --------------------------------
FROM ${PYTHON_IMAGE} AS source
WORKDIR /src
COPY pyproject.toml README.md ./
COPY .ci/constraints.txt ./constraints.txt
COPY engine ./engine
COPY operator ./operator

# ---- operator --------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS operator-build
COPY --from=source /src /src
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir -c /src/constraints.txt "/src[operator]"

FROM ${PYTHON_IMAGE} AS operator
COPY --from=operator-build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# Non-root; the chart also sets runAsNonRoot and a read-only root filesystem.
USER 65532:65532
ENTRYPOINT ["kopf"]
CMD ["run", "--standalone", "--all-namespaces", "-m", "ddtree_operator.handlers"]

# ---- engine ----------------------------------------------------------------------------------
FROM ${CUDA_IMAGE} AS engine-build
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
COPY --from=source /src /src
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir -c /src/constraints.txt "/src[engine]"

FROM ${CUDA_IMAGE} AS engine
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/* \
 # uid 1000 is what the operator's pods run as (runAsUser); the base image's `ubuntu` user has it.
 && (userdel --remove ubuntu 2>/dev/null || true) \
 && useradd --uid 1000 --user-group --create-home ddtree \
 && mkdir -p /var/cache/ddtree && chown ddtree:ddtree /var/cache/ddtree
COPY --from=engine-build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 \
    DDTREE_CACHE=/var/cache/ddtree HF_HOME=/var/cache/ddtree/huggingface
USER 1000:1000
EXPOSE 8000
ENTRYPOINT ["ddtree"]
CMD ["serve", "--help"]
