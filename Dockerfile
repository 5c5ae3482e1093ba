# headroom's two images, one target each (`--target`):
#   headroom         the operator, the sidecar, `headroom plan` and `headroom crd`: the base
#                    dependencies only, no torch. Every vLLM and SGLang pod's sidecar runs it.
#   headroom-engine  the engine (`headroom serve`): the engine and cuda extras, torch and CuPy.
# `make image` (scripts/image.sh) builds both with no registry and no network: BASE is a Debian
# bookworm root filesystem made by mmdebstrap, and the context it prepares holds what uv.lock
# names, downloaded on the host and checked against the lock's hashes:
#   requirements/<target>.txt   `uv export` of the lock, every line with its hashes
#   wheels/*.whl                the wheels those lines name
#   dist/headroom-*.whl         this checkout, built by `uv build`
# With a registry, build FROM the slim Python image instead, from the same context:
#   scripts/image.sh context headroom ctx && podman build --target headroom -f Dockerfile ctx
ARG BASE=docker.io/library/python:3.11.7-slim-bookworm

FROM ${BASE} AS runtime
# A fixed non-root uid, so a pod's securityContext (runAsNonRoot, runAsUser) can name it.
RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin headroom \
    && python3 -m venv --without-pip /opt/headroom
ENV PATH=/opt/headroom/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HEADROOM_CACHE=/home/headroom/.cache/headroom \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /home/headroom
# Python is PID 1 here, and PID 1 ignores a signal it has no handler for. It handles SIGINT from
# its first instruction (aiohttp and kopf shut down cleanly on it), SIGTERM only once the app
# sets a handler: a stop during start-up (seconds of torch imports) would wait for the kill.
STOPSIGNAL SIGINT
ENTRYPOINT ["headroom"]

# The dependencies go straight into the final stage, one layer, so a build never copies the
# GBs of torch from stage to stage. The wheels are bind-mounted, not copied (no layer holds
# them; the hashes in the copied requirements pin them and key the layer cache); --no-index:
# nothing is fetched during the build.
FROM runtime AS headroom
COPY requirements/headroom.txt /opt/headroom/requirements.txt
RUN --mount=type=bind,source=wheels,target=/wheels \
    python3 -m venv /tmp/pip \
    && /tmp/pip/bin/pip --python /opt/headroom/bin/python install --no-cache-dir --no-index \
       --disable-pip-version-check --no-deps --require-hashes --find-links /wheels \
       -r /opt/headroom/requirements.txt \
    && rm -rf /tmp/pip
# The project last: a source change rebuilds this layer only.
COPY dist/ /tmp/dist/
RUN python3 -m venv /tmp/pip \
    && /tmp/pip/bin/pip --python /opt/headroom/bin/python install --no-cache-dir --no-index \
       --disable-pip-version-check --no-deps /tmp/dist/headroom-*.whl \
    && rm -rf /tmp/dist /tmp/pip
USER 10001:10001
EXPOSE 9090
CMD ["--help"]

# Last, so a build without --target gives the engine. Pods probe /health themselves (the OCI
# image format has no HEALTHCHECK).
FROM runtime AS headroom-engine
COPY requirements/headroom-engine.txt /opt/headroom/requirements.txt
RUN --mount=type=bind,source=wheels,target=/wheels \
    python3 -m venv /tmp/pip \
    && /tmp/pip/bin/pip --python /opt/headroom/bin/python install --no-cache-dir --no-index \
       --disable-pip-version-check --no-deps --require-hashes --find-links /wheels \
       -r /opt/headroom/requirements.txt \
    && rm -rf /tmp/pip
COPY dist/ /tmp/dist/
RUN python3 -m venv /tmp/pip \
    && /tmp/pip/bin/pip --python /opt/headroom/bin/python install --no-cache-dir --no-index \
       --disable-pip-version-check --no-deps /tmp/dist/headroom-*.whl \
    && rm -rf /tmp/dist /tmp/pip
USER 10001:10001
EXPOSE 8000
# The built-in tiny model needs no files: the image answers /health as it is.
CMD ["serve", "--model", "tiny", "--host", "0.0.0.0", "--port", "8000"]
