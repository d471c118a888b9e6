#!/usr/bin/env bash
# Builds the box: real Kubernetes control-plane binaries (and their companions) from the Go
# modules pinned in hack/box/*/go.mod + go.sum, into a cache outside the clone:
#   ${LASTCALL_BOX_CACHE:-/var/tmp/lastcall-box}/<key>/bin/
# <key> hashes everything that decides the binaries (this script, versions.env, every module's
# go.mod, go.sum and .go files, the Go version), so a pin change builds a new directory and an
# old one is never half-updated. A complete directory is reused at once.
#
# Prints the bin dir as the last line of stdout; progress goes to stderr.
# Safe to start twice at once: one build per key runs under flock, the other waits and reuses.
# The build happens in a temp dir renamed into place, so an interrupted build never looks done.
#
# Environment:
#   LASTCALL_BOX_CACHE      cache root (default /var/tmp/lastcall-box)
#   LASTCALL_BOX_GOCACHE    Go build cache (default $LASTCALL_BOX_CACHE/gocache)
#   LASTCALL_BOX_GOMODCACHE Go module cache (default $LASTCALL_BOX_CACHE/gomodcache)
set -euo pipefail

BOX="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
. "$BOX/versions.env"
CACHE="${LASTCALL_BOX_CACHE:-/var/tmp/lastcall-box}"
BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok helm ec2-metadata-mock actionlint)

export GOTOOLCHAIN=local
command -v go >/dev/null 2>&1 || { echo "build.sh: go is not on PATH" >&2; exit 1; }
command -v flock >/dev/null 2>&1 || { echo "build.sh: flock (util-linux) is not on PATH" >&2; exit 1; }

key="$(
  cd "$BOX"
  {
    go version
    find . -type f \( -name go.mod -o -name go.sum -o -name '*.go' -o -name versions.env -o -name build.sh \) \
      -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
  } | sha256sum | cut -c1-16
)"
dest="$CACHE/$key"

complete() {
  local b
  [ -f "$dest/versions.txt" ] && [ -f "$dest/share/kwok-stages.yaml" ] || return 1
  [ -f "$dest/share/crds/karpenter.sh_nodepools.yaml" ] || return 1
  for b in "${BINARIES[@]}"; do [ -x "$dest/bin/$b" ] || return 1; done
}

if complete; then
  echo "box: $dest is complete" >&2
  echo "$dest/bin"
  exit 0
fi

mkdir -p "$CACHE"
exec 9>"$CACHE/$key.lock"
if ! flock -n 9; then
  echo "box: another build of $key is running; waiting for it" >&2
  flock 9
fi
if complete; then
  echo "box: $dest was completed by another build" >&2
  echo "$dest/bin"
  exit 0
fi

# We hold the lock: leftovers of interrupted builds of this key are ours to remove.
rm -rf "$CACHE/.$key.tmp."* "$dest"
tmp="$(mktemp -d "$CACHE/.$key.tmp.XXXXXX")"
chmod 755 "$tmp"
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/bin"

export GOCACHE="${LASTCALL_BOX_GOCACHE:-$CACHE/gocache}"
export GOMODCACHE="${LASTCALL_BOX_GOMODCACHE:-$CACHE/gomodcache}"
# go.sum is committed: every download is checked against it, and -mod=readonly refuses any
# change to go.mod/go.sum, so the checksum database is never needed for a build.
export GOFLAGS="-mod=readonly -modcacherw -buildvcs=false"
export CGO_ENABLED=0
GO=(nice -n 10 go)

# The release time the module proxy records for a version (reproducible build dates).
release_time() { # module version
  local info time
  info="$("${GO[@]}" mod download -json "$1@$2" | sed -n 's/^\t"Info": "\(.*\)",*$/\1/p')"
  time="$(sed -n 's/.*"Time":"\([^"]*\)".*/\1/p' "$info")"
  [ -n "$time" ] || { echo "box: no release time for $1@$2 in ${info:-go mod download}" >&2; exit 1; }
  echo "$time"
}

check_pin() { # module-dir module version
  local got
  got="$(cd "$BOX/$1" && go list -m -f '{{if .Replace}}{{.Replace.Version}}{{else}}{{.Version}}{{end}}' "$2")"
  if [ "$got" != "$3" ]; then
    echo "box: $1/go.mod pins $2 $got but versions.env says $3; run hack/box/pin.sh $1" >&2
    exit 1
  fi
}

started=$SECONDS
step() { echo "box: [$((SECONDS - started))s] $*" >&2; }

# --- Kubernetes: kube-apiserver, kube-controller-manager, kube-scheduler, kubectl -------------
check_pin kube k8s.io/kubernetes "$KUBE_VERSION"
check_pin kube k8s.io/component-base "v0.${KUBE_VERSION#v1.}"
kube_minor="${KUBE_VERSION#v1.}"
kube_minor="${kube_minor%%.*}"
kube_date="$(release_time k8s.io/kubernetes "$KUBE_VERSION")"
kube_ldflags="-s -w"
# No commit is known for a module zip: like a `git archive` export, the tree state is
# "archive" and gitCommit keeps its placeholder.
for pkg in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
  kube_ldflags+=" -X $pkg.gitVersion=$KUBE_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$kube_minor"
  kube_ldflags+=" -X $pkg.gitTreeState=archive -X $pkg.buildDate=$kube_date"
done
step "building Kubernetes $KUBE_VERSION (kube-apiserver, kube-controller-manager, kube-scheduler, kubectl)"
(cd "$BOX/kube" && "${GO[@]}" build -trimpath -tags selinux,notest,grpcnotrace -ldflags "$kube_ldflags" \
  -o "$tmp/bin/" k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl)

# --- etcd ---------------------------------------------------------------------------------------
check_pin etcd go.etcd.io/etcd/server/v3 "$ETCD_VERSION"
check_pin etcd go.etcd.io/etcd/api/v3 "$ETCD_VERSION"
step "building etcd $ETCD_VERSION"
(cd "$BOX/etcd" && "${GO[@]}" build -trimpath -ldflags "-s -w" -o "$tmp/bin/etcd" .)

# --- kwok ---------------------------------------------------------------------------------------
check_pin kwok sigs.k8s.io/kwok "$KWOK_VERSION"
step "building kwok $KWOK_VERSION"
# The kwok binary simulates nothing without Stage objects. Its release's "fast" set (node
# initialize, heartbeat with lease, pod ready/complete/delete) is read from the pinned module and
# written beside the binaries, for `kwok --config "$bin/../share/kwok-stages.yaml"`.
kwok_dir="$(cd "$BOX/kwok" && "${GO[@]}" mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" | sed -n 's/^\t"Dir": "\(.*\)",*$/\1/p')"
mkdir -p "$tmp/share"
for stage in node/fast/node-initialize node/heartbeat-with-lease/node-heartbeat-with-lease \
  pod/fast/pod-ready pod/fast/pod-complete pod/fast/pod-delete; do
  echo "---"
  cat "$kwok_dir/kustomize/stage/$stage.yaml"
done >"$tmp/share/kwok-stages.yaml"
(cd "$BOX/kwok" && "${GO[@]}" build -trimpath -ldflags "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION" \
  -o "$tmp/bin/kwok" sigs.k8s.io/kwok/cmd/kwok)

# --- helm ---------------------------------------------------------------------------------------
check_pin helm helm.sh/helm/v4 "$HELM_VERSION"
# Helm 4 derives its default capabilities (the Kubernetes version `helm template` assumes) from
# the client-go module in its build info, so only the version and tree state are stamped.
helm_ldflags="-s -w -X helm.sh/helm/v4/internal/version.version=$HELM_VERSION"
helm_ldflags+=" -X helm.sh/helm/v4/internal/version.gitTreeState=clean -X helm.sh/helm/v4/internal/version.metadata="
step "building helm $HELM_VERSION"
(cd "$BOX/helm" && "${GO[@]}" build -trimpath -ldflags "$helm_ldflags" -o "$tmp/bin/helm" helm.sh/helm/v4/cmd/helm)

# --- amazon-ec2-metadata-mock ------------------------------------------------------------------
check_pin aemm github.com/aws/amazon-ec2-metadata-mock "$AEMM_VERSION"
step "building ec2-metadata-mock $AEMM_VERSION"
(cd "$BOX/aemm" && "${GO[@]}" build -trimpath -ldflags "-s -w" \
  -o "$tmp/bin/ec2-metadata-mock" github.com/aws/amazon-ec2-metadata-mock/cmd/ec2-metadata-mock)

# --- actionlint (the release workflow's linter; .ci/run) ---------------------------------------
check_pin actionlint github.com/rhysd/actionlint "$ACTIONLINT_VERSION"
step "building actionlint $ACTIONLINT_VERSION"
(cd "$BOX/actionlint" && "${GO[@]}" build -trimpath -ldflags "-s -w -X github.com/rhysd/actionlint.version=$ACTIONLINT_VERSION" \
  -o "$tmp/bin/actionlint" github.com/rhysd/actionlint/cmd/actionlint)
# --- CRDs the docs install next to lastcall ----------------------------------------------------
# Karpenter's NodePool/NodeClaim and the Prometheus operator's monitors and rules, from their
# own modules at the pinned versions (go.sum checks the content), into share/crds/.
check_pin crds sigs.k8s.io/karpenter "$KARPENTER_VERSION"
check_pin crds github.com/prometheus-operator/prometheus-operator "$PROMETHEUS_OPERATOR_VERSION"
step "copying CRDs: Karpenter $KARPENTER_VERSION, Prometheus operator $PROMETHEUS_OPERATOR_VERSION"
mkdir -p "$tmp/share/crds"
crd_dir() { (cd "$BOX/crds" && "${GO[@]}" mod download -json "$1" | sed -n 's/^\t"Dir": "\(.*\)",*$/\1/p'); }
karpenter_dir="$(crd_dir sigs.k8s.io/karpenter)"
promop_dir="$(crd_dir github.com/prometheus-operator/prometheus-operator)"
for f in karpenter.sh_nodepools.yaml karpenter.sh_nodeclaims.yaml; do
  cp "$karpenter_dir/pkg/apis/crds/$f" "$tmp/share/crds/$f"
done
for f in servicemonitors podmonitors prometheusrules; do
  cp "$promop_dir/example/prometheus-operator-crd/monitoring.coreos.com_$f.yaml" "$tmp/share/crds/"
done

cat >"$tmp/versions.txt" <<EOF
etcd $ETCD_VERSION
kube-apiserver $KUBE_VERSION
kube-controller-manager $KUBE_VERSION
kube-scheduler $KUBE_VERSION
kubectl $KUBE_VERSION
kwok $KWOK_VERSION
helm $HELM_VERSION
ec2-metadata-mock $AEMM_VERSION
actionlint $ACTIONLINT_VERSION
karpenter-crds $KARPENTER_VERSION
prometheus-operator-crds $PROMETHEUS_OPERATOR_VERSION
go $(go env GOVERSION)
EOF

mv -T "$tmp" "$dest"
trap - EXIT
step "done: $dest"
echo "$dest/bin"
