# Sourced by deploy/'s scripts: which container engine this machine has, and how to run podman.
#
#   ENGINE   docker where its daemon answers, else podman (installed where missing), else empty
#   PODMAN   the podman command line: `podman`, or `podman --runtime deploy/oci/runc` where a
#            plain container start fails and one through that wrapper works (a process without
#            CAP_SYS_RESOURCE cannot set a container's RLIMIT_NOFILE: deploy/oci/runc)

DEPLOY_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PROBE_IMAGE=docker.io/library/debian:bookworm-slim

# docker where its daemon answers; else podman, installed with what builds its base images
# (buildah, runc, debootstrap) from Debian where missing and this is root; else empty.
pick_engine() {
  if command -v docker >/dev/null && timeout 20 docker info >/dev/null 2>&1; then
    ENGINE=docker
  elif ensure_podman; then
    ENGINE=podman
  else
    ENGINE=
  fi
}

# podman, buildah, runc and debootstrap, installed from Debian where missing (as root).
ensure_podman() {
  local missing=() tool
  for tool in podman buildah runc debootstrap; do
    command -v "$tool" >/dev/null || missing+=("$tool")
  done
  [[ ${#missing[@]} -eq 0 ]] && return 0
  [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null || return 1
  echo "installing ${missing[*]} from Debian ..." >&2
  apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null
}

# Sets PODMAN; the probe needs the Debian base (deploy/image-bases makes it).
pick_podman_runtime() {
  PODMAN=(podman)
  podman image exists "$PROBE_IMAGE" || return 0
  timeout 60 podman run --rm --network none "$PROBE_IMAGE" true >/dev/null 2>&1 && return 0
  if timeout 60 podman --runtime "$DEPLOY_DIR/oci/runc" run --rm --network none "$PROBE_IMAGE" true >/dev/null 2>&1; then
    PODMAN=(podman --runtime "$DEPLOY_DIR/oci/runc")
    echo "podman: a plain container start fails here (no CAP_SYS_RESOURCE for its rlimits); using deploy/oci/runc" >&2
  fi
}

image_mib() {
  "$ENGINE" image inspect --format '{{.Size}}' "$1" | awk '{printf "%d", $1 / 1048576}'
}
