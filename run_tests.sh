#!/usr/bin/env bash
# Run the test suite; sets up the environment on first use (see tools/bootstrap.sh).
set -euo pipefail
cd "$(dirname "$0")"
source tools/bootstrap.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec python -m pytest -q "$@"
