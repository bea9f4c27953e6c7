#!/usr/bin/env bash
# The official openai npm client for tests/serve_openai_test.sh, into
# tools/openai-client/node_modules (ignored). Without npm it says so and stops
# with status 0 (the test then skips); a failing install is an error.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if ! command -v npm >/dev/null 2>&1; then
  echo "openai-client: npm is not installed; serve_openai_client_test will skip" >&2
  exit 0
fi
[[ -d $here/node_modules/openai ]] && exit 0
(cd "$here" && npm install --no-audit --no-fund --silent)
echo "openai-client: installed the openai npm client in $here" >&2
