# The EPP image (`epp serve`). Build from the repository root:
#   docker build -t epp:0.1.0 .
# then push it to your registry and point deploy/overlays/*/kustomization.yaml `images:` at it
# (for a kind cluster: docker build -t epp:dev . && kind load docker-image epp:dev).
# Not built by `make test`; tests/unit/test_deploy.py checks this file against the manifests.
FROM python:3.11-slim

# NUMBA_CACHE_DIR: the compiled loops (docs/architecture.md) cache their machine code there. It
# must be writable: numba (0.68) does not load a read-only cache directory, it fails the import
# ("cannot cache function ...: no locator available"), so no cache is baked into the image. The
# pods mount an emptyDir on /tmp (deploy/base): a new pod compiles once (~30-40 s of one core)
# before it reports live, a restarted container loads the cache from its pod's emptyDir.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    NUMBA_CACHE_DIR=/tmp/numba-cache \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY epp ./epp
COPY simulator ./simulator
RUN pip install . && rm -rf /src

# Non-root, matching the pod securityContext (runAsUser/runAsGroup 65532) in deploy/base.
RUN groupadd --gid 65532 epp && useradd --uid 65532 --gid 65532 --no-create-home --shell /usr/sbin/nologin epp
USER 65532:65532
WORKDIR /

# ext_proc gRPC, gRPC health, admin HTTP (/metrics, /healthz, /readyz, /debug/*).
EXPOSE 9002 9003 9090
ENTRYPOINT ["epp", "serve"]
