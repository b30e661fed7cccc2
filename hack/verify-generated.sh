#!/usr/bin/env bash
# Regenerate deepcopy, CRDs and RBAC (and the chart's copies of them) and fail when that changes the tree: generated code must be
# regenerated and committed together with the types and markers it comes from.
set -euo pipefail
cd "$(dirname "$0")/.."
before=$(git status --porcelain --untracked-files=all -- api config charts/imp/files)
make --no-print-directory generate >/dev/null
after=$(git status --porcelain --untracked-files=all -- api config charts/imp/files)
if [[ "$before" != "$after" ]]; then
  echo "verify-generated: generated files are stale; run 'make generate' and commit the result:" >&2
  diff <(echo "$before") <(echo "$after") >&2 || true
  git --no-pager diff --stat -- api config charts/imp/files >&2
  exit 1
fi
echo "verify-generated: deepcopy, CRDs and RBAC are up to date"
