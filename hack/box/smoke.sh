#!/usr/bin/env bash
# Starts a whole control plane from the box on 127.0.0.1 and checks it works:
#   etcd -> kube-apiserver (client-cert auth, RBAC, default admission plugins, service-account
#   issuer and keys) -> kube-controller-manager (per-controller service-account credentials),
#   kube-scheduler and kwok (fake kubelet for nodes annotated kwok.x-k8s.io/node=fake).
# Then: /version answers the pinned release, a Node created with kubectl turns Ready, a Pod is
# scheduled onto it and Running, a Deployment's pods run, its PodDisruptionBudget is computed
# and refuses an eviction, and deleting the Deployment lets the garbage collector remove the
# rest. Every wait polls readiness with a deadline; everything started is stopped and the work
# dir removed at exit (LASTCALL_BOX_KEEP=1 keeps it).
#
# The flags here are the reference for the Rust Cluster harness: they are known to work with
# the pinned release.
#
# Usage: hack/box/smoke.sh [BIN_DIR]    (default: the bin dir printed by hack/box/build.sh)
set -euo pipefail

BOX="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
. "$BOX/versions.env"
BIN="${1:-$("$BOX/build.sh" | tail -n 1)}"
SHARE="$BIN/../share"
for b in etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok; do
  [ -x "$BIN/$b" ] || { echo "smoke: $BIN/$b is missing; run hack/box/build.sh" >&2; exit 1; }
done
for tool in openssl curl python3; do
  command -v "$tool" >/dev/null 2>&1 || { echo "smoke: $tool is not on PATH" >&2; exit 1; }
done

WORK="$(mktemp -d "${TMPDIR:-/tmp}/lastcall-box-smoke.XXXXXX")"
PIDS=()
NAMES=()
started_ms=$(($(date +%s%N) / 1000000))
say() { # with the time since the start, for the start-up figures in docs/benchmarks.md
  local ms=$(($(date +%s%N) / 1000000 - started_ms))
  printf 'smoke: [%d.%01ds] %s\n' $((ms / 1000)) $((ms % 1000 / 100)) "$*" >&2
}

cleanup() {
  local rc=$? i deadline
  # Reverse start order, each one gone before the next: the API server's shutdown still talks
  # to etcd, and the controllers' to the API server.
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
    kill -TERM "${PIDS[$i]}" 2>/dev/null || true
    # Bounded: a process still alive after 10 s is killed.
    deadline=$((SECONDS + 10))
    while kill -0 "${PIDS[$i]}" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.1; done
    if kill -0 "${PIDS[$i]}" 2>/dev/null; then
      echo "smoke: ${NAMES[$i]} ignored SIGTERM for 10 s; SIGKILL" >&2
      kill -KILL "${PIDS[$i]}" 2>/dev/null || true
    fi
    wait "${PIDS[$i]}" 2>/dev/null || true
  done
  if [ $rc -ne 0 ]; then
    for i in "${!NAMES[@]}"; do
      echo "---- last lines of ${NAMES[$i]}.log" >&2
      tail -n 25 "$WORK/${NAMES[$i]}.log" >&2 || true
    done
  fi
  if [ "${LASTCALL_BOX_KEEP:-0}" = 1 ]; then
    echo "smoke: kept $WORK" >&2
  else
    rm -rf "$WORK"
  fi
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

start() { # name command...
  local name=$1
  shift
  "$@" >"$WORK/$name.log" 2>&1 &
  PIDS+=($!)
  NAMES+=("$name")
}

# Polls "$@" every 0.2 s until it succeeds; fails after $1 seconds, or at once when a started
# process has died (its log is printed by cleanup).
wait_for() { # seconds description command...
  local limit=$1 what=$2 deadline i
  shift 2
  deadline=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    for i in "${!PIDS[@]}"; do
      if ! kill -0 "${PIDS[$i]}" 2>/dev/null; then
        echo "smoke: ${NAMES[$i]} exited while waiting for $what" >&2
        return 1
      fi
    done
    if [ $SECONDS -ge $deadline ]; then
      echo "smoke: timed out after ${limit}s waiting for $what" >&2
      return 1
    fi
    sleep 0.2
  done
  say "$what"
}

# Sets the variable named $1 to a port that binds now, below the ephemeral range (32768-60999
# on Linux): a port the kernel hands out for binding can be taken, before the server binds it,
# by one of the many outgoing connections the control plane opens (a scheduler once lost its
# port that way).
PORTS_TAKEN=" "
pick_port() { # variable-name
  local port tries=0
  while :; do
    port=$((20000 + RANDOM % 12000))
    tries=$((tries + 1))
    [ $tries -le 200 ] || { echo "smoke: no free port in 20000-31999 on 127.0.0.1" >&2; return 1; }
    case "$PORTS_TAKEN" in *" $port "*) continue ;; esac
    python3 -c 'import socket, sys; socket.socket().bind(("127.0.0.1", int(sys.argv[1])))' "$port" \
      2>/dev/null || continue
    break
  done
  PORTS_TAKEN+="$port "
  printf -v "$1" '%s' "$port"
}

# --- credentials -------------------------------------------------------------------------------
pki="$WORK/pki"
mkdir -p "$pki"
ossl() { openssl "$@" 2>>"$WORK/openssl.log"; }
ossl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
  -keyout "$pki/ca.key" -out "$pki/ca.crt" -subj "/CN=lastcall-box-ca"
issue() { # name subject [subjectAltName]
  ossl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$pki/$1.key" -out "$pki/$1.csr" -subj "$2"
  local ext="$pki/$1.ext"
  if [ -n "${3:-}" ]; then
    printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth\n' "$3" >"$ext"
  else
    printf 'extendedKeyUsage=clientAuth\n' >"$ext"
  fi
  ossl x509 -req -in "$pki/$1.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
    -days 2 -extfile "$ext" -out "$pki/$1.crt"
}
# One serving certificate for the API server, controller-manager and scheduler (all loopback).
issue serving "/CN=lastcall-box-serving" \
  "IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,IP:10.96.0.1"
issue admin "/O=system:masters/CN=lastcall-box-admin"
# The API server's front proxy (aggregation layer) identity, under its own CA, so the
# controller-manager's and scheduler's delegated authentication finds a request-header CA.
ossl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
  -keyout "$pki/front-proxy-ca.key" -out "$pki/front-proxy-ca.crt" -subj "/CN=lastcall-box-front-proxy-ca"
ossl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
  -keyout "$pki/front-proxy-client.key" -out "$pki/front-proxy-client.csr" -subj "/CN=front-proxy-client"
printf 'extendedKeyUsage=clientAuth\n' >"$pki/front-proxy-client.ext"
ossl x509 -req -in "$pki/front-proxy-client.csr" -CA "$pki/front-proxy-ca.crt" \
  -CAkey "$pki/front-proxy-ca.key" -CAcreateserial -days 2 -extfile "$pki/front-proxy-client.ext" \
  -out "$pki/front-proxy-client.crt"
issue controller-manager "/CN=system:kube-controller-manager"
issue scheduler "/CN=system:kube-scheduler"
# kwok writes any node's and pod's status; a system:masters member with its own user name.
issue kwok "/O=system:masters/CN=kwok"
# Service-account token signing key (RS256).
ossl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$pki/sa.key"
ossl pkey -in "$pki/sa.key" -pubout -out "$pki/sa.pub"

for var in ETCD_PORT ETCD_PEER_PORT API_PORT CM_PORT SCHED_PORT KWOK_PORT; do pick_port "$var"; done

kubeconfig() { # name
  cat >"$WORK/$1.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: box
  cluster:
    server: https://127.0.0.1:$API_PORT
    certificate-authority: $pki/ca.crt
users:
- name: $1
  user:
    client-certificate: $pki/$1.crt
    client-key: $pki/$1.key
contexts:
- name: box
  context: {cluster: box, user: $1}
current-context: box
EOF
}
for who in admin controller-manager scheduler kwok; do kubeconfig "$who"; done
export KUBECONFIG="$WORK/admin.kubeconfig"
kc() { "$BIN/kubectl" --request-timeout=10s "$@"; }
say "certificates and kubeconfigs in $WORK"

# --- etcd --------------------------------------------------------------------------------------
start etcd "$BIN/etcd" \
  --name=box \
  --data-dir="$WORK/etcd" \
  --listen-client-urls="http://127.0.0.1:$ETCD_PORT" \
  --advertise-client-urls="http://127.0.0.1:$ETCD_PORT" \
  --listen-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-advertise-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-cluster="box=http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-cluster-state=new \
  --unsafe-no-fsync \
  --log-level=warn
wait_for 30 "etcd ready on 127.0.0.1:$ETCD_PORT" curl -fsS "http://127.0.0.1:$ETCD_PORT/readyz"

# --- kube-apiserver ----------------------------------------------------------------------------
start kube-apiserver "$BIN/kube-apiserver" \
  --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
  --bind-address=127.0.0.1 \
  --advertise-address=127.0.0.1 \
  --secure-port="$API_PORT" \
  --tls-cert-file="$pki/serving.crt" \
  --tls-private-key-file="$pki/serving.key" \
  --client-ca-file="$pki/ca.crt" \
  --authorization-mode=Node,RBAC \
  --service-account-issuer=https://kubernetes.default.svc.cluster.local \
  --service-account-key-file="$pki/sa.pub" \
  --service-account-signing-key-file="$pki/sa.key" \
  --service-cluster-ip-range=10.96.0.0/16 \
  --requestheader-client-ca-file="$pki/front-proxy-ca.crt" \
  --requestheader-allowed-names=front-proxy-client \
  --requestheader-username-headers=X-Remote-User \
  --requestheader-group-headers=X-Remote-Group \
  --requestheader-extra-headers-prefix=X-Remote-Extra- \
  --proxy-client-cert-file="$pki/front-proxy-client.crt" \
  --proxy-client-key-file="$pki/front-proxy-client.key" \
  --allow-privileged=true
wait_for 90 "kube-apiserver ready on 127.0.0.1:$API_PORT" \
  curl -fsS --cacert "$pki/ca.crt" --cert "$pki/admin.crt" --key "$pki/admin.key" \
  "https://127.0.0.1:$API_PORT/readyz"

version="$(kc get --raw /version)"
served="$(echo "$version" | python3 -c 'import json, sys; print(json.load(sys.stdin)["gitVersion"])')"
[ "$served" = "$KUBE_VERSION" ] || { echo "smoke: /version is not $KUBE_VERSION: $version" >&2; exit 1; }
client="$(kc version --client)"
case "$client" in
  *"Client Version: $KUBE_VERSION"*) ;;
  *) echo "smoke: kubectl version --client is not $KUBE_VERSION: $client" >&2; exit 1 ;;
esac
say "/version and kubectl answer $KUBE_VERSION"

# --- kube-controller-manager, kube-scheduler -------------------------------------------------
# Default controller set ("*"): garbage collector, disruption, serviceaccount, serviceaccount-token
# (it needs --service-account-private-key-file), deployment, replicaset, node lifecycle, ...
start kube-controller-manager "$BIN/kube-controller-manager" \
  --kubeconfig="$WORK/controller-manager.kubeconfig" \
  --authentication-kubeconfig="$WORK/controller-manager.kubeconfig" \
  --authorization-kubeconfig="$WORK/controller-manager.kubeconfig" \
  --bind-address=127.0.0.1 \
  --secure-port="$CM_PORT" \
  --tls-cert-file="$pki/serving.crt" \
  --tls-private-key-file="$pki/serving.key" \
  --client-ca-file="$pki/ca.crt" \
  --controllers='*' \
  --use-service-account-credentials=true \
  --service-account-private-key-file="$pki/sa.key" \
  --root-ca-file="$pki/ca.crt" \
  --cluster-signing-cert-file="$pki/ca.crt" \
  --cluster-signing-key-file="$pki/ca.key" \
  --leader-elect=false
start kube-scheduler "$BIN/kube-scheduler" \
  --kubeconfig="$WORK/scheduler.kubeconfig" \
  --authentication-kubeconfig="$WORK/scheduler.kubeconfig" \
  --authorization-kubeconfig="$WORK/scheduler.kubeconfig" \
  --bind-address=127.0.0.1 \
  --secure-port="$SCHED_PORT" \
  --tls-cert-file="$pki/serving.crt" \
  --tls-private-key-file="$pki/serving.key" \
  --client-ca-file="$pki/ca.crt" \
  --leader-elect=false

# --- kwok: the kubelet of nodes annotated kwok.x-k8s.io/node=fake ------------------------------
# `--manage-all-nodes=true` instead of the two selector flags makes it take every Node (also
# checked with this script). Without --config stages kwok refuses to start.
start kwok "$BIN/kwok" \
  --kubeconfig="$WORK/kwok.kubeconfig" \
  --config="$SHARE/kwok-stages.yaml" \
  --manage-all-nodes=false \
  --manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake \
  --node-lease-duration-seconds=40 \
  --cidr=10.244.0.0/16 \
  --node-ip=127.0.0.1 \
  --server-address="127.0.0.1:$KWOK_PORT"

wait_for 60 "kube-controller-manager healthy on 127.0.0.1:$CM_PORT" \
  curl -fsS --cacert "$pki/ca.crt" "https://127.0.0.1:$CM_PORT/healthz"
wait_for 60 "kube-scheduler healthy on 127.0.0.1:$SCHED_PORT" \
  curl -fsS --cacert "$pki/ca.crt" "https://127.0.0.1:$SCHED_PORT/healthz"
wait_for 60 "kwok healthy on 127.0.0.1:$KWOK_PORT" curl -fsS "http://127.0.0.1:$KWOK_PORT/healthz"

# --- a node, a pod ------------------------------------------------------------------------------
kc apply -f - >/dev/null <<'EOF'
apiVersion: v1
kind: Node
metadata:
  name: box-node-1
  annotations:
    kwok.x-k8s.io/node: fake
  labels:
    kubernetes.io/hostname: box-node-1
    type: kwok
EOF
jsonpath_is() { # expected kubectl-args...
  local want=$1
  shift
  [ "$(kc "$@")" = "$want" ]
}
wait_for 60 "node box-node-1 Ready (kwok)" \
  jsonpath_is True get node box-node-1 -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}'

wait_for 60 "namespace default has its default ServiceAccount (serviceaccount controller)" \
  kc -n default get serviceaccount default

kc apply -f - >/dev/null <<'EOF'
apiVersion: v1
kind: Pod
metadata:
  name: box-pod-1
  namespace: default
spec:
  containers:
  - name: main
    image: registry.k8s.io/pause:3.10
EOF
wait_for 60 "pod box-pod-1 scheduled onto box-node-1" \
  jsonpath_is box-node-1 -n default get pod box-pod-1 -o 'jsonpath={.spec.nodeName}'
wait_for 60 "pod box-pod-1 Running (kwok)" \
  jsonpath_is Running -n default get pod box-pod-1 -o 'jsonpath={.status.phase}'

# --- controllers: deployment -> replicaset -> pods; disruption; garbage collector --------------
kc apply -f - >/dev/null <<'EOF'
apiVersion: apps/v1
kind: Deployment
metadata:
  name: box-web
  namespace: default
spec:
  replicas: 2
  selector:
    matchLabels: {app: box-web}
  template:
    metadata:
      labels: {app: box-web}
    spec:
      containers:
      - name: main
        image: registry.k8s.io/pause:3.10
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: box-web
  namespace: default
spec:
  minAvailable: 2
  selector:
    matchLabels: {app: box-web}
EOF
wait_for 90 "deployment box-web: 2 ready replicas" \
  jsonpath_is 2 -n default get deployment box-web -o 'jsonpath={.status.readyReplicas}'
wait_for 60 "PDB box-web: currentHealthy 2, disruptionsAllowed 0 (disruption controller)" \
  jsonpath_is "2/0" -n default get pdb box-web -o 'jsonpath={.status.currentHealthy}/{.status.disruptionsAllowed}'

victim="$(kc -n default get pods -l app=box-web -o 'jsonpath={.items[0].metadata.name}')"
evict_code="$(curl -sS -o "$WORK/eviction.json" -w '%{http_code}' \
  --cacert "$pki/ca.crt" --cert "$pki/admin.crt" --key "$pki/admin.key" \
  -H 'Content-Type: application/json' -X POST \
  --data "{\"apiVersion\":\"policy/v1\",\"kind\":\"Eviction\",\"metadata\":{\"name\":\"$victim\",\"namespace\":\"default\"}}" \
  "https://127.0.0.1:$API_PORT/api/v1/namespaces/default/pods/$victim/eviction")"
[ "$evict_code" = 429 ] || { echo "smoke: eviction of $victim answered $evict_code, want 429: $(cat "$WORK/eviction.json")" >&2; exit 1; }
say "eviction of $victim refused with 429 by the PDB"

rs="$(kc -n default get rs -l app=box-web -o 'jsonpath={.items[0].metadata.name}')"
kc -n default delete deployment box-web --cascade=background --wait=false >/dev/null
gc_done() { # A list that succeeds and is empty: the API server answered and nothing is left.
  local left
  left="$(kc -n default get rs --field-selector "metadata.name=$rs" -o name)" && [ -z "$left" ] \
    && left="$(kc -n default get pods -l app=box-web -o name)" && [ -z "$left" ]
}
wait_for 60 "garbage collector removed replicaset $rs and the pods of box-web" gc_done

say "all checks passed"
