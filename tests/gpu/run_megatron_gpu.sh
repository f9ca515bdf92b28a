#!/usr/bin/env bash
# Megatron GPU checks on a machine with torch + transformers but no megatron-core/mbridge.
# Installs the pinned wheels from .whl/ into /tmp/site (never touching torch), runs
# tests/gpu/test_megatron_gpu.py, prints PASS/FAIL per test and, when $OUT is set, writes
# $OUT/megatron_gpu.json. Run from the repository root:
#   bash tests/gpu/run_megatron_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
SITE=/tmp/site
python3 -m pip install --quiet --no-index --no-deps --target "$SITE" \
    .whl/megatron_core-0.16.1-*.whl .whl/mbridge-0.15.1-*.whl .whl/einops-*.whl || exit 1
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1
python3 -c "import megatron.core, mbridge, torch; print('megatron-core', megatron.core.__version__, 'torch', torch.__version__, 'gpus', torch.cuda.device_count())"
REPORT=$(mktemp -d)/junit.xml
python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_megatron_gpu.py --junitxml="$REPORT" -W ignore
STATUS=$?
python3 - "$REPORT" "$STATUS" <<'PY'
import json, os, sys, xml.etree.ElementTree as ET
report, status = sys.argv[1], int(sys.argv[2])
cases = []
for case in ET.parse(report).getroot().iter("testcase"):
    outcome, detail = "PASS", ""
    for tag, name in (("failure", "FAIL"), ("error", "FAIL"), ("skipped", "SKIP")):
        node = case.find(tag)
        if node is not None:
            outcome, detail = name, (node.get("message") or "")[:500]
    cases.append({"test": case.get("name"), "outcome": outcome,
                  "seconds": float(case.get("time", 0)), "detail": detail})
    print(f"{outcome}: {case.get('name')} ({float(case.get('time', 0)):.1f} s) {detail[:200]}")
summary = {"pytest_exit_status": status, "tests": cases,
           "passed": sum(c["outcome"] == "PASS" for c in cases),
           "failed": sum(c["outcome"] == "FAIL" for c in cases),
           "skipped": sum(c["outcome"] == "SKIP" for c in cases)}
print(f"SUMMARY: {summary['passed']} passed, {summary['failed']} failed, {summary['skipped']} skipped")
if os.environ.get("OUT"):
    path = os.path.join(os.environ["OUT"], "megatron_gpu.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=2)
    print(f"wrote {path}")
PY
exit $STATUS
