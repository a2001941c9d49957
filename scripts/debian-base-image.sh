#!/usr/bin/env bash
# Builds the project's one base container image without pulling anything from a container registry:
#   debootstrap --variant=minbase --include=openjdk-17-jre-headless bookworm into $CACHE/rootfs (a tarball kept in
#   the cache), then `docker import` as rollout-log/debian-jre17:bookworm.
# The Kafka image (kafka/build-image.sh), the harness image for verifiers' docker runtime
# (harness-image/build-image.sh) and Dockerfile.app start FROM it. Skips every step whose output already exists.
# Env: ROLLOUT_CACHE_DIR (default ~/.cache/rollout-log), ROLLOUT_DEBIAN_MIRROR (default: the Debian mirror this
# machine's apt uses). Prints nothing on stdout; the tag is rollout-log/debian-jre17:bookworm.
set -euo pipefail

cache=${ROLLOUT_CACHE_DIR:-$HOME/.cache/rollout-log}
base_tag=rollout-log/debian-jre17:bookworm
log() { echo "[base-image] $*" >&2; }
die() { echo "[base-image] error: $*" >&2; exit 1; }

command -v docker >/dev/null || die "docker CLI not found (apt-get install docker.io)"
docker info >/dev/null 2>&1 || die "no Docker engine answers (start dockerd, or run .ci/setup)"

debian_mirror() {
  if [[ -n ${ROLLOUT_DEBIAN_MIRROR:-} ]]; then echo "$ROLLOUT_DEBIAN_MIRROR"; return; fi
  # The first non-security Debian URI apt is configured with (deb822 or one-line format).
  local m
  m=$( { grep -hE '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}';
         grep -hE '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | awk '{print $2}'; } \
       | grep -v -- '-security' | head -n1 || true)
  echo "$m"   # empty: debootstrap's built-in default
}

if docker image inspect "$base_tag" >/dev/null 2>&1; then
  exit 0
fi
tarball="$cache/rootfs/bookworm-minbase-jre17.tar"
if [[ ! -f $tarball ]]; then
  command -v debootstrap >/dev/null || die "debootstrap not found (apt-get install debootstrap)"
  [[ $(id -u) == 0 ]] || die "debootstrap needs root"
  rootfs="$cache/rootfs/bookworm-minbase-jre17.d"
  rm -rf "$rootfs"; mkdir -p "$rootfs"
  log "debootstrap bookworm (minbase + openjdk-17-jre-headless) into $rootfs"
  mirror=$(debian_mirror)
  debootstrap --variant=minbase --include=openjdk-17-jre-headless bookworm "$rootfs" ${mirror:+"$mirror"} >"$cache/rootfs/debootstrap.log" 2>&1 \
    || die "debootstrap failed, see $cache/rootfs/debootstrap.log"
  # Trim: apt lists, caches, docs; nothing in the image needs them.
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb \
         "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/locale/*
  tar --numeric-owner -C "$rootfs" -cf "$tarball.tmp" .
  mv "$tarball.tmp" "$tarball"
  rm -rf "$rootfs"
fi
log "docker import $tarball as $base_tag"
docker import -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' -c 'CMD ["/bin/bash"]' \
  "$tarball" "$base_tag" >/dev/null
