#!/usr/bin/env bash
# Builds the lastcall-agent and lastcall-pubsub images as OCI archives, offline, with buildah,
# and checks them: the archive exists, the image runs as a non-root user, its entrypoint is the
# binary, it holds no shell, the binary is static, and the archive (gzip-compressed layers, as
# pushed to a registry) is under 15 MB.
#
# The final stage of Dockerfile.<component> is built exactly as written; its `builder` stage
# is replaced (buildah --build-context) by a directory holding the static binary from
# hack/build-static.sh, the host's CA bundle and the passwd/group entries, because no base
# image can be pulled here.
#
#   hack/build-images.sh            # build (runs hack/build-static.sh if a binary is missing) and check
#   LASTCALL_IMAGE_DIR=/tmp/x hack/build-images.sh
set -euo pipefail
cd "$(dirname "$0")/.."

TARGET=x86_64-unknown-linux-musl
MUSL_DIR="${LASTCALL_MUSL_TARGET_DIR:-/var/tmp/lastcall-target-musl}/$TARGET/release"
OUT="${LASTCALL_IMAGE_DIR:-/var/tmp/lastcall-images}"
LIMIT=$((15 * 1000 * 1000))
BUILDAH=(buildah --storage-driver vfs)

for tool in buildah skopeo umoci file; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq buildah skopeo umoci file
    break
  fi
done
if [ ! -x "$MUSL_DIR/lastcall-agent" ] || [ ! -x "$MUSL_DIR/lastcall-pubsub" ]; then
  hack/build-static.sh
fi

mkdir -p "$OUT"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
fail=0
for c in agent pubsub; do
  bin="lastcall-$c"
  stage="$work/$c-builder"
  mkdir -p "$stage/out/etc/ssl/certs" "$work/context"
  cp "$MUSL_DIR/$bin" "$stage/out/$bin"
  cp /etc/ssl/certs/ca-certificates.crt "$stage/out/etc/ssl/certs/"
  printf 'lastcall:x:65532:65532:lastcall:/nonexistent:/nonexistent\n' >"$stage/out/etc/passwd"
  printf 'lastcall:x:65532:\n' >"$stage/out/etc/group"
  archive="$OUT/$bin.oci.tar"
  rm -f "$archive"
  # Build into buildah's own (vfs) storage, then write the archive with gzip-compressed
  # layers, as a registry stores and serves them.
  "${BUILDAH[@]}" build --quiet --isolation chroot --build-context "builder=$stage" \
    -f "Dockerfile.$c" -t "localhost/$bin:latest" "$work/context" >/dev/null
  "${BUILDAH[@]}" push --quiet --format oci --compression-format gzip --compression-level 9 \
    "localhost/$bin:latest" "oci-archive:$archive:$bin:latest"
  "${BUILDAH[@]}" rmi --force "localhost/$bin:latest" >/dev/null

  # Checks.
  [ -s "$archive" ] || { echo "FAIL $bin: no archive"; fail=1; continue; }
  size=$(stat -c %s "$archive")
  config="$(skopeo inspect --config "oci-archive:$archive")"
  user="$(printf '%s' "$config" | python3 -c 'import json,sys; print(json.load(sys.stdin)["config"].get("User",""))')"
  entry="$(printf '%s' "$config" | python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin)["config"].get("Entrypoint")))')"
  # umoci reads an OCI layout directory: unpack the archive into one, then the rootfs.
  mkdir -p "$work/oci-$c"
  tar -xf "$archive" -C "$work/oci-$c"
  umoci raw unpack --rootless --image "$work/oci-$c:$bin:latest" "$work/$c-rootfs" >/dev/null 2>&1
  uid="${user%%:*}"
  static="$(file -b "$work/$c-rootfs/$bin")"
  unpacked=$(du -sb "$work/$c-rootfs" | cut -f1)
  echo "$bin: $archive $size bytes ($((size / 1024)) KiB; $((unpacked / 1024)) KiB unpacked), user $user, entrypoint $entry"
  echo "  binary: $static"
  [ "$size" -lt "$LIMIT" ] || { echo "FAIL $bin: $size bytes is not under 15 MB"; fail=1; }
  [ -n "$uid" ] && [ "$uid" != "0" ] && [ "$uid" != "root" ] || { echo "FAIL $bin: runs as root ($user)"; fail=1; }
  [ "$entry" = "[\"/$bin\"]" ] || { echo "FAIL $bin: entrypoint $entry"; fail=1; }
  [ ! -e "$work/$c-rootfs/bin/sh" ] || { echo "FAIL $bin: the image has a shell"; fail=1; }
  [ -s "$work/$c-rootfs/etc/ssl/certs/ca-certificates.crt" ] || { echo "FAIL $bin: no CA bundle"; fail=1; }
  # No container runtime can run it here; run the image's binary from its rootfs as the
  # image's user instead, which shows the static build starts (TLS provider included).
  if ! setpriv --reuid "$uid" --regid "${user##*:}" --clear-groups "$work/$c-rootfs/$bin" --version >"$work/$c-version" 2>&1; then
    echo "FAIL $bin: the binary does not start: $(cat "$work/$c-version")"; fail=1
  else
    echo "  runs as $user: $(cat "$work/$c-version")"
  fi
  case "$static" in *"statically linked"* | *"static-pie"*) ;; *) echo "FAIL $bin: not static"; fail=1 ;; esac
done
[ "$fail" = 0 ] && echo "images ok" || { echo "image checks failed"; exit 1; }
