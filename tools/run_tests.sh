#!/usr/bin/env bash
# Fresh virtual environment, install the pinned versions (constraints-cpu.txt), the SGLang
# serving environment (tools/sglang_env.sh), the wheel installed non-editable and used from
# outside the checkout (tools/wheel_check.sh; WHEEL_CHECK=0 skips it), lint, run the whole test
# suite (the real SGLang server tier included).
# Usage: bash tools/run_tests.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
# the SGLang serving environment (its own venv, constraints-sglang.txt) for the real-server tier,
# built in the background while the trainer's environment installs and the suite starts: made
# from nothing it is the slowest install (≈ 5 min, ≈ 3 min more than the trainer's), and only
# the tests under tests/sglang_server need it; their session fixture waits for its exit status
# ($P3O_SGLANG_ENV_RC) and fails with this log if it failed.
mkdir -p .cache
# bg_env NAME: run tools/NAME.sh in the background in its own process group (setsid), so that a
# failed run stops pip inside it too; its output in .cache/NAME.log and its exit status written
# to .cache/NAME.rc atomically (a reader sees all of it or none); sets bg_pid
bg_env() {
  rm -f ".cache/$1.rc"
  setsid -w bash -c 'bash "tools/$1.sh"; rc=$?; echo $rc > "$2.tmp"; mv "$2.tmp" "$2"; exit $rc' \
    _ "$1" "$PWD/.cache/$1.rc" > ".cache/$1.log" 2>&1 &
  bg_pid=$!
}
bg_env sglang_env
sglang_pid=$bg_pid sglang_log=.cache/sglang_env.log sglang_rc=$PWD/.cache/sglang_env.rc
# the OpenEnv server environment (tools/openenv_env.sh, ≈ 1 min) the same way: only
# tests/e2e/test_openenv.py needs it; its fixture waits for $P3O_OPENENV_ENV_RC
bg_env openenv_env
openenv_pid=$bg_pid openenv_log=.cache/openenv_env.log openenv_rc=$PWD/.cache/openenv_env.rc
# the wheel (non-editable, its own venv) beside them: also mostly pip's disk I/O
wheel_log=.cache/wheel_check.log
wheel_pid=
if [[ ${WHEEL_CHECK:-1} != 0 ]]; then
  setsid -w bash tools/wheel_check.sh > "$wheel_log" 2>&1 &
  wheel_pid=$!
fi
trap 'kill -- -"$sglang_pid" 2> /dev/null || true; kill -- -"$openenv_pid" 2> /dev/null || true; [[ -z $wheel_pid ]] || kill -- -"$wheel_pid" 2> /dev/null || true' EXIT
[[ -x $VENV/bin/python ]] || python3 -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q -c constraints-cpu.txt -e ".[dev,tasks]"
if [[ -n $wheel_pid ]]; then
  wheel_ok=0
  wait "$wheel_pid" || wheel_ok=$?
  grep -v "^WARNING: Location" "$wheel_log"
  if ((wheel_ok != 0)); then
    echo "run_tests: tools/wheel_check.sh failed (log above, also in $wheel_log)" >&2
    exit 1
  fi
fi
SGLANG_PYTHON=$(realpath -m "${SGLANG_VENV:-.venv-sglang}")/bin/python
P3O_SGLANG_ENV_RC=$sglang_rc
P3O_SGLANG_ENV_LOG=$PWD/$sglang_log
P3O_OPENENV_ENV_RC=$openenv_rc
P3O_OPENENV_ENV_LOG=$PWD/$openenv_log
export SGLANG_PYTHON P3O_SGLANG_ENV_RC P3O_SGLANG_ENV_LOG P3O_OPENENV_ENV_RC P3O_OPENENV_ENV_LOG
# SGLang's pinned release, read as text (never imported) by tests/unit/test_sglang_protocol.py
SGLANG_PIN=$(sed -n 's/.*"sglang==\([0-9.]*\)".*/\1/p' setup.py | head -1)
if ! ls .cache/sglang/sglang-"$SGLANG_PIN"-*.whl > /dev/null 2>&1; then
  python -m pip download -q --no-deps --only-binary=:all: "sglang==$SGLANG_PIN" -d .cache/sglang \
    || echo "warning: sglang $SGLANG_PIN wheel not fetched; the protocol test will be skipped"
fi
# lint and format (ruff.toml): a failure here stops the run before the slow suite
ruff check .
ruff format --check .
start=$(date +%s)
set +e
# the test files on P3O_TEST_WORKERS processes (pytest-xdist, whole files per worker so that
# each file's fixtures are built once): the suite mostly waits on launched processes (SGLang
# servers, torchrun ranks), ~57% of 2 cores when run serially. P3O_TEST_WORKERS=0: one process.
# Files are handed out in the order tests/conftest.py gives them (long tiers first, everything
# that needs the SGLang environment after the e2e tier), not xdist's default (most tests per
# file first: the unit files, some of which would wait for that environment).
python -m pytest -q --durations=15 -n "${P3O_TEST_WORKERS:-2}" --dist loadfile \
  --no-loadscope-reorder "$@"
rc=$?
set -e
echo "test suite wall time: $(( $(date +%s) - start ))s"
# the SGLang environment's own outcome (its tests already failed if it failed; a run of a subset
# that needed no server still reports a broken environment)
sglang_ok=0
wait "$sglang_pid" || sglang_ok=$?
trap - EXIT
if ((sglang_ok != 0)); then
  tail -30 "$sglang_log" >&2
  echo "run_tests: tools/sglang_env.sh failed (log above, also in $sglang_log)" >&2
  exit 1
fi
grep -v "^WARNING: Location" "$sglang_log" | tail -3
openenv_ok=0
wait "$openenv_pid" || openenv_ok=$?
if ((openenv_ok != 0)); then
  tail -30 "$openenv_log" >&2
  echo "run_tests: tools/openenv_env.sh failed (log above, also in $openenv_log)" >&2
  exit 1
fi
# pytest exit 5 = no tests collected: treat as failure, a suite that runs nothing proves nothing.
exit $rc
