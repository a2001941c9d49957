#!/usr/bin/env bash
# Builds the image verifiers' `docker` runtime runs a seat's harness in, without pulling anything from a container
# registry (as kafka/build-image.sh does for Kafka):
#   1. base image: scripts/debian-base-image.sh (rollout-log/debian-jre17:bookworm, shared with the Kafka image)
#   2. docker build harness-image/Dockerfile -> rollout-log/vf-harness:<verifiers version>-<inputs hash> and
#      rollout-log/vf-harness:local: python3, the host's CA bundle, the venv's uv, verifiers' chat program with its
#      dependencies synced (from PyPI, through uv, at build time only).
# A seat whose runtime is `docker` with verifiers' default image runs in rollout-log/vf-harness:local
# (producers/environments/verifiers_loader.py, which checks the image's rollout-log.chat-program label against the chat program
# of the verifiers it runs). Skips the build when an image with the same inputs exists.
# Env: ROLLOUT_PYTHON (default .venv/bin/python: the verifiers and uv the pipeline runs), ROLLOUT_IMAGE_REBUILD=1,
# and those of scripts/debian-base-image.sh.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")
py=${ROLLOUT_PYTHON:-$root/.venv/bin/python}
base_tag=rollout-log/debian-jre17:bookworm
image=rollout-log/vf-harness
ca=${ROLLOUT_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
log() { echo "[harness-image] $*" >&2; }
die() { echo "[harness-image] error: $*" >&2; exit 1; }

command -v docker >/dev/null || die "docker CLI not found (apt-get install docker.io)"
docker info >/dev/null 2>&1 || die "no Docker engine answers (start dockerd, or run .ci/setup)"
[[ -x $py ]] || die "no Python at $py (run .ci/setup, or set ROLLOUT_PYTHON)"
uv=$(dirname "$py")/uv
[[ -x $uv ]] || uv=$(command -v uv) || die "uv not found beside $py nor on PATH (pip install uv)"
[[ -f $ca ]] || die "no CA bundle at $ca (set ROLLOUT_CA_BUNDLE)"

# 1. base image
bash "$root/scripts/debian-base-image.sh"

# 2. the harness image, tagged with a hash of its inputs. verifiers bundles its chat program from the modules in
# verifiers/v1/harnesses/utils when imported (seconds): the up-to-date check hashes those files instead.
read -r vf_dir vf_version < <("$py" -c 'import importlib.util as u, importlib.metadata as m
print(u.find_spec("verifiers").submodule_search_locations[0], m.version("verifiers"))' 2>/dev/null) || true
[[ -n ${vf_version:-} ]] || die "verifiers is not installed for $py (pip install 'rollout-log[verifiers]')"
chat_sources=$(cat "$vf_dir"/v1/harnesses/utils/*.py | sha256sum | cut -d' ' -f1)
base_id=$(docker image inspect -f '{{.Id}}' "$base_tag")
uv_version=$("$uv" --version)
inputs_hash=$( { echo "$base_id"; echo "verifiers $vf_version"; echo "$uv_version"; echo "chat sources $chat_sources";
                 cat "$here/Dockerfile" "$here/build-image.sh"; sha256sum <"$ca"; } | sha256sum | cut -c1-12)
tag="$image:$vf_version-$inputs_hash"

# shellcheck source=../scripts/image-lib.sh
source "$here/../scripts/image-lib.sh"
reuse_if_built "$tag" "$image"

ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
"$py" -c 'import sys; from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE as s; sys.stdout.buffer.write(s.encode())' \
  >"$ctx/chat.py" || die "cannot read verifiers' chat program with $py"
chat_digest=$(sha256sum "$ctx/chat.py" | cut -d' ' -f1)
cp "$here/Dockerfile" "$ctx/"
cp "$ca" "$ctx/host-ca.crt"
cp "$uv" "$ctx/uv"
log "docker build $tag (verifiers $vf_version, $uv_version, chat program ${chat_digest:0:12})"
# The classic builder uses the local base image as-is (no registry lookups).
DOCKER_BUILDKIT=0 docker build -q --build-arg BASE="$base_tag" --build-arg CHAT_DIGEST="$chat_digest" \
  --label "rollout-log.inputs-hash=$inputs_hash" --label "rollout-log.verifiers=$vf_version" \
  --label "rollout-log.chat-program=$chat_digest" \
  -t "$tag" -t "$image:local" "$ctx" >/dev/null
log "built $tag (= $image:local)"
