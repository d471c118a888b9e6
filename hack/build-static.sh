#!/usr/bin/env bash
# Builds static (musl) release binaries of lastcall-agent and lastcall-pubsub for each
# architecture in LASTCALL_ARCHES (default: amd64 arm64), the inputs of hack/build-images.sh.
# Installs the musl targets and Debian's C toolchains when missing.
#
# TLS: the workspace uses rustls with aws-lc-rs. aws-lc-sys compiles C and ships
# pre-generated bindings for both musl targets, so no cmake, Go or clang is needed:
#   amd64: Debian's musl-gcc (musl-tools);
#   arm64: Debian's cross compiler aarch64-linux-gnu-gcc (gcc-aarch64-linux-gnu) for
#          aws-lc's C and as the linker; Rust's self-contained musl CRT and libc make the
#          result static.
# Size: the workspace's release profile (Cargo.toml: opt-level "s", fat LTO, one codegen
# unit, stripped, panic = "abort") is what ships; nothing here overrides it.
set -euo pipefail
cd "$(dirname "$0")/.."

ARCHES="${LASTCALL_ARCHES:-amd64 arm64}"
export CARGO_TARGET_DIR="${LASTCALL_MUSL_TARGET_DIR:-/var/tmp/lastcall-target-musl}"

need_apt=()
for arch in $ARCHES; do
  case "$arch" in
    amd64)
      command -v musl-gcc >/dev/null 2>&1 || need_apt+=(musl-tools)
      ;;
    arm64)
      command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 || need_apt+=(gcc-aarch64-linux-gnu)
      ;;
    *)
      echo "unknown architecture $arch (amd64, arm64)" >&2
      exit 2
      ;;
  esac
done
if [ "${#need_apt[@]}" -gt 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}"
fi

for arch in $ARCHES; do
  case "$arch" in
    amd64)
      target=x86_64-unknown-linux-musl
      export CC_x86_64_unknown_linux_musl=musl-gcc
      ;;
    arm64)
      target=aarch64-unknown-linux-musl
      export CC_aarch64_unknown_linux_musl=aarch64-linux-gnu-gcc
      export AR_aarch64_unknown_linux_musl=aarch64-linux-gnu-ar
      export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_MUSL_LINKER=aarch64-linux-gnu-gcc
      ;;
  esac
  rustup target list --installed | grep -qx "$target" || rustup target add "$target"
  echo "== $arch ($target)"
  cargo build --locked --release --target "$target" -p lastcall-agent -p lastcall-pubsub \
    --bin lastcall-agent --bin lastcall-pubsub
  for b in lastcall-agent lastcall-pubsub; do
    f="$CARGO_TARGET_DIR/$target/release/$b"
    ls -l "$f"
    file "$f" 2>/dev/null || true
  done
done
