#!/usr/bin/env bash
# Build (once) the venv of the tools that tests/tools/ runs against `eaas serve` (GuideLLM,
# lm-evaluation-harness, AIPerf; pinned in requirements.txt and constraints.txt next to this script)
# and cache it outside the repository:
#   ${EAAS_CACHE_DIR:-~/.cache/eaas}/tools-<key>/   key: the two pin files, the project's Python and
#                                                    the path of the project's site-packages
# The venv sees the project's .venv packages after its own (a .pth file), so torch, transformers and
# the rest the project already has are not downloaded again; only what the tools add is installed.
#
# Prints the venv's directory on its last line of stdout. Idempotent (a complete venv is reused),
# safe to run concurrently (flock). Exits non-zero, with the end of pip's log, when the install fails.
#
# Usage: tests/tools/build-venv.sh [--print-dir] [--force]
# Environment: EAAS_CACHE_DIR, EAAS_PROJECT_PYTHON (default: .venv/bin/python of the repository).
set -Eeuo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
project_python=${EAAS_PROJECT_PYTHON:-$root/.venv/bin/python}
cache_dir=${EAAS_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/eaas}
print_dir=0
force=0

for arg in "$@"; do
    case "$arg" in
        --print-dir) print_dir=1 ;;
        --force) force=1 ;;
        -h | --help) sed -n '2,14p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "build-venv.sh: unknown argument $arg (allowed: --print-dir, --force)" >&2; exit 2 ;;
    esac
done

[[ -x "$project_python" ]] || {
    echo "build-venv.sh: no project Python at $project_python (run \`make install\` first)" >&2
    exit 1
}
site_packages=$("$project_python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
python_version=$("$project_python" -c "import sys; print(sys.version.split()[0])")
key=$(cat "$here/requirements.txt" "$here/constraints.txt" <(echo "$python_version $site_packages") \
    | sha256sum | cut -c1-12)
venv=$cache_dir/tools-$key
if ((print_dir)); then echo "$venv"; exit 0; fi

mkdir -p "$cache_dir"
exec 9>"$cache_dir/tools.lock"
flock 9
if ((force == 0)) && [[ -f "$venv/.complete" ]]; then
    echo "$venv"
    exit 0
fi

log=$cache_dir/tools-$key.log
rm -rf "$venv"
started=$SECONDS
echo "build-venv.sh: installing the tools into $venv (log: $log) ..." >&2
if ! {
    "$project_python" -m venv "$venv" &&
        venv_site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") &&
        echo "$site_packages" >"$venv_site/zz-eaas-project.pth" &&
        "$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar off \
            -r "$here/requirements.txt" -c "$here/constraints.txt" &&
        "$venv/bin/guidellm" --version && "$venv/bin/lm-eval" --help >/dev/null && "$venv/bin/aiperf" --version
} >"$log" 2>&1; then
    echo "build-venv.sh: FAILED to install the tools; the last lines of $log:" >&2
    tail -n 40 "$log" >&2
    rm -rf "$venv"
    exit 1
fi
touch "$venv/.complete"
echo "build-venv.sh: the tools are installed in $((SECONDS - started)) s" >&2
echo "$venv"
