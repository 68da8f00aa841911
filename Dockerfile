# syntax=docker/dockerfile:1
# One image, every command: `ingest run` (the default), `ingest spark-run`, `pipeline run`.
#   docker build -t spanner-delta-cdc .
#   buildah bud --isolation chroot -t spanner-delta-cdc .       (sandboxed builders too)
# `make image` builds it from a Debian base made with debootstrap (no registry needed) and
# tests/test_image.py runs it; README "The image" has its size and timings.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# Build stage: the virtualenv, and the Delta jars (and the object stores' connectors) resolved
# from Maven Central, so the running container downloads nothing.
FROM ${PYTHON_IMAGE} AS build
# gs:// needs the GCS connector (37 MB), s3:// S3A with the AWS SDK's S3 modules (10 MB): leave
# a store out with --build-arg CONNECTORS=gcs, or CONNECTORS= for local paths only.
ARG CONNECTORS="gcs s3"
# Spark's jars without what the product never loads (deploy/lean_spark_jars.py), or all of them
# with --build-arg SPARK_JARS=full.
ARG SPARK_JARS=lean
# Spark's driver classes archived for class data sharing (200 MB; starts 2.3 s sooner, with 15 %
# less CPU: docs/pipeline.md), or not, with --build-arg CLASS_ARCHIVE=off (the image 1.46 GB).
ARG CLASS_ARCHIVE=on
RUN apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jre-headless \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# Dependencies first: a layer that changes only with pyproject.toml (the README, which the
# package's metadata takes, comes with the code: an edit of it rebuilt every layer, 6 minutes).
COPY pyproject.toml ./
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --upgrade pip \
 && /opt/venv/bin/python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/requirements.txt \
 && /opt/venv/bin/pip install --no-cache-dir -r /tmp/requirements.txt
COPY deploy/lean_spark_jars.py /tmp/
RUN if [ "$SPARK_JARS" = lean ]; then \
      /opt/venv/bin/python /tmp/lean_spark_jars.py /opt/venv/lib/python3*/site-packages/pyspark/jars; \
    fi
# The jars and the class archive of Spark's driver (made from this venv's Spark, so the running
# container maps it): a layer that changes only with the code that names them.
COPY runtime runtime
COPY pipeline/__init__.py pipeline/session.py pipeline/class_archive.py pipeline/
# hadolint ignore=SC2086
RUN flags="$(for c in $CONNECTORS; do echo --$c; done)" \
 && if [ "$CLASS_ARCHIVE" != on ]; then flags="$flags --no-class-archive"; fi \
 && /opt/venv/bin/python -m pipeline.session fetch /opt/jars $flags
COPY ingest ingest
COPY pipeline pipeline
COPY emulator emulator
COPY examples examples
COPY README.md ./
RUN /opt/venv/bin/pip install --no-cache-dir --no-deps . \
 && /opt/venv/bin/pip uninstall --yes pip

# Runtime stage: the Python base, a headless JRE for Spark, tini, the venv and the jars; no
# compilers, no build tools, a non-root user.
FROM ${PYTHON_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jre-headless tini \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb \
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
# The ingest service's liveness endpoint on its health port; the pipeline container turns this
# check off.
HEALTHCHECK --interval=15s --timeout=3s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(f\"http://127.0.0.1:{os.environ.get('INGEST_HEALTH_PORT', '8080')}/healthz\", timeout=2)"]
ENTRYPOINT ["tini", "--", "python", "-m"]
CMD ["ingest", "run"]
