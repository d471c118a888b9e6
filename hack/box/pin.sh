#!/usr/bin/env bash
# Regenerates hack/box/<module>/go.mod and go.sum from versions.env. Needs the Go module proxy
# and checksum database; build.sh then builds offline-safe from the committed files.
# The Kubernetes module's staging replacements are read from that release's own go.mod, so
# every k8s.io/<staging> module is pinned to the same release (v1.X.Y -> v0.X.Y).
# Usage: hack/box/pin.sh [kube|etcd|kwok|helm|aemm|actionlint|crds]...   (default: all)
set -euo pipefail
BOX="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
. "$BOX/versions.env"
CACHE="${LASTCALL_BOX_CACHE:-/var/tmp/lastcall-box}"
export GOMODCACHE="${LASTCALL_BOX_GOMODCACHE:-$CACHE/gomodcache}" GOTOOLCHAIN=local GOFLAGS=-modcacherw

fresh() { # module-dir module-path go-version
  cd "$BOX/$1"
  rm -f go.mod go.sum
  go mod init "$2" 2>/dev/null
  go mod edit -go="$3"
}

pin_kube() {
  fresh kube lastcall.box/kube 1.25.0
  go mod edit -godebug=default=go1.25 -require="k8s.io/kubernetes@$KUBE_VERSION"
  local upstream staging
  upstream="$(go mod download -json "k8s.io/kubernetes@$KUBE_VERSION" | sed -n 's/^\t"GoMod": "\(.*\)",$/\1/p')"
  staging="v0.${KUBE_VERSION#v1.}"
  # Every `k8s.io/X => ./staging/src/k8s.io/X` of the release becomes `k8s.io/X => k8s.io/X v0.Y.Z`.
  go mod edit -json "$upstream" \
    | sed -n 's/^.*"Path": "\(k8s\.io\/[^"]*\)".*$/\1/p' \
    | sort -u \
    | while read -r m; do
        if go mod edit -json "$upstream" | grep -q "\"Path\": \"\./staging/src/$m\""; then
          go mod edit -replace="$m=$m@$staging"
        fi
      done
  local c
  for c in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
    go get -tool "k8s.io/kubernetes/cmd/$c@$KUBE_VERSION"
  done
  go mod tidy
}

pin_etcd() {
  fresh etcd lastcall.box/etcd 1.26.0
  go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION"
  go mod tidy
}

pin_kwok() {
  fresh kwok lastcall.box/kwok 1.26.0
  go get -tool "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
  go mod tidy
}

pin_helm() {
  fresh helm lastcall.box/helm 1.26.0
  go get -tool "helm.sh/helm/v4/cmd/helm@$HELM_VERSION"
  go mod tidy
}

# Not built: the box reads Karpenter's and the Prometheus operator's CRD YAML from these
# modules (build.sh), so go.sum pins their content.
pin_crds() {
  fresh crds lastcall.box/crds 1.26.4
  go mod edit -require="sigs.k8s.io/karpenter@$KARPENTER_VERSION" \
    -require="github.com/prometheus-operator/prometheus-operator@$PROMETHEUS_OPERATOR_VERSION"
  go mod download sigs.k8s.io/karpenter github.com/prometheus-operator/prometheus-operator
}

pin_aemm() {
  fresh aemm lastcall.box/aemm 1.23.0
  go get -tool "github.com/aws/amazon-ec2-metadata-mock/cmd/ec2-metadata-mock@$AEMM_VERSION"
  go mod tidy
}

pin_actionlint() {
  fresh actionlint lastcall.box/actionlint 1.25.0
  go get -tool "github.com/rhysd/actionlint/cmd/actionlint@$ACTIONLINT_VERSION"
  go mod tidy
}

mods=("$@")
[ ${#mods[@]} -gt 0 ] || mods=(kube etcd kwok helm aemm actionlint crds)
for m in "${mods[@]}"; do
  echo "== pinning $m" >&2
  "pin_$m"
done
