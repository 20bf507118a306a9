#!/usr/bin/env bash
# CI tier `slurm`: bring a real local Slurm up (tools/slurm_local.sh), run the `slurm`-marked tests,
# and ALWAYS bring Slurm down again (only the daemons started here, by PID). Exit: pytest's status;
# "no tests collected" (5) counts as a failure. Extra arguments go to pytest. CI_PYTHON: the
# interpreter to test with (.ci/run passes its fresh venv's; default: `python` on PATH); the job's
# trainer runs with the same one (the test hands its sys.executable to the launcher as PYTHON).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${CI_PYTHON:-python}
echo "::: slurm tier: python $("$PY" -c 'import sys; print(sys.executable)')"

t_start=$SECONDS
# shellcheck disable=SC2317  # called by the EXIT trap
down() {
  local t0=$SECONDS
  bash tools/slurm_local.sh down || echo "slurm_tier: tools/slurm_local.sh down failed" >&2
  echo "::: slurm tier: down in $((SECONDS - t0)) s (whole tier $((SECONDS - t_start)) s)"
}
trap down EXIT

t0=$SECONDS
bash tools/slurm_local.sh up
echo "::: slurm tier: up in $((SECONDS - t0)) s"

t0=$SECONDS
set +e
DAPO_REQUIRE_SLURM=1 "$PY" -m pytest -m slurm -q "$@"  # a Slurm that is not reachable fails, not skips
rc=$?
set -e
echo "::: slurm tier: tests in $((SECONDS - t0)) s (pytest exit $rc)"
if [ "$rc" -eq 5 ]; then
  echo "slurm_tier: pytest collected no slurm tests (exit 5): that is a failure" >&2
  exit 1
fi
exit "$rc"
