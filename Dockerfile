# syntax=docker/dockerfile:1
#
# The reclock image. compose.yaml runs every part of the deployment from it:
# the pipeline driver (`reclock run`), the Spark master and workers
# (`spark-class ...` of the installed PySpark) and the demo producer, so the
# driver, the executors and their Python workers all have the same Python,
# PySpark and libraries.
#
#   docker build -t reclock:0.1.0 .
#   docker run --rm reclock:0.1.0 reclock --help
FROM python:3.11.13-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Java 17 for Spark (a headless runtime is enough); procps for Spark's
# scripts (ps). JAVA_HOME gets an architecture-independent name.
RUN set -eux; \
    mkdir -p /usr/share/man/man1; \
    apt-get update; \
    apt-get install -y --no-install-recommends openjdk-17-jre-headless procps; \
    rm -rf /var/lib/apt/lists/*; \
    ln -s "/usr/lib/jvm/java-17-openjdk-$(dpkg --print-architecture)" /usr/lib/jvm/java-17; \
    java -version

# PySpark's own distribution is the Spark installation: bin/spark-class
# starts the standalone master and workers, jars/ holds Spark itself.
ENV JAVA_HOME=/usr/lib/jvm/java-17 \
    SPARK_HOME=/usr/local/lib/python3.11/site-packages/pyspark \
    PYSPARK_PYTHON=python3 \
    PYSPARK_DRIVER_PYTHON=python3
ENV PATH="${SPARK_HOME}/bin:${PATH}"

WORKDIR /app

# The dependencies first, in a layer of their own (PySpark alone is a few
# hundred MB): install the project with empty packages, then drop it.
COPY pyproject.toml README.md ./
RUN set -eux; \
    for p in reclock sources sinks remap_store; do mkdir -p "$p" && touch "$p/__init__.py"; done; \
    pip install .; \
    pip uninstall -y reclock; \
    rm -rf reclock sources sinks remap_store build ./*.egg-info

# Then the repository itself: the `reclock` console script, and the examples
# (examples/compose/producer.py runs from here).
# The C compiler is there only while pip builds the C extensions (the native
# Kafka reader, sources/_kafka_native.c, and the flat JSON parser,
# reclock/_json_native.c; the Python headers come with the base image,
# librdkafka with confluent-kafka), then goes; the import check fails the
# build if they did not compile (pip would fall back silently).
COPY . .
RUN set -eux; \
    apt-get update; \
    apt-get install -y --no-install-recommends gcc libc6-dev; \
    pip install --no-deps .; \
    apt-get purge -y --auto-remove gcc libc6-dev; \
    rm -rf /var/lib/apt/lists/* build ./*.egg-info; \
    cd / && python -c "import reclock._json_native, reclock.sources.kafka as k; assert k.native_reader() is not None"; cd /app; \
    test -x "$SPARK_HOME/bin/spark-class"; \
    reclock --help > /dev/null

# An unprivileged user; /state (the pipeline's state volume, shared with the
# Spark workers) belongs to it, and a named volume mounted there inherits that.
RUN set -eux; \
    useradd --create-home --uid 10001 --user-group reclock; \
    mkdir -p /state; \
    chown reclock:reclock /state
USER reclock

CMD ["reclock", "--help"]
