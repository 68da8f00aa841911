# The pipeline's image for a Spark cluster (Spark operator or spark-submit --master k8s://):
# Spark's own image, which carries the entrypoint its driver and executor pods need, with the
# product's Python packages, the Delta jars and the GCS connector added at build time.
# Build from the repository root: docker build -f deploy/spark.Dockerfile -t spanner-delta-cdc-spark .
# Not built here (no Docker engine); check that SPARK_IMAGE exists for the Spark version in
# pyproject.toml before building.
ARG SPARK_IMAGE=apache/spark:4.2.0-scala2.13-java17-python3-ubuntu
FROM ${SPARK_IMAGE}
USER 0
WORKDIR /opt/spanner-cdc
COPY pyproject.toml README.md ./
COPY runtime runtime
COPY ingest ingest
COPY pipeline pipeline
COPY emulator emulator
COPY examples examples
RUN python3 -m pip install --no-cache-dir . \
 && python3 -m pipeline.session fetch /opt/spanner-cdc/jars --gcs \
 && rm -rf /opt/spanner-cdc/jars/ivy \
 && cp pipeline/__main__.py /opt/spanner-cdc/pipeline_main.py
ENV SPARK_DELTA_JARS=/opt/spanner-cdc/jars
# The driver's /metrics (PIPELINE_METRICS_PORT).
EXPOSE 8081
# 185 is the image's own spark user
USER 185
