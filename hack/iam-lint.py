#!/usr/bin/env python3
"""Lints the IAM policies the docs give with parliament (PyPI; in the venv hack/tools.sh
prepares): every `cat > <file>.json <<JSON` heredoc of docs/*.md, its shell variables filled
with sample values, must parse and draw no finding. tests/tests/packaging.rs checks the same
documents against the AWS calls the code makes and against `Resource: "*"`.

Usage: hack/iam-lint.py   (exit 1 on any finding)
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = {"$ACCOUNT": "123456789012", "$REGION": "us-west-2", "$ASG_NAME": "game-nodes"}
HEREDOC = re.compile(r"cat > (\S+\.json) <<'?JSON'?\n(.*?)\nJSON\n", re.S)


def policies() -> list[tuple[str, str, str]]:
    out = []
    for md in sorted((ROOT / "docs").glob("*.md")):
        for name, body in HEREDOC.findall(md.read_text()):
            for var, value in SAMPLES.items():
                body = body.replace(var, value)
            out.append((str(md.relative_to(ROOT)), name, body))
    return out


def main() -> int:
    exe = Path(sys.executable).with_name("parliament")
    found = policies()
    if len(found) < 3:
        print(f"FAIL expected the agent's, pubsub's and the Auto Scaling policy, found {[n for _, n, _ in found]}")
        return 1
    failed = 0
    for doc, name, body in found:
        # The policy as a string: parliament refuses --file when its stdin is not a terminal.
        p = subprocess.run([str(exe), "--string", body], capture_output=True, text=True,
                           stdin=subprocess.DEVNULL)
        out = (p.stdout + p.stderr).strip()
        bad = p.returncode != 0 or bool(out)
        print(f"{'FAIL' if bad else 'ok  '} {doc}: {name}")
        if bad:
            print("     " + out.replace("\n", "\n     "))
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
