#!/usr/bin/env bash
# Install the repo's wheels as a user gets them, in a fresh virtual environment,
# and use them there: no editable install, no checkout on sys.path.
#
#   tests/wheels/run.sh [--variant full|xla] [--wheel FILE.whl]... [--run FILE.py]...
#
# --variant full (default): every wheel in dist/ (core, each backend, the
#   conformance suite); checks `attn-backends list`, one attention call
#   against jax.nn.dot_product_attention (one_call.py),
#   `attn-backends check reference --quick`, and
#   every tests/wheels/check_*.py (add a check for this install there, and
#   any extra it needs to full_extras below).
# --variant xla: `attn-backends[xla,cli]` only (core + xla_native + the CLI, no reference,
#   no suite); checks `list` and one call served by xla_native.
# --wheel FILE.whl: also install this wheel (say, a third-party backend a
#   test built); repeatable.
# --run FILE.py: after the checks, run this script with the venv's python
#   (cwd: a scratch folder; env WHEELS_DIST is dist/, WHEELS_VARIANT the
#   variant); repeatable. A failing script fails the run.
#
# dist/ must hold the wheels (`make dist`). PyPI provides only third-party
# dependencies (jax, numpy, pluggy, pytest), at requirements/main.txt's versions.
# PYTHON picks the interpreter (Python 3.12: the lock's).
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
dist="$repo/dist"
python="${PYTHON:-python3}"
variant=full
# Extras of attn-backends the full install adds (comma-separated): a
# tests/wheels/check_*.py that needs a PyPI package (flax: "flax") names it here.
full_extras="flax"
extra_wheels=()
scripts=()
while [ $# -gt 0 ]; do
    case "$1" in
        --variant) variant="$2"; shift 2 ;;
        --wheel) extra_wheels+=("$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"); shift 2 ;;
        --run) scripts+=("$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"); shift 2 ;;
        *) echo "tests/wheels/run.sh: unknown argument '$1'; expected --variant full|xla," \
                "--wheel FILE.whl or --run FILE.py" >&2; exit 2 ;;
    esac
done
case "$variant" in full|xla) ;; *)
    echo "tests/wheels/run.sh: --variant must be full or xla, got '$variant'" >&2; exit 2 ;;
esac
shopt -s nullglob
wheels=("$dist"/*.whl)
if [ ${#wheels[@]} -eq 0 ]; then
    echo "tests/wheels/run.sh: no wheels in $dist; run 'make dist' first" >&2; exit 2
fi
wheel_of() {  # the wheel file of a distribution (its name with _ as in wheel names)
    local found=("$dist/$1"-*.whl)
    [ ${#found[@]} -eq 1 ] || { echo "tests/wheels/run.sh: expected one $1 wheel in $dist," \
        "found ${#found[@]}" >&2; exit 2; }
    echo "${found[0]}"
}

scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
start=$SECONDS
"$python" -m venv "$scratch/venv"
py="$scratch/venv/bin/python"
cli="$scratch/venv/bin/attn-backends"
# Nothing of the checkout may leak in: no PYTHONPATH, a scratch cwd and cache,
# and only the environment variables of attn-backends that the check sets.
unset PYTHONPATH ATTN_BACKENDS_ONLY ATTN_BACKENDS_DISABLE ATTN_BACKENDS_NO_AUTOLOAD \
    ATTN_BACKENDS_STRICT ATTN_BACKENDS_PALLAS_INTERPRET
export ATTN_BACKENDS_CACHE_DIR="$scratch/cache" JAX_PLATFORMS=cpu
export WHEELS_DIST="$dist" WHEELS_VARIANT="$variant"
cd "$scratch"

# Third-party packages at the versions of the default environment's lock (the
# wheels' own ranges allow them), so this run installs what make test tested.
pip_install=("$py" -m pip install -q --no-compile --find-links "$dist"
             --constraint "$repo/requirements/main.txt")
if [ "$variant" = full ]; then
    core="$(wheel_of attn_backends)"
    others=()
    for wheel in "${wheels[@]}"; do [ "$wheel" = "$core" ] || others+=("$wheel"); done
    [ -z "$full_extras" ] || core="$core[$full_extras]"
    "${pip_install[@]}" "$core" "${others[@]}" ${extra_wheels[@]+"${extra_wheels[@]}"}
    expected="reference xla_native"
else
    # The extra must name the backend's distribution: pip finds it in dist/.
    "${pip_install[@]}" "$(wheel_of attn_backends)[xla,cli]" \
        ${extra_wheels[@]+"${extra_wheels[@]}"}
    expected="xla_native"
fi
echo "wheels ($variant): venv and install in $((SECONDS - start)) s"

# Installed from the wheels, not editable, not from the checkout.
"$py" "$here/installed.py" "$repo" "$variant"

"$cli" list
"$cli" list --json > list.json
"$py" - "$expected" <<'EOF'
import json, sys
listed = {r["backend"] for r in json.load(open("list.json"))["backends"]}
missing = set(sys.argv[1].split()) - listed
assert not missing, f"attn-backends list: expected {sys.argv[1]}, missing {sorted(missing)}"
EOF
"$py" "$here/one_call.py" "$variant"
if [ "$variant" = full ]; then
    "$cli" check reference --quick
    for check in "$here"/check_*.py; do
        echo "wheels ($variant): $(basename "$check")"
        "$py" "$check"
    done
fi
for script in ${scripts[@]+"${scripts[@]}"}; do
    echo "wheels ($variant): --run $script"
    "$py" "$script"
done
echo "wheels ($variant): passed in $((SECONDS - start)) s"
