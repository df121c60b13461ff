#!/usr/bin/env bash
# Builds the EaaS OCI image without a Docker daemon (`make image`, `make image VARIANT=cpu`), runs
# `eaas --help` and `eaas expert-server --help` inside it as its non-root user (65532) with an OCI
# runtime, and reports its size. Same image as the Dockerfile (see there); docs/install.md,
# "Container image".
#
#   image/build.sh cuda|cpu
#
# Needs root (chroot, mounts, an OCI runtime) and Debian's mmdebstrap, umoci and runc (or crun):
#   apt-get install mmdebstrap umoci runc
#
# 1. base layer: Debian 12 (bookworm) made by mmdebstrap from Debian's archive (no image registry):
#    minbase + python3 (3.11), python3-venv, gcc and libc6-dev (Triton compiles its launcher),
#    ca-certificates; user and group eaas, 65532. Cached; EAAS_IMAGE_REFRESH=1 makes it again.
# 2. the project's wheel, and its dependencies with the `nixl` extra (nixl-cu13, for transport nixl)
#    resolved by pip for CPython 3.11 on manylinux x86_64, pinned with their sha256
#    (image/imagetool.py requirements); cpu: torch's CPU build from PyTorch's index
#    (EAAS_IMAGE_TORCH_CPU_INDEX), no nvidia-* or cuda-* wheel. Wheels are downloaded on this
#    machine (its pip configuration, proxy and certificates apply) into the cache.
# 3. app layer: a venv at /opt/eaas installed offline in a chroot from those wheels.
# 4. config: Entrypoint ["eaas"], User 65532:65532, PATH with /opt/eaas/bin.
# 5. check (EAAS_IMAGE_CHECK=0 skips): unpack the image with umoci and run the two --help commands
#    (and `id`, a torch matmul on CPU and a NIXL agent with its UCX backend) with runc as the
#    image's user, read-only root, no capabilities, no network.
#
# Environment: EAAS_IMAGE_CACHE (default ~/.cache/eaas/image: base, wheels, OCI layout, work dirs),
# EAAS_IMAGE_MIRROR / EAAS_IMAGE_SECURITY_MIRROR (Debian archives; default: the ones this machine's
# apt uses; the base is pinned to the release, not to a date), EAAS_IMAGE_TORCH_CPU_INDEX (cpu:
# PyTorch's CPU wheel index or a mirror), EAAS_IMAGE_RUNTIME (runc or crun), PYTHON (runs pip here).
set -euo pipefail

VARIANT=${1:-cuda}
case $VARIANT in cpu | cuda) ;; *) echo "usage: $0 cuda|cpu" >&2; exit 2 ;; esac

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${EAAS_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/eaas/image}
SUITE=bookworm # Debian 12, whose python3 is 3.11: the pin of the base
# The Debian archives this machine's apt uses (deb822 .sources or one-line .list files), unless set.
apt_uri() { # the first URI of an enabled source that lists suite $1
    local file
    for file in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
        [ -r "$file" ] || continue
        case $file in
        *.sources) awk -v suite="$1" 'BEGIN { RS = ""; FS = "\n" } {
                uri = ""; ok = 0
                for (i = 1; i <= NF; i++) {
                    if ($i ~ /^URIs:/) { split($i, a, " "); uri = a[2] }
                    if ($i ~ /^Suites:/) { n = split($i, b, " "); for (j = 2; j <= n; j++) if (b[j] == suite) ok = 1 }
                    if ($i ~ /^Enabled: *no/) ok = 0
                }
                if (ok && uri != "") { print uri; exit }
            }' "$file" ;;
        *) awk -v suite="$1" '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) { if ($(i + 1) == suite) { print $i; exit } } }' "$file" ;;
        esac
    done | head -n 1
}
MIRROR=${EAAS_IMAGE_MIRROR:-$(apt_uri "$SUITE")}
SECURITY_MIRROR=${EAAS_IMAGE_SECURITY_MIRROR:-$(apt_uri "$SUITE-security")}
PACKAGES=python3,python3-venv,gcc,libc6-dev,ca-certificates
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/pyproject.toml")
TAG=$VERSION-$VARIANT
LAYOUT=$CACHE/oci
WORK=$CACHE/work-$VARIANT
PYTHON=${PYTHON:-python3}
# What pip resolves and downloads for: Debian 12's CPython 3.11, glibc 2.36 (pip does not widen
# --platform to older manylinux tags by itself).
TARGET=(--only-binary=:all: --python-version 3.11 --implementation cp --abi cp311)
for glibc in $(seq 36 -1 5); do TARGET+=(--platform "manylinux_2_${glibc}_x86_64"); done
TARGET+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64
    --platform linux_x86_64)
# PyPI's torch for Linux is the CUDA build (it does not import without its nvidia-* wheels): the cpu
# variant takes torch's CPU build (+cpu) from PyTorch's index, next to PyPI.
TORCH_CPU_INDEX=${EAAS_IMAGE_TORCH_CPU_INDEX:-} # PyTorch's CPU wheel index, or a mirror of it
INDEXES=()
[ "$VARIANT" = cuda ] || INDEXES=(--extra-index-url "$TORCH_CPU_INDEX")

log() { printf '\n== %s\n' "$*"; }
die() { echo "image/build.sh: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (mmdebstrap, chroot, mounts and runc)"
[ "$(uname -m)" = x86_64 ] || die "builds linux/amd64 only"
[ -n "$MIRROR" ] && [ -n "$SECURITY_MIRROR" ] \
    || die "no Debian $SUITE archive in this machine's apt sources: set EAAS_IMAGE_MIRROR and EAAS_IMAGE_SECURITY_MIRROR"
[ "$VARIANT" = cuda ] || [ -n "$TORCH_CPU_INDEX" ] \
    || die "the cpu variant needs EAAS_IMAGE_TORCH_CPU_INDEX: the URL of PyTorch's CPU wheel index (or a mirror)"
RUNTIME=${EAAS_IMAGE_RUNTIME:-$(command -v runc || command -v crun || true)}
for tool in mmdebstrap umoci "${RUNTIME:-runc}"; do
    command -v "$tool" > /dev/null || die "$tool missing: apt-get install mmdebstrap umoci runc"
done
mkdir -p "$CACHE/wheels"

# -- 1. base ------------------------------------------------------------------------------------
MMDEBSTRAP=(mmdebstrap --mode=root --format=tar --variant=minbase --include="$PACKAGES"
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*'
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/doc/*'
    --dpkgopt='path-include=/usr/share/doc/*/copyright'
    --customize-hook='chroot "$1" groupadd --gid 65532 eaas'
    --customize-hook='chroot "$1" useradd --uid 65532 --gid 65532 --create-home --shell /bin/sh eaas'
    --customize-hook='rm -f "$1/etc/resolv.conf" "$1/etc/hostname"'
    --customize-hook='chroot "$1" dpkg-query -W > "$1/etc/eaas-base-packages"'
    "$SUITE")
SOURCES=("deb $MIRROR $SUITE main" "deb $MIRROR $SUITE-updates main"
    "deb $SECURITY_MIRROR $SUITE-security main")
BASE=$CACHE/base-$SUITE-$(printf '%s\n' "${MMDEBSTRAP[@]}" "${SOURCES[@]}" | sha256sum | cut -c1-12).tar
if [ ! -s "$BASE" ] || [ "${EAAS_IMAGE_REFRESH:-0}" = 1 ]; then
    log "base: Debian $SUITE from $MIRROR (mmdebstrap)"
    nice -n 10 "${MMDEBSTRAP[@]}" "$BASE.part" "${SOURCES[@]}"
    mv "$BASE.part" "$BASE"
fi

# -- 2. wheels ----------------------------------------------------------------------------------
PIPENV=$CACHE/pip-venv
if [ ! -x "$PIPENV/bin/pip" ]; then
    log "pip for resolving and downloading: $PIPENV"
    "$PYTHON" -m venv "$PIPENV"
    "$PIPENV/bin/pip" install -q --upgrade pip
fi
PIP=(nice -n 10 "$PIPENV/bin/pip")

# A run that was killed may have left its mounts: undo them, and never delete across one.
awk -v w="$WORK/" 'index($2, w) == 1 {print $2}' /proc/mounts | sort -r | xargs -r -n1 umount
rm -rf --one-file-system "$WORK"
mkdir -p "$WORK/src" "$WORK/dist"
log "wheel of $ROOT"
# The Dockerfile's build context: the working tree's sources, as they are.
tar -C "$ROOT" --exclude=__pycache__ --exclude='*.pyc' -cf - pyproject.toml setup.py README.md operator \
    runtime kernels | tar -C "$WORK/src" -xf -
"${PIP[@]}" wheel -q --no-deps --wheel-dir "$WORK/dist" "$WORK/src"
WHEEL=$(ls "$WORK"/dist/eaas-*.whl)

log "dependencies ($VARIANT)"
if [ "$VARIANT" = cpu ] && ! "${PIP[@]}" index versions torch --index-url "$TORCH_CPU_INDEX" --timeout 20 \
    --retries 0 > /dev/null; then
    die "the cpu variant needs torch's CPU build from $TORCH_CPU_INDEX, which cannot be reached"
fi
"${PIP[@]}" install -q --dry-run --ignore-installed --target "$WORK/unused" --report "$WORK/report.json" \
    "${TARGET[@]}" "${INDEXES[@]}" "$WHEEL[nixl]"
"$PYTHON" "$ROOT/image/imagetool.py" requirements --variant "$VARIANT" "$WORK/report.json" \
    > "$WORK/dist/requirements.txt"
"${PIP[@]}" download -q --no-deps "${TARGET[@]}" "${INDEXES[@]}" --dest "$CACHE/wheels" \
    -r "$WORK/dist/requirements.txt"

# -- 3. layers ----------------------------------------------------------------------------------
[ -f "$LAYOUT/index.json" ] || umoci init --layout "$LAYOUT"
umoci rm --image "$LAYOUT:$TAG" 2> /dev/null || true
umoci new --image "$LAYOUT:$TAG"
BUNDLE=$WORK/bundle
umoci unpack --image "$LAYOUT:$TAG" "$BUNDLE"
RFS=$BUNDLE/rootfs

log "layer 1: base"
tar -C "$RFS" -xf "$BASE"
nice -n 10 umoci repack --refresh-bundle --image "$LAYOUT:$TAG" \
    --history.created_by "mmdebstrap --variant=minbase --include=$PACKAGES $SUITE" "$BUNDLE"

log "layer 2: /opt/eaas ($VARIANT)"
MOUNTS=()
cleanup() {
    local m
    for m in "${MOUNTS[@]}"; do umount "$m" 2> /dev/null || true; done
}
trap cleanup EXIT
mkdir -p "$RFS/tmp/wheels" "$RFS/tmp/dist"
mount -t proc proc "$RFS/proc" && MOUNTS+=("$RFS/proc")
mount --bind -o ro "$CACHE/wheels" "$RFS/tmp/wheels" && MOUNTS+=("$RFS/tmp/wheels")
mount --bind -o ro "$WORK/dist" "$RFS/tmp/dist" && MOUNTS+=("$RFS/tmp/dist")
chroot "$RFS" python3 -m venv /opt/eaas
INSTALL=(env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin nice -n 10 /opt/eaas/bin/pip install -q --no-index
    --no-cache-dir --no-deps --find-links /tmp/wheels)
chroot "$RFS" "${INSTALL[@]}" --require-hashes -r /tmp/dist/requirements.txt
chroot "$RFS" "${INSTALL[@]}" "/tmp/dist/$(basename "$WHEEL")"
cp "$WORK/dist/requirements.txt" "$RFS/opt/eaas/requirements.txt"
cleanup
MOUNTS=()
rm -rf --one-file-system "$RFS/tmp/wheels" "$RFS/tmp/dist"
nice -n 10 umoci repack --image "$LAYOUT:$TAG" \
    --history.created_by "python3 -m venv /opt/eaas; pip install eaas $VERSION ($VARIANT)" "$BUNDLE"
rm -rf --one-file-system "$BUNDLE"

umoci config --image "$LAYOUT:$TAG" --no-history \
    --config.user 65532:65532 --config.entrypoint eaas --config.workingdir /home/eaas \
    --config.env PATH=/opt/eaas/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --config.env HOME=/home/eaas \
    --config.label org.opencontainers.image.title=eaas \
    --config.label org.opencontainers.image.version="$VERSION" \
    --config.label io.eaas.variant="$VARIANT" \
    --config.label io.eaas.base="debian:$SUITE"
umoci gc --layout "$LAYOUT"

# -- 4. check -----------------------------------------------------------------------------------
RUNDIR=$WORK/run
run_in_image() {
    "$PYTHON" "$ROOT/image/imagetool.py" runtime-config "$RUNDIR/config.json" -- "$@"
    printf '$ %s\n' "$*"
    "$RUNTIME" run --bundle "$RUNDIR" "eaas-image-check-$$"
}
umoci unpack --image "$LAYOUT:$TAG" "$RUNDIR"
UNPACKED=$(du -sb "$RUNDIR/rootfs" | cut -f1)
if [ "${EAAS_IMAGE_CHECK:-1}" != 0 ]; then
    log "check: in the image, with $(basename "$RUNTIME"), as its user"
    run_in_image id
    [ "$(run_in_image id -u | tail -1)" = 65532 ] || die "the image does not run as 65532"
    run_in_image eaas --help
    run_in_image eaas expert-server --help
    run_in_image python -c 'import torch; a = torch.randn(256, 256); print("torch", torch.__version__,
"cuda available:", torch.cuda.is_available(), "matmul on CPU ok:", torch.allclose(a @ torch.eye(256), a))'
    run_in_image python -c 'from eaas.runtime.transport.nixl_endpoint import Endpoint
print("nixl: UCX backend", "UCX" in Endpoint("check").agent.backends)'
fi
rm -rf --one-file-system "$RUNDIR"

# -- 5. size ------------------------------------------------------------------------------------
SIZE=$("$PYTHON" "$ROOT/image/imagetool.py" size "$LAYOUT" "$TAG")
log "image $LAYOUT:$TAG"
"$PYTHON" - "$SIZE" "$UNPACKED" << 'EOF'
import json, sys
size, unpacked = json.loads(sys.argv[1]), int(sys.argv[2])
mib = lambda n: f"{n / 2**20:,.0f} MiB"
print(f"compressed (gzip, {size['layers']} layers): {mib(size['total_bytes'])}; unpacked: {mib(unpacked)}")
EOF
