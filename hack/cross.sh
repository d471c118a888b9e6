#!/bin/sh
# The C toolchain for each image architecture, chosen from the build host's architecture, for
# hack/build-static.sh, hack/build-images.sh (stand-ins) and both Dockerfiles' builder stage.
# POSIX sh: the Dockerfiles' RUN lines use the base image's /bin/sh.
#
# aws-lc-sys (rustls' crypto) compiles C for the musl target. Debian's musl-gcc wraps the
# host's own gcc, so it only builds for the host's architecture; the other architecture gets
# Debian's cross gcc (a glibc toolchain: it compiles aws-lc's C and drives the link, while
# Rust's self-contained musl CRT and libc make the result static):
#   amd64 host: amd64 -> musl-gcc (musl-tools), arm64 -> aarch64-linux-gnu-gcc (gcc-aarch64-linux-gnu)
#   arm64 host: arm64 -> musl-gcc (musl-tools), amd64 -> x86_64-linux-gnu-gcc (gcc-x86-64-linux-gnu)
#
#   hack/cross.sh host                 # amd64 | arm64 (LASTCALL_HOST_ARCH pretends another host)
#   hack/cross.sh triple ARCH          # Rust target
#   hack/cross.sh cc ARCH              # C compiler for ARCH on this host
#   hack/cross.sh packages ARCH...     # Debian packages providing those compilers
#   eval "$(hack/cross.sh env ARCH)"   # CC_/AR_/linker variables for cargo and cc-rs
#   hack/cross.sh check-elf ARCH FILE  # fails unless FILE is a static ELF executable for ARCH
set -eu

die() {
  echo "cross.sh: $*" >&2
  exit 2
}

host_arch() {
  if [ -n "${LASTCALL_HOST_ARCH:-}" ]; then
    m="$LASTCALL_HOST_ARCH"
  else
    m="$(uname -m)"
  fi
  case "$m" in
    x86_64 | amd64) echo amd64 ;;
    aarch64 | arm64) echo arm64 ;;
    *) die "unsupported build host architecture $m (amd64 or arm64)" ;;
  esac
}

triple() {
  case "$1" in
    amd64) echo x86_64-unknown-linux-musl ;;
    arm64) echo aarch64-unknown-linux-musl ;;
    *) die "unknown architecture $1 (amd64, arm64)" ;;
  esac
}

# The GNU triplet prefix of Debian's cross tools for ARCH.
gnu_prefix() {
  case "$1" in
    amd64) echo x86_64-linux-gnu ;;
    arm64) echo aarch64-linux-gnu ;;
    *) die "unknown architecture $1 (amd64, arm64)" ;;
  esac
}

cc_for() {
  triple "$1" >/dev/null
  h="$(host_arch)"
  if [ "$1" = "$h" ]; then
    echo musl-gcc
  else
    echo "$(gnu_prefix "$1")-gcc"
  fi
}

package_for() {
  triple "$1" >/dev/null
  h="$(host_arch)"
  if [ "$1" = "$h" ]; then
    echo musl-tools
  else
    # Debian spells the package with dashes: gcc-x86-64-linux-gnu, gcc-aarch64-linux-gnu.
    echo "gcc-$(gnu_prefix "$1" | tr _ -)"
  fi
}

env_for() {
  t="$(triple "$1")"
  var="$(echo "$t" | tr - _)"
  cc="$(cc_for "$1")"
  echo "export CC_$var=$cc"
  if [ "$cc" != musl-gcc ]; then
    echo "export AR_$var=$(gnu_prefix "$1")-ar"
    echo "export CARGO_TARGET_$(echo "$var" | tr '[:lower:]' '[:upper:]')_LINKER=$cc"
  fi
}

# readelf's name of ARCH's ELF machine.
elf_machine() {
  case "$1" in
    amd64) echo "Advanced Micro Devices X86-64" ;;
    arm64) echo "AArch64" ;;
    *) die "unknown architecture $1 (amd64, arm64)" ;;
  esac
}

# A binary built for the wrong machine, or one that wants a dynamic loader, must not reach an
# image: the other architecture's loader is not there and the image has no libc.
check_elf() {
  want="$(elf_machine "$1")"
  [ -f "$2" ] || die "$2: no such file"
  got="$(LC_ALL=C readelf -h "$2" | sed -n 's/^ *Machine: *//p')"
  [ "$got" = "$want" ] || die "$2: ELF machine '$got', want '$want' ($1)"
  if LC_ALL=C readelf -l "$2" | grep -q 'Requesting program interpreter'; then
    die "$2: dynamically linked (asks for a program interpreter)"
  fi
  if LC_ALL=C readelf -d "$2" 2>/dev/null | grep -q '(NEEDED)'; then
    die "$2: needs shared libraries"
  fi
  echo "$2: $got, static"
}

[ $# -ge 1 ] || die "usage: cross.sh host | triple ARCH | cc ARCH | packages ARCH... | env ARCH | check-elf ARCH FILE"
cmd="$1"
shift
case "$cmd" in
  host) host_arch ;;
  triple) triple "${1:?ARCH}" ;;
  cc) cc_for "${1:?ARCH}" ;;
  env) env_for "${1:?ARCH}" ;;
  check-elf) check_elf "${1:?ARCH}" "${2:?FILE}" ;;
  packages)
    list=""
    for a in "$@"; do
      p="$(package_for "$a")"
      case " $list " in *" $p "*) ;; *) list="${list:+$list }$p" ;; esac
    done
    echo "$list"
    ;;
  *) die "unknown command $cmd" ;;
esac
