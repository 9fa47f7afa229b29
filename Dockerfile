# The EPP image (`epp serve`). Build from the repository root:
#   docker build -t epp:0.1.0 .
# then push it to your registry and point deploy/overlays/*/kustomization.yaml `images:` at it
# (for a kind cluster: docker build -t epp:dev . && kind load docker-image epp:dev).
# Not built by `make test`; tests/unit/test_deploy.py checks this file against the manifests.
FROM python:3.11-slim

# The compiled loops (docs/architecture.md) keep their machine code in NUMBA_CACHE_DIR, which must
# be writable: numba (0.68) fails the import on a read-only cache directory ("cannot cache function
# ...: no locator available"), so the pods mount an emptyDir on /tmp (deploy/base). The image compiles
# every loop at build time (`epp warm-up`, below) into its own directory, for a CPU every x86-64 node
# has (NUMBA_CPU_NAME; build with --build-arg NUMBA_CPU_NAME=generic for arm64), and `epp serve` copies
# it into the cache (EPP_NUMBA_CACHE_SEED) before it loads them: a new pod is ready in about a second
# instead of compiling for 30-40 s of one core (docs/deployment.md, "Startup").
ARG NUMBA_CPU_NAME=x86-64-v2
# The source commit the image is built from, for the `inference_extension_info` metric:
#   docker build --build-arg EPP_BUILD_COMMIT=$(git rev-parse HEAD) -t epp:0.1.0 .
ARG EPP_BUILD_COMMIT=unknown
ENV PYTHONDONTWRITEBYTECODE=1 \
    EPP_BUILD_COMMIT=${EPP_BUILD_COMMIT} \
    PYTHONUNBUFFERED=1 \
    NUMBA_CACHE_DIR=/tmp/numba-cache \
    NUMBA_CPU_NAME=${NUMBA_CPU_NAME} \
    EPP_NUMBA_CACHE_SEED=/opt/epp/numba-cache \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY epp ./epp
COPY simulator ./simulator
RUN pip install . && rm -rf /src
RUN NUMBA_CACHE_DIR=/opt/epp/numba-cache epp warm-up && chmod -R a+rX /opt/epp/numba-cache

# Non-root, matching the pod securityContext (runAsUser/runAsGroup 65532) in deploy/base.
RUN groupadd --gid 65532 epp && useradd --uid 65532 --gid 65532 --no-create-home --shell /usr/sbin/nologin epp
USER 65532:65532
WORKDIR /

# ext_proc gRPC, gRPC health, admin HTTP (/metrics, /healthz, /readyz, /debug/*).
EXPOSE 9002 9003 9090
ENTRYPOINT ["epp", "serve"]
