#!/usr/bin/env bash
# Builds the lastcall-agent and lastcall-pubsub images for every architecture in
# LASTCALL_ARCHES (default: amd64 arm64) as multi-architecture OCI archives, offline, with
# Debian's buildah (vfs storage, chroot isolation: no daemon, no privileges), and checks each
# image from its own root filesystem:
#   - it runs as a non-root user, its entrypoint is the binary, it holds no shell, the binary
#     is static, the CA bundle is there;
#   - smoke test: the image's binary runs `--version` and `--help` as the image's user
#     (arm64 through qemu-aarch64-static from Debian's qemu-user-static);
#   - size: unpacked root filesystem within the budget (agent 15 MB, pubsub 15 MB), and the
#     gzip-compressed archive (what a registry stores) reported.
#
# The final stage of Dockerfile.<component> is built exactly as written; its `builder` stage
# is replaced (buildah --build-context) by a directory holding the static binary from
# hack/build-static.sh, the host's CA bundle and the passwd/group entries, because no base
# image can be pulled here.
#
#   hack/build-images.sh                         # both architectures
#   LASTCALL_ARCHES=amd64 hack/build-images.sh   # one
#   LASTCALL_IMAGE_DIR=/tmp/x hack/build-images.sh
#   LASTCALL_STAND_IN=1 hack/build-images.sh     # stand-in binaries: see below
#
# CI builds the real images (.ci/run: hack/release.sh --no-push runs hack/build-static.sh,
# then this script). With LASTCALL_STAND_IN=1 it runs around tiny static stand-in binaries
# instead (C, compiled per architecture by the compiler hack/cross.sh picks for this host) that
# answer --version and --help, so the Dockerfiles, the buildah multi-arch build, the manifest
# list and every check except the size budget run in seconds: a quick try of a Dockerfile
# change.
set -euo pipefail
cd "$(dirname "$0")/.."

ARCHES="${LASTCALL_ARCHES:-amd64 arm64}"
MUSL_ROOT="${LASTCALL_MUSL_TARGET_DIR:-/var/tmp/lastcall-target-musl}"
OUT="${LASTCALL_IMAGE_DIR:-/var/tmp/lastcall-images}"
BUDGET_UNPACKED=$((15 * 1000 * 1000))
BUILDAH=(buildah --storage-driver vfs)

tools=(buildah skopeo umoci file)
case " $ARCHES " in *" arm64 "*) tools+=(qemu-aarch64-static) ;; esac
for tool in "${tools[@]}"; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      buildah skopeo umoci file qemu-user-static
    break
  fi
done

triple() { hack/cross.sh triple "$1"; }

if [ "${LASTCALL_STAND_IN:-}" = 1 ]; then
  MUSL_ROOT="$(mktemp -d)"
  trap 'rm -rf "$MUSL_ROOT"' EXIT
  for arch in $ARCHES; do
    command -v "$(hack/cross.sh cc "$arch")" >/dev/null 2>&1 || {
      # shellcheck disable=SC2046,SC2086 # one architecture, then one package name, per word
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(hack/cross.sh packages $ARCHES)
      break
    }
  done
  printf '%s\n' '#include <stdio.h>' '#include <string.h>' \
    'int main(int c, char **v) { if (c > 1 && !strcmp(v[1], "--version")) { puts("stand-in"); return 0; }' \
    '  if (c > 1 && !strcmp(v[1], "--help")) { puts("Usage: stand-in"); return 0; } return 2; }' >"$MUSL_ROOT/stand-in.c"
  for arch in $ARCHES; do
    dir="$MUSL_ROOT/$(triple "$arch")/release"
    mkdir -p "$dir"
    cc="$(hack/cross.sh cc "$arch")"
    for b in lastcall-agent lastcall-pubsub; do "$cc" -static -Os -s -o "$dir/$b" "$MUSL_ROOT/stand-in.c"; done
  done
fi

missing=""
for arch in $ARCHES; do
  dir="$MUSL_ROOT/$(triple "$arch")/release"
  [ -x "$dir/lastcall-agent" ] && [ -x "$dir/lastcall-pubsub" ] || missing="$missing $arch"
done
if [ -n "$missing" ]; then
  LASTCALL_ARCHES="${missing# }" hack/build-static.sh
fi

mkdir -p "$OUT"
work="$(mktemp -d)"
trap 'rm -rf "$work" ${LASTCALL_STAND_IN:+"$MUSL_ROOT"}' EXIT
# The smoke test runs the image's binary as the image's user, who must reach it.
chmod 755 "$work"
fail=0
for c in agent pubsub; do
  bin="lastcall-$c"
  list="localhost/$bin:latest"
  "${BUILDAH[@]}" manifest rm "$list" >/dev/null 2>&1 || true
  "${BUILDAH[@]}" manifest create "$list" >/dev/null
  for arch in $ARCHES; do
    stage="$work/$c-$arch-builder"
    mkdir -p "$stage/out/etc/ssl/certs" "$work/context"
    cp "$MUSL_ROOT/$(triple "$arch")/release/$bin" "$stage/out/$bin"
    cp /etc/ssl/certs/ca-certificates.crt "$stage/out/etc/ssl/certs/"
    printf 'lastcall:x:65532:65532:lastcall:/nonexistent:/nonexistent\n' >"$stage/out/etc/passwd"
    printf 'lastcall:x:65532:\n' >"$stage/out/etc/group"
    tag="localhost/$bin:$arch"
    "${BUILDAH[@]}" build --quiet --isolation chroot --platform "linux/$arch" \
      --build-context "builder=$stage" -f "Dockerfile.$c" -t "$tag" "$work/context" >/dev/null
    "${BUILDAH[@]}" manifest add "$list" "$tag" >/dev/null

    # Checks, on this architecture's image alone.
    one="$work/$c-$arch.oci.tar"
    "${BUILDAH[@]}" push --quiet --format oci --compression-format gzip --compression-level 9 \
      "$tag" "oci-archive:$one:$bin:$arch"
    size=$(stat -c %s "$one")
    config="$(skopeo inspect --config "oci-archive:$one")"
    field() { printf '%s' "$config" | python3 -c "import json,sys; c=json.load(sys.stdin); print($1)"; }
    user="$(field 'c["config"].get("User","")')"
    entry="$(field 'json.dumps(c["config"].get("Entrypoint"))')"
    image_arch="$(field 'c.get("architecture","")')"
    mkdir -p "$work/oci-$c-$arch"
    tar -xf "$one" -C "$work/oci-$c-$arch"
    rootfs="$work/$c-$arch-rootfs"
    umoci raw unpack --rootless --image "$work/oci-$c-$arch:$bin:$arch" "$rootfs" >/dev/null 2>&1
    uid="${user%%:*}"
    static="$(file -b "$rootfs/$bin")"
    unpacked=$(du -sb "$rootfs" | cut -f1)
    echo "$bin $arch: archive $size bytes ($((size / 1024)) KiB), unpacked $unpacked bytes ($((unpacked / 1024)) KiB), user $user, entrypoint $entry"
    echo "  binary: $static"
    [ "$image_arch" = "$arch" ] || { echo "FAIL $bin $arch: image says architecture $image_arch"; fail=1; }
    [ "$unpacked" -le "$BUDGET_UNPACKED" ] || { echo "FAIL $bin $arch: $unpacked bytes unpacked, over the 15 MB budget"; fail=1; }
    [ -n "$uid" ] && [ "$uid" != "0" ] && [ "$uid" != "root" ] || { echo "FAIL $bin $arch: runs as root ($user)"; fail=1; }
    [ "$entry" = "[\"/$bin\"]" ] || { echo "FAIL $bin $arch: entrypoint $entry"; fail=1; }
    [ ! -e "$rootfs/bin/sh" ] || { echo "FAIL $bin $arch: the image has a shell"; fail=1; }
    [ -s "$rootfs/etc/ssl/certs/ca-certificates.crt" ] || { echo "FAIL $bin $arch: no CA bundle"; fail=1; }
    case "$static" in *"statically linked"* | *"static-pie"*) ;; *) echo "FAIL $bin $arch: not static"; fail=1 ;; esac
    hack/cross.sh check-elf "$arch" "$rootfs/$bin" >/dev/null || { echo "FAIL $bin $arch: wrong ELF machine or not static"; fail=1; }
    # No container runtime here: run the image's own binary from its rootfs, as the image's
    # user, natively or through qemu for arm64.
    run=("$rootfs/$bin")
    if [ "$arch" = arm64 ] && [ "$(uname -m)" != aarch64 ]; then
      run=(qemu-aarch64-static "$rootfs/$bin")
    fi
    for flag in --version --help; do
      if ! out="$(setpriv --reuid "$uid" --regid "${user##*:}" --clear-groups "${run[@]}" "$flag" 2>&1)"; then
        echo "FAIL $bin $arch: $flag: $out"; fail=1
      elif [ "$flag" = --version ]; then
        echo "  runs as $user: $out"
      fi
    done
  done
  archive="$OUT/$bin.oci.tar"
  rm -f "$archive"
  "${BUILDAH[@]}" manifest push --quiet --all --format oci "$list" "oci-archive:$archive:$bin:latest"
  echo "$bin: $archive ($ARCHES)"
done
[ "$fail" = 0 ] && echo "images ok" || { echo "image checks failed"; exit 1; }
