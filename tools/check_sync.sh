#!/usr/bin/env bash
# Fails when nbdev_export or nbdev_clean would change anything: the notebooks are the
# source, oelm_nb/ is generated from them, and both must be committed in sync.
set -euo pipefail
cd "$(dirname "$0")/.."
snapshot() { find nbs oelm_nb -type f \( -name '*.ipynb' -o -name '*.py' \) -not -path '*/.ipynb_checkpoints/*' -not -path '*/__pycache__/*' -print0 | sort -z | xargs -0 md5sum; }
before=$(snapshot)
nbdev_export
nbdev_clean
after=$(snapshot)
if [ "$before" != "$after" ]; then
  echo "[sync-check] FAILED: nbdev_export/nbdev_clean changed these files:" >&2
  diff <(echo "$before") <(echo "$after") | grep '^[<>]' | awk '{print "    " $3}' | sort -u >&2
  echo "  The notebooks and oelm_nb/ were out of sync. Review 'git diff', then commit the result." >&2
  exit 1
fi
echo "[sync-check] notebooks are clean and oelm_nb/ is in sync with them"
