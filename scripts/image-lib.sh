# Sourced by the image build scripts (kafka/, harness-image/): the one rule for reusing an image already built
# from the same inputs. Needs the caller's log().

# reuse_if_built TAG IMAGE: when TAG exists (and ROLLOUT_IMAGE_REBUILD is unset), tag it IMAGE:local and exit 0.
reuse_if_built() {
  if [[ -z ${ROLLOUT_IMAGE_REBUILD:-} ]] && docker image inspect "$1" >/dev/null 2>&1; then
    docker tag "$1" "$2:local"
    log "up to date: $1 (= $2:local)"
    exit 0
  fi
}
