# syntax=docker/dockerfile:1
# One image, two entry points: `ingest run` (the default) and `pipeline run`.
# Build: docker build -t spanner-delta-cdc .   (no Docker engine on the development machines:
# this file is checked statically by tests/test_deploy_files.py, never built there)

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# Build stage: the virtualenv with the product, and the Delta jars resolved from Maven Central,
# so the running container downloads nothing.
FROM ${PYTHON_IMAGE} AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jre-headless \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY runtime runtime
COPY ingest ingest
COPY pipeline pipeline
COPY emulator emulator
COPY examples examples
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --upgrade pip \
 && /opt/venv/bin/pip install --no-cache-dir .
RUN /opt/venv/bin/python -m pipeline.session fetch /opt/jars --gcs --s3 \
 && rm -rf /opt/jars/ivy

# Runtime stage: slim Python, a headless JRE for Spark, the venv and the jars; no compilers,
# no build tools, a non-root user.
FROM ${PYTHON_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jre-headless tini \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 10001 --create-home --shell /usr/sbin/nologin cdc \
 && mkdir -p /data && chown cdc /data
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/jars /opt/jars
ENV PATH=/opt/venv/bin:$PATH \
    SPARK_DELTA_JARS=/opt/jars \
    PYTHONUNBUFFERED=1 \
    INGEST_TABLE_URI=/data/changelog \
    INGEST_HEALTH_PORT=8080 \
    PIPELINE_CHANGELOG_URI=/data/changelog \
    PIPELINE_MIRROR_ROOT=/data/mirrors \
    PIPELINE_CHECKPOINT_URI=/data/pipeline-checkpoint
USER 10001
WORKDIR /data
# 8080: the ingest service's health and /metrics; 8081: the pipeline's /metrics.
EXPOSE 8080 8081
# The ingest service's liveness endpoint; the pipeline container turns this check off.
HEALTHCHECK --interval=15s --timeout=3s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2)"]
ENTRYPOINT ["tini", "--", "python", "-m"]
CMD ["ingest", "run"]
