#!/usr/bin/env bash
# Regenerates every generated document:
#   - docs/configuration.md from both binaries' --help (the packaging test writes it when
#     LASTCALL_BLESS is set, and otherwise fails when it differs);
#   - charts/lastcall/README.md's values table and manifests/ from the chart.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/lastcall-target}"
LASTCALL_BLESS=1 cargo test -q -p lastcall-testkit --test packaging configuration_md
VENV_BIN="$(hack/tools.sh)"
"$VENV_BIN/python" hack/chart.py readme
"$VENV_BIN/python" hack/chart.py manifests
git status --short docs/configuration.md charts/lastcall/README.md manifests
