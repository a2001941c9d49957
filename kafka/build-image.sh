#!/usr/bin/env bash
# Builds the Kafka container image used by the test suite (testcontainers) and compose.yaml,
# without pulling anything from a container registry:
#   1. Kafka jars: mvn -f kafka/pom.xml package  -> $CACHE/kafka-<version>/libs
#   2. base image: scripts/debian-base-image.sh (debootstrap --variant=minbase bookworm + openjdk-17-jre-headless
#      into $CACHE, then `docker import` as rollout-log/debian-jre17:bookworm)
#   3. docker build kafka/Dockerfile -> rollout-log/kafka:<version>-<inputs hash> and rollout-log/kafka:local
# Skips every step whose output already exists. Env: ROLLOUT_CACHE_DIR (default ~/.cache/rollout-log),
# ROLLOUT_DEBIAN_MIRROR (default: the Debian mirror this machine's apt uses), ROLLOUT_IMAGE_REBUILD=1.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${ROLLOUT_CACHE_DIR:-$HOME/.cache/rollout-log}
kafka_version=$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$here/pom.xml" | head -n1)
libs="$cache/kafka-$kafka_version/libs"
base_tag=rollout-log/debian-jre17:bookworm
image=rollout-log/kafka
log() { echo "[build-image] $*" >&2; }
die() { echo "[build-image] error: $*" >&2; exit 1; }

command -v docker >/dev/null || die "docker CLI not found (apt-get install docker.io)"
docker info >/dev/null 2>&1 || die "no Docker engine answers (start dockerd, or run .ci/setup)"

# 1. jars
if [[ ! -f $libs/kafka_2.13-$kafka_version.jar ]]; then
  command -v mvn >/dev/null || die "mvn not found (apt-get install maven)"
  log "resolving Kafka $kafka_version jars into $libs"
  mvn -q -B -f "$here/pom.xml" package -Dlibs.dir="$libs"
fi

# 2. base image (shared with the harness image: scripts/debian-base-image.sh)
bash "$here/../scripts/debian-base-image.sh"

# 3. kafka image, tagged with a hash of its inputs
base_id=$(docker image inspect -f '{{.Id}}' "$base_tag")
inputs_hash=$( { echo "$base_id"; cat "$here/Dockerfile" "$here/image/entrypoint.sh" "$here/log4j2.xml" "$here/pom.xml";
                 (cd "$libs" && ls -1 | LC_ALL=C sort); } | sha256sum | cut -c1-12)
tag="$image:$kafka_version-$inputs_hash"

# shellcheck source=../scripts/image-lib.sh
source "$here/../scripts/image-lib.sh"
reuse_if_built "$tag" "$image"

ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
cp -r "$libs" "$ctx/libs"
cp "$here/Dockerfile" "$here/log4j2.xml" "$here/image/entrypoint.sh" "$ctx/"
log "docker build $tag"
# The classic builder uses the local base image as-is (no registry lookups).
DOCKER_BUILDKIT=0 docker build -q --build-arg BASE="$base_tag" --build-arg KAFKA_VERSION="$kafka_version" \
  --label "rollout-log.inputs-hash=$inputs_hash" -t "$tag" -t "$image:local" "$ctx" >/dev/null
log "built $tag (= $image:local)"
