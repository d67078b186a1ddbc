# syntax=docker/dockerfile:1
# The durable-streams image: one entrypoint for every role.
#   docker build -t durable-streams .                 # gateway + archive worker
#   docker build --target spark -t durable-streams:spark .   # + Java and PySpark, for the analytics job
#   docker run -e DURABLE_STREAMS_REDIS_URL=redis://redis:6379/0 -p 4437:4437 durable-streams serve --workers 2
#   docker run -e DURABLE_STREAMS_REDIS_URL=... durable-streams archive --archive-url s3://bucket/streams
ARG PYTHON_VERSION=3.11

# Build stage: our wheel plus wheels of every dependency (binary wheels: no compiler needed later).
FROM python:${PYTHON_VERSION}-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY lua ./lua
COPY workers ./workers
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[s3]"

# Runtime: slim Python, the wheels installed, no build tools, a non-root user.
FROM python:${PYTHON_VERSION}-slim AS runtime
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links /wheels "durable-streams-redis[s3]" \
 && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin streams
ENV PYTHONUNBUFFERED=1 \
    DURABLE_STREAMS_HOST=0.0.0.0 \
    PROMETHEUS_MULTIPROC_DIR=/tmp/metrics
WORKDIR /tmp
USER 10001:10001
EXPOSE 4437 9464
ENTRYPOINT ["durable-streams"]
CMD ["serve"]

# The analytics job: the runtime plus a Java runtime and PySpark.
FROM runtime AS spark
USER root
RUN apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jre-headless \
 && rm -rf /var/lib/apt/lists/* \
 && pip install --no-cache-dir "pyspark>=3.5"
USER 10001:10001
ENTRYPOINT ["python", "-m", "workers.analytics"]
CMD ["--help"]
