#!/usr/bin/env bash
# Cuts a release: both multi-architecture images (amd64 + arm64) and the chart as an OCI
# artifact, all with one version. The release workflow (.github/workflows/release.yml) runs
# this on a `v*` tag; .ci/run runs it with --no-push, so every step but the push is checked on
# every change. docs/release.md is the how-to.
#
#   hack/release.sh --tag v0.2.0        # a release: checks, builds, packages, pushes
#   hack/release.sh --no-push           # the same short of pushing, version from Chart.yaml
#
# Steps:
#   1. version: the tag must be `v` + a semantic version (no build metadata: an OCI tag cannot
#      hold `+`) equal to charts/lastcall/Chart.yaml's version and appVersion and to the Cargo
#      workspace version (what the binaries' --version print). Bumping is a commit before the
#      tag, so a tag can never publish something the tree does not say.
#   2. images: hack/build-static.sh, then hack/build-images.sh (buildah, offline, with every
#      image check); each archive must be an index of linux/amd64 and linux/arm64 whose
#      binaries print this version.
#   3. chart: charts/lastcall packaged with version = appVersion = the version, and its
#      image.registry set to the release registry, so `helm install oci://...` pulls the images
#      pushed beside it with no --set. The packaged chart is rendered (all components on) and
#      every image it names must be exactly one this release pushes or one of the public images
#      docs/release.md lists (the bundled Redis).
#   4. push (skipped by --no-push): the images by skopeo (`--all`: the index and both
#      architectures) to <registry>/lastcall-agent:<version> and <registry>/lastcall-pubsub:<version>,
#      then the chart by `helm push` to oci://<registry> (so oci://<registry>/lastcall), and each
#      is read back from the registry.
#
# Environment:
#   LASTCALL_REGISTRY            registry and path prefix, e.g. ghcr.io/example-org (required to
#                                push; --no-push packages for registry.invalid/lastcall if unset)
#   LASTCALL_REGISTRY_USERNAME   with LASTCALL_REGISTRY_PASSWORD: logs skopeo and helm in to the
#   LASTCALL_REGISTRY_PASSWORD   registry's host first; unset: whatever login they already hold
#   LASTCALL_REGISTRY_PLAIN_HTTP 1: the registry speaks plain HTTP (a local test registry only)
#   LASTCALL_RELEASE_DIR         output (default /var/tmp/lastcall-release): images/ and the .tgz
#   LASTCALL_HELM                helm binary (default: helm on PATH, else built from hack/box/helm)
#   LASTCALL_SKIP_BUILD          1: reuse the archives already in $LASTCALL_RELEASE_DIR/images
#                                (they are still checked); for trying the chart and push steps
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
}

die() {
  echo "release: $*" >&2
  exit 1
}

push=1
tag=""
while [ $# -gt 0 ]; do
  case "$1" in
    --no-push) push=0 ;;
    --tag)
      [ $# -ge 2 ] || die "--tag needs a value, e.g. --tag v0.2.0"
      tag="$2"
      shift
      ;;
    --tag=*) tag="${1#--tag=}" ;;
    -h | --help)
      usage
      exit 0
      ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
  shift
done

OUT="${LASTCALL_RELEASE_DIR:-/var/tmp/lastcall-release}"
IMAGES="$OUT/images"
CHART_DIR=charts/lastcall
COMPONENTS=(agent pubsub)
ARCHES=(amd64 arm64)
started=$SECONDS
step() { echo "== release [$((SECONDS - started)) s]: $*"; }

# A top-level scalar of a flat YAML file (Chart.yaml), quotes removed.
chart_field() {
  sed -n "s/^$1:[[:space:]]*[\"']\{0,1\}\([^\"']*\)[\"']\{0,1\}[[:space:]]*$/\1/p" "$CHART_DIR/Chart.yaml"
}

# Semantic Versioning 2.0.0's grammar, less build metadata (an OCI tag cannot hold `+`).
SEMVER_NUM='(0|[1-9][0-9]*)'
SEMVER_PRE_ID='(0|[1-9][0-9]*|[0-9]*[A-Za-z-][0-9A-Za-z-]*)'
SEMVER="^$SEMVER_NUM\\.$SEMVER_NUM\\.$SEMVER_NUM(-$SEMVER_PRE_ID(\\.$SEMVER_PRE_ID)*)?\$"

# --- 1. version ----------------------------------------------------------------------------------
step "version"
chart_version="$(chart_field version)"
app_version="$(chart_field appVersion)"
cargo_version="$(sed -n '/^\[workspace.package\]/,/^\[/s/^version[[:space:]]*=[[:space:]]*"\(.*\)"/\1/p' Cargo.toml)"
if [ -n "$tag" ]; then
  [[ "$tag" == v* ]] || die "tag '$tag' does not start with v (release tags are v<semver>, e.g. v$chart_version)"
  version="${tag#v}"
elif [ "$push" = 1 ]; then
  die "a release that pushes needs --tag v<version> (the git tag being released); --no-push checks Chart.yaml's version"
else
  version="$chart_version"
fi
if [[ "$version" == *+* ]]; then
  die "version '$version' has build metadata (+...): OCI tags cannot hold '+'; use a pre-release (-rc.1) instead"
fi
[[ "$version" =~ $SEMVER ]] || die "version '$version' is not a semantic version (MAJOR.MINOR.PATCH[-PRERELEASE], see semver.org)"
[ "$version" = "$chart_version" ] \
  || die "tag v$version does not match $CHART_DIR/Chart.yaml version $chart_version: bump Chart.yaml (version and appVersion) and Cargo.toml in a commit, then tag that commit"
[ "$version" = "$app_version" ] \
  || die "$CHART_DIR/Chart.yaml appVersion $app_version differs from its version $chart_version: they must both be $version (the images are tagged with the appVersion)"
[ "$version" = "$cargo_version" ] \
  || die "Cargo.toml workspace version $cargo_version differs from $version: the binaries' --version must print the release's version"
if [ "$push" = 1 ]; then
  [ -n "${LASTCALL_REGISTRY:-}" ] \
    || die "LASTCALL_REGISTRY is not set: the registry to push to, e.g. ghcr.io/example-org (the release workflow reads the repository variable LASTCALL_REGISTRY; see docs/release.md)"
  git diff --quiet HEAD -- || die "the working tree has uncommitted changes: a release is built from the tagged commit alone"
  tag_commit="$(git rev-parse -q --verify "refs/tags/$tag^{commit}" || true)"
  [ -n "$tag_commit" ] || die "tag $tag does not exist in this clone"
  [ "$tag_commit" = "$(git rev-parse HEAD)" ] || die "tag $tag is $tag_commit, not the checked-out commit $(git rev-parse HEAD)"
fi
REGISTRY="${LASTCALL_REGISTRY:-registry.invalid/lastcall}"
REGISTRY="${REGISTRY%/}"
[[ "$REGISTRY" =~ ^[a-z0-9.-]+(:[0-9]+)?(/[a-z0-9._-]+)*$ ]] \
  || die "LASTCALL_REGISTRY '$REGISTRY' is not a registry host with an optional lowercase path (no scheme, no tag), e.g. ghcr.io/example-org"
REGISTRY_HOST="${REGISTRY%%/*}"
echo "version $version, registry $REGISTRY$([ "$push" = 1 ] || echo ' (--no-push: nothing leaves this machine)')"

# --- helm ----------------------------------------------------------------------------------------
HELM="${LASTCALL_HELM:-}"
if [ -z "$HELM" ]; then
  if command -v helm >/dev/null 2>&1; then
    HELM="$(command -v helm)"
  else
    # Only helm of the box (hack/box/build.sh builds the whole control plane): same module,
    # same pins, so the same helm the tests use.
    # shellcheck disable=SC1091 # pins only
    . hack/box/versions.env
    HELM="$OUT/tools/helm-$HELM_VERSION"
    if [ ! -x "$HELM" ]; then
      step "building helm $HELM_VERSION from hack/box/helm"
      mkdir -p "$OUT/tools"
      (cd hack/box/helm && GOFLAGS="-mod=readonly -modcacherw" CGO_ENABLED=0 GOTOOLCHAIN=local \
        go build -trimpath -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" \
        -o "$HELM.tmp" helm.sh/helm/v3/cmd/helm)
      mv "$HELM.tmp" "$HELM"
    fi
  fi
fi
"$HELM" version --short >/dev/null || die "helm at $HELM does not run"

# --- 2. images -----------------------------------------------------------------------------------
mkdir -p "$OUT"
if [ "${LASTCALL_SKIP_BUILD:-}" = 1 ]; then
  step "images: reusing $IMAGES (LASTCALL_SKIP_BUILD=1)"
else
  step "images: static builds (hack/build-static.sh)"
  LASTCALL_ARCHES="${ARCHES[*]}" hack/build-static.sh
  step "images: buildah builds and checks (hack/build-images.sh)"
  rm -rf "$IMAGES"
  LASTCALL_ARCHES="${ARCHES[*]}" LASTCALL_IMAGE_DIR="$IMAGES" hack/build-images.sh
fi
step "images: each archive is an index of ${ARCHES[*]} at version $version"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
for c in "${COMPONENTS[@]}"; do
  archive="$IMAGES/lastcall-$c.oci.tar"
  [ -s "$archive" ] || die "$archive is missing"
  skopeo inspect --raw "oci-archive:$archive" >"$work/$c-index.json" || die "$archive: not an OCI archive"
  platforms="$(python3 -c '
import json, sys
index = json.load(open(sys.argv[1]))
print(" ".join(sorted(m["platform"]["os"] + "/" + m["platform"]["architecture"] for m in index.get("manifests", []))))
' "$work/$c-index.json")"
  want="$(printf 'linux/%s\n' "${ARCHES[@]}" | sort | tr '\n' ' ')"
  [ "$platforms " = "$want" ] || die "$archive holds [$platforms], want [${want% }]"
  # The binary of this host's architecture, from the image itself, must print the version.
  host="$(hack/cross.sh host)"
  tar -xf "$archive" -C "$work" --one-top-level="oci-$c"
  skopeo copy -q --override-arch "$host" "oci:$work/oci-$c:lastcall-$c:latest" "dir:$work/dir-$c"
  layer="$(python3 -c '
import json, sys
print(json.load(open(sys.argv[1]))["layers"][-1]["digest"].split(":")[1])
' "$work/dir-$c/manifest.json")"
  mkdir -p "$work/root-$c"
  tar -xzf "$work/dir-$c/$layer" -C "$work/root-$c" "lastcall-$c"
  got="$("$work/root-$c/lastcall-$c" --version)"
  [[ "$got" == *" $version" || "$got" == "$version" ]] || die "lastcall-$c ($host, from $archive) --version says '$got', want $version"
  echo "lastcall-$c: [$platforms], --version: $got"
done

# --- 3. chart ------------------------------------------------------------------------------------
step "chart: package $version for $REGISTRY"
cp -r "$CHART_DIR" "$work/chart"
# image.registry, the one `registry:` key directly under the top-level `image:` map.
python3 - "$work/chart/values.yaml" "$REGISTRY" <<'PY' || die "could not set image.registry in $CHART_DIR/values.yaml"
import re, sys
path, registry = sys.argv[1], sys.argv[2]
text = open(path).read()
block = re.search(r"^image:\n((?:[ \t]+.*\n|[ \t]*\n)*)", text, re.M)
if not block:
    sys.exit("no top-level image: map")
lines = re.findall(r"^  registry:.*$", block.group(1), re.M)
if len(lines) != 1:
    sys.exit(f"{len(lines)} registry: lines under image:, want 1")
body = block.group(1).replace(lines[0], f'  registry: "{registry}"', 1)
open(path, "w").write(text[: block.start(1)] + body + text[block.end(1):])
PY
rm -f "$OUT"/lastcall-*.tgz
"$HELM" package "$work/chart" --version "$version" --app-version "$version" -d "$OUT" >/dev/null
tgz="$OUT/lastcall-$version.tgz"
[ -s "$tgz" ] || die "helm package did not write $tgz"
meta="$("$HELM" show chart "$tgz")"
grep -qx "version: $version" <<<"$meta" || die "$tgz: version is not $version"
grep -qx "appVersion: $version" <<<"$meta" || die "$tgz: appVersion is not $version"
step "chart: render the package (all components on) and compare its images with what is pushed"
# The CI values name a registry of their own: their `image:` map is left out, so the packaged
# default is what renders.
awk '/^image:/ { skip = 1; next } skip && /^[^ #]/ { skip = 0 } !skip' \
  "$CHART_DIR/ci/all-on-values.yaml" >"$work/all-on-values.yaml"
"$HELM" template lastcall "$tgz" --namespace lastcall -f "$work/all-on-values.yaml" >"$work/rendered.yaml"
# Every image the package names is one this release pushes, or one of the public images
# docs/release.md lists ("Images a release does not push"): a user installing the release
# must be able to pull each.
python3 - "$work/rendered.yaml" "$REGISTRY" "$version" docs/release.md "${COMPONENTS[@]}" <<'PY' || die "the packaged chart names an image this release neither pushes nor documents as public (docs/release.md)"
import re, sys
rendered, registry, version, doc = open(sys.argv[1]).read(), sys.argv[2], sys.argv[3], open(sys.argv[4]).read()
components = sys.argv[5:]
images = set(re.findall(r"^\s*-?\s*image:\s*\"?([^\"\s]+)\"?\s*$", rendered, re.M))
pushed = {f"{registry}/lastcall-{c}:{version}" for c in components}
section = re.search(r"^## Images a release does not push\n(.*?)(?=^## )", doc, re.M | re.S)
if not section:
    sys.exit("docs/release.md has no section \"Images a release does not push\"")
public = set(re.findall(r"^\| `([^`]+)` \|", section.group(1), re.M))
print(f"images in the packaged chart: {', '.join(sorted(images))}")
print(f"pushed: {', '.join(sorted(pushed))}; documented public: {', '.join(sorted(public))}")
missing = pushed - images
if missing:
    sys.exit(f"the packaged chart does not name {sorted(missing)}")
stray = images - pushed - public
if stray:
    sys.exit(f"the packaged chart names {sorted(stray)}: not pushed by this release, not a public image of docs/release.md")
PY
echo "chart: $tgz ($(stat -c %s "$tgz") bytes)"

# --- 4. push -------------------------------------------------------------------------------------
if [ "$push" = 0 ]; then
  step "done, nothing pushed (--no-push): would push ${COMPONENTS[*]/#/$REGISTRY/lastcall-} at $version and oci://$REGISTRY/lastcall $version"
  exit 0
fi
tls=(--dest-tls-verify=true)
src_tls=(--tls-verify=true)
helm_http=()
if [ "${LASTCALL_REGISTRY_PLAIN_HTTP:-}" = 1 ]; then
  tls=(--dest-tls-verify=false)
  src_tls=(--tls-verify=false)
  helm_http=(--plain-http)
fi
if [ -n "${LASTCALL_REGISTRY_USERNAME:-}" ] || [ -n "${LASTCALL_REGISTRY_PASSWORD:-}" ]; then
  if [ -z "${LASTCALL_REGISTRY_USERNAME:-}" ] || [ -z "${LASTCALL_REGISTRY_PASSWORD:-}" ]; then
    die "set both LASTCALL_REGISTRY_USERNAME and LASTCALL_REGISTRY_PASSWORD, or neither"
  fi
  step "log in to $REGISTRY_HOST"
  printf '%s' "$LASTCALL_REGISTRY_PASSWORD" \
    | skopeo login "${src_tls[@]}" --username "$LASTCALL_REGISTRY_USERNAME" --password-stdin "$REGISTRY_HOST"
  printf '%s' "$LASTCALL_REGISTRY_PASSWORD" \
    | "$HELM" registry login "${helm_http[@]}" --username "$LASTCALL_REGISTRY_USERNAME" \
      --password-stdin "$REGISTRY_HOST"
fi
for c in "${COMPONENTS[@]}"; do
  ref="$REGISTRY/lastcall-$c:$version"
  step "push $ref"
  skopeo copy -q --all --preserve-digests "${tls[@]}" \
    "oci-archive:$IMAGES/lastcall-$c.oci.tar:lastcall-$c:latest" "docker://$ref"
  skopeo inspect --raw "${src_tls[@]}" "docker://$ref" >"$work/pushed-$c.json"
  cmp -s "$work/pushed-$c.json" "$work/$c-index.json" \
    || die "$ref in the registry is not the index that was built"
done
step "push oci://$REGISTRY/lastcall:$version"
"$HELM" push "${helm_http[@]}" "$tgz" "oci://$REGISTRY"
"$HELM" show chart "${helm_http[@]}" "oci://$REGISTRY/lastcall" --version "$version" >"$work/pulled-chart.yaml"
grep -qx "version: $version" "$work/pulled-chart.yaml" || die "oci://$REGISTRY/lastcall $version does not read back"
step "released $version: ${COMPONENTS[*]/#/$REGISTRY/lastcall-} and oci://$REGISTRY/lastcall"
