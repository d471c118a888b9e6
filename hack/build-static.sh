#!/usr/bin/env bash
# Builds static (musl) release binaries of lastcall-agent and lastcall-pubsub, the inputs of
# hack/build-images.sh. Installs the musl target and musl-tools when missing.
#
# TLS: the workspace uses rustls with aws-lc-rs. aws-lc-sys compiles C with the musl C
# compiler (musl-gcc from Debian's musl-tools); no cmake, Go or clang is needed, because
# aws-lc-sys ships pre-generated bindings for x86_64-unknown-linux-musl. See docs/install.md.
set -euo pipefail
cd "$(dirname "$0")/.."

TARGET=x86_64-unknown-linux-musl
export CARGO_TARGET_DIR="${LASTCALL_MUSL_TARGET_DIR:-/var/tmp/lastcall-target-musl}"

rustup target list --installed | grep -qx "$TARGET" || rustup target add "$TARGET"
if ! command -v musl-gcc >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq musl-tools
fi

export CC_x86_64_unknown_linux_musl=musl-gcc
export CARGO_PROFILE_RELEASE_STRIP=symbols
cargo build --locked --release --target "$TARGET" -p lastcall-agent -p lastcall-pubsub \
  --bin lastcall-agent --bin lastcall-pubsub

for b in lastcall-agent lastcall-pubsub; do
  f="$CARGO_TARGET_DIR/$TARGET/release/$b"
  ls -l "$f"
  file "$f" 2>/dev/null || true
done
