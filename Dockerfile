# The headroom image: the engine (`headroom serve`; the CPU path, and the CUDA kernels where the
# node has a GPU), the sidecar and the operator, as the chart and the operator's children run it.
# Installed from uv.lock exactly, as every checkout is. Build with any OCI builder:
#   buildah bud --layers -t ghcr.io/headroom-dev/headroom:0.1.0 .   (or docker/podman build)
# The tag is the project's version (pyproject.toml), the chart's appVersion and the CRD's default.

ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV UV_PYTHON_DOWNLOADS=never \
    UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    UV_PROJECT_ENVIRONMENT=/opt/headroom \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# uv itself, pinned by hash, as scripts/uv.sh installs it.
COPY scripts/uv-requirements.txt scripts/
RUN pip install --no-cache-dir --require-hashes -r scripts/uv-requirements.txt
# Dependencies first (they change rarely; this layer is the big one, torch), then the project.
COPY pyproject.toml uv.lock setup.py README.md ./
RUN uv sync --locked --no-install-project --no-dev --extra engine --extra cuda
COPY contract contract
COPY engine engine
COPY sidecar sidecar
COPY operator operator
RUN uv sync --locked --no-editable --no-dev --extra engine --extra cuda

FROM ${PYTHON_IMAGE}
# A fixed non-root uid, so a pod's securityContext (runAsNonRoot, runAsUser) can name it.
RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin headroom
COPY --from=build /opt/headroom /opt/headroom
ENV PATH=/opt/headroom/bin:$PATH \
    HEADROOM_CACHE=/home/headroom/.cache/headroom \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /home/headroom
EXPOSE 8000 9090
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"]
ENTRYPOINT ["headroom"]
# The built-in tiny model needs no files: the image answers /health as it is.
CMD ["serve", "--model", "tiny", "--host", "0.0.0.0", "--port", "8000"]
