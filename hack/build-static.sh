#!/usr/bin/env bash
# Builds static (musl) release binaries of lastcall-agent and lastcall-pubsub for each
# architecture in LASTCALL_ARCHES (default: amd64 arm64), the inputs of hack/build-images.sh.
# Installs the musl targets and Debian's C toolchains when missing.
#
# TLS: the workspace uses rustls with aws-lc-rs. aws-lc-sys compiles C and ships
# pre-generated bindings for both musl targets, so no cmake, Go or clang is needed. The C
# compiler is chosen per target from the build host's architecture by hack/cross.sh: Debian's
# musl-gcc for the host's own architecture, Debian's cross gcc for the other one (also the
# linker; Rust's self-contained musl CRT and libc make the result static). So an amd64 and an
# arm64 host both build both images. LASTCALL_HOST_ARCH=arm64 pretends an arm64 host (to try
# that choice on amd64: only the amd64 target then builds here).
# Size: the workspace's release profile (Cargo.toml: opt-level "s", fat LTO, one codegen
# unit, stripped, panic = "abort") is what ships; nothing here overrides it.
set -euo pipefail
cd "$(dirname "$0")/.."

ARCHES="${LASTCALL_ARCHES:-amd64 arm64}"
export CARGO_TARGET_DIR="${LASTCALL_MUSL_TARGET_DIR:-/var/tmp/lastcall-target-musl}"

need_apt=()
for arch in $ARCHES; do
  cc="$(hack/cross.sh cc "$arch")"
  command -v "$cc" >/dev/null 2>&1 || need_apt+=("$(hack/cross.sh packages "$arch")")
done
if [ "${#need_apt[@]}" -gt 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}"
fi

for arch in $ARCHES; do
  target="$(hack/cross.sh triple "$arch")"
  cross_env="$(hack/cross.sh env "$arch")"
  eval "$cross_env"
  rustup target list --installed | grep -qx "$target" || rustup target add "$target"
  echo "== $arch ($target) on a $(hack/cross.sh host) host: ${cross_env//$'\n'/; }"
  cargo build --locked --release --target "$target" -p lastcall-agent -p lastcall-pubsub \
    --bin lastcall-agent --bin lastcall-pubsub
  for b in lastcall-agent lastcall-pubsub; do
    f="$CARGO_TARGET_DIR/$target/release/$b"
    ls -l "$f"
    file "$f" 2>/dev/null || true
    hack/cross.sh check-elf "$arch" "$f"
  done
done
