# Pipeline image (rollout-log/app:local) for compose.yaml. No registry pulls: it starts from the
# Debian bookworm rootfs imported by kafka/build-image.sh and uses Debian's python3 (3.11).
#   bash kafka/build-image.sh && docker build -f Dockerfile.app -t rollout-log/app:local .
ARG BASE=rollout-log/debian-jre17:bookworm
FROM ${BASE}
RUN apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
COPY pyproject.toml README.md ./
COPY schemas/ schemas/
COPY streams/ streams/
COPY producers/ producers/
COPY consumers/ consumers/
COPY replay/ replay/
COPY rollout/ rollout/
COPY benchmarks/ benchmarks/
COPY policy/ policy/
COPY kafka/ kafka/
COPY examples/ examples/
# train: torch, for the local policy server (arena) and the reference trainer
ARG EXTRAS=train
RUN pip install --no-cache-dir -q ".[${EXTRAS}]"
CMD ["rollout", "--help"]
