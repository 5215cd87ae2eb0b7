# Ferry on a GPU box: `docker compose up` (see docker-compose.yml and the README).
# The base image brings CUDA and a CUDA build of PyTorch; Ferry needs torch >= 2.11.
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime

# The dashboard's chart library (uPlot), installed by npm from the lock file in its own stage.
FROM node:20-slim AS charts
WORKDIR /charts
COPY service/dashboard/package.json service/dashboard/package-lock.json ./
RUN npm ci --no-audit --no-fund --loglevel=error

FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# Dependencies first, in their own layer: a code change does not reinstall them. The packages are empty
# placeholders here; the real sources arrive below and the editable install already points at them.
# The extras every shipped config needs (tests/test_deploy.py checks): diffusers for the DiT families,
# torchao for model.quantize, imageio for Wan's .mp4 data.
COPY pyproject.toml README.md ./
RUN mkdir -p offload jobs service \
 && touch offload/__init__.py jobs/__init__.py service/__init__.py \
 && pip install -e ".[diffusion,quantize,video]"

COPY offload/ offload/
COPY jobs/ jobs/
COPY service/ service/
COPY --from=charts /charts/node_modules service/dashboard/node_modules
COPY configs/ configs/

# A non-root user owns the data directory (database, checkpoints, logs), which is a volume.
RUN useradd --create-home --uid 1000 ferry \
 && mkdir -p /data /models /datasets \
 && chown ferry:ferry /data
USER ferry
VOLUME ["/data"]

# In a container the service listens on all interfaces; it refuses to start without FERRY_API_TOKEN then.
ENV FERRY_HOST=0.0.0.0 \
    FERRY_PORT=8000 \
    FERRY_DATA_DIR=/data \
    FERRY_MODEL_ROOTS=/models \
    FERRY_DATA_ROOTS=/datasets
EXPOSE 8000

HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
  CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"

ENTRYPOINT ["python", "-m", "service"]
