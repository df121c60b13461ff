#!/usr/bin/env bash
# Build (once) the binaries of the local Kubernetes test control plane and cache them outside the repo:
#   etcd kube-apiserver kube-controller-manager kube-scheduler kube-proxy kubectl helm kwok coredns
#   prometheus prometheus-adapter (the metrics pipeline of the autoscaling drills)
# and KEDA's ScaledObject CRD (keda-crds/, from the module source; KEDA itself is not built), and
# the Gateway API Inference Extension's InferencePool CRD (inference-crds/, likewise).
# into ${EAAS_CACHE_DIR:-~/.cache/eaas}/k8s-<version>/bin (or $EAAS_K8S_BIN_DIR).
#
# Everything comes from the Go module proxy; no Docker, no downloads of prebuilt binaries.
# Idempotent: a binary whose version stamp matches is not rebuilt. Safe to run concurrently (flock).
#
# Usage: e2e/bin/build-k8s.sh [--print-bin-dir] [--force]
# Environment: EAAS_CACHE_DIR, EAAS_K8S_BIN_DIR, EAAS_K8S_VERSION, EAAS_ETCD_VERSION, EAAS_HELM_VERSION,
#              EAAS_KWOK_VERSION, EAAS_COREDNS_VERSION, EAAS_PROMETHEUS_VERSION, EAAS_PROMETHEUS_ADAPTER_VERSION,
#              EAAS_KEDA_VERSION, EAAS_INFERENCE_EXTENSION_VERSION
#              (defaults in e2e/versions.env), EAAS_GO_BUILD_JOBS (default: nproc),
#              GOSUMDB / GOPROXY / GOFLAGS as usual for Go.
set -Eeuo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# Defaults from e2e/versions.env; an environment variable of the same name wins.
while IFS='=' read -r key value; do
    [[ -z "$key" || "$key" == \#* ]] && continue
    [[ -n "${!key:-}" ]] || printf -v "$key" '%s' "$value"
done <"$here/../versions.env"

cache_dir=${EAAS_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/eaas}
bin_dir=${EAAS_K8S_BIN_DIR:-$cache_dir/k8s-$EAAS_K8S_VERSION/bin}
work_dir=$cache_dir/build
log_dir=$work_dir/logs
jobs=${EAAS_GO_BUILD_JOBS:-$(nproc)}
force=0

for arg in "$@"; do
    case "$arg" in
        --print-bin-dir) echo "$bin_dir"; exit 0 ;;
        --force) force=1 ;;
        -h | --help) sed -n '2,13p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "build-k8s.sh: unknown argument $arg" >&2; exit 2 ;;
    esac
done

command -v go >/dev/null || { echo "build-k8s.sh: 'go' not found on PATH (Go >= 1.26 is needed)" >&2; exit 1; }
mkdir -p "$bin_dir" "$log_dir"

# Never let `go` fetch another toolchain; the wrapper modules may update their own go.mod/go.sum.
export GOTOOLCHAIN=local CGO_ENABLED=0
export GOFLAGS="${GOFLAGS:+$GOFLAGS }-mod=mod -buildvcs=false"

current_step=""
current_log=""
on_error() {
    local rc=$?
    # With `set -E` the trap also fires in command substitutions: report once, from the main shell.
    [[ $BASHPID == "$$" ]] || exit "$rc"
    {
        echo
        echo "build-k8s.sh: FAILED at step '$current_step' (exit $rc)."
        if [[ -n "$current_log" && -f "$current_log" ]]; then
            echo "--- last lines of $current_log ---"
            tail -n 25 "$current_log"
            echo "---"
        fi
        echo "Retry with:  make k8s-bins   (or: e2e/bin/build-k8s.sh)"
        echo "Finished binaries are kept; only what is missing is rebuilt."
        echo "If the checksum database cannot be reached, retry with GOSUMDB=off;"
        echo "if the module proxy is unreachable, check GOPROXY (now: $(go env GOPROXY))."
    } >&2
    exit "$rc"
}
trap on_error ERR

# Serialize concurrent builds (two `make test` at once share the cache).
exec 9>"$cache_dir/.build.lock"
flock 9

is_built() { # is_built NAME VERSION: binary present and stamped with VERSION
    [[ $force == 0 && -x "$bin_dir/$1" && "$(cat "$bin_dir/.$1.version" 2>/dev/null)" == "$2" ]]
}

stamp() { # stamp VERSION NAME...
    local version=$1 name
    shift
    for name in "$@"; do echo "$version" >"$bin_dir/.$name.version"; done
}

run_logged() { # run_logged STEP CMD...: run with output in a per-step log
    current_step=$1
    shift
    current_log="$log_dir/$current_step.log"
    echo "  [$current_step] $*" >>"$current_log"
    "$@" >>"$current_log" 2>&1
}

fresh_module() { # fresh_module DIR NAME: an empty throwaway wrapper module
    rm -rf "$1"
    mkdir -p "$1"
    (cd "$1" && go mod init "$2" >/dev/null 2>&1)
}

install_outputs() { # install_outputs OUTDIR NAME...: atomic move into the bin dir
    local out=$1 name
    shift
    for name in "$@"; do
        mv -f "$out/$name" "$bin_dir/$name.tmp"
        mv -f "$bin_dir/$name.tmp" "$bin_dir/$name"
    done
}

build_kubernetes() {
    local v=$EAAS_K8S_VERSION cmds=(kube-apiserver kube-controller-manager kube-scheduler kube-proxy kubectl)
    local missing=0 c
    for c in "${cmds[@]}"; do is_built "$c" "v$v" || missing=1; done
    ((missing)) || { echo "kubernetes v$v: cached"; return 0; }
    echo "kubernetes v$v: building ${cmds[*]} (the slow one: ~8-15 min on 2 idle cores)..."
    local start=$SECONDS mod=$work_dir/kubernetes-$v
    rm -f "$log_dir/kubernetes.log"
    fresh_module "$mod" local/eaas-k8s-build
    cd "$mod"
    # k8s.io/kubernetes requires its staging modules at v0.0.0 and replaces them with ./staging paths,
    # so it cannot be `go install`ed: replace each staging module listed in the release's own go.mod
    # by the published v0.<minor>.<patch>.
    current_step=kubernetes-staging
    current_log=$log_dir/kubernetes.log
    local info gomod staging minor=${v#*.}
    if ! info=$(go mod download -json "k8s.io/kubernetes@v$v" 2>&1); then
        echo "$info" >>"$current_log"
        false
    fi
    gomod=$(sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p' <<<"$info")
    staging=$(awk '$2 == "=>" && $3 ~ /^\.\/staging\// {print $1}' "$gomod")
    echo "staging modules of k8s.io/kubernetes v$v:" $staging >>"$current_log"
    [[ -n "$staging" ]]
    for m in $staging; do go mod edit "-replace=$m=$m@v0.$minor"; done
    run_logged kubernetes go get $(for c in "${cmds[@]}"; do echo "k8s.io/kubernetes/cmd/$c@v$v"; done)
    # Without these, /version reports v0.0.0-master and helm/kwok pick wrong behaviour.
    local ld="-s -w" p
    for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        ld+=" -X $p.gitVersion=v$v -X $p.gitMajor=${v%%.*} -X $p.gitMinor=${minor%%.*}"
        ld+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
    done
    mkdir -p out
    # One invocation so the packages shared by the commands compile once.
    run_logged kubernetes go build -p "$jobs" -trimpath -ldflags "$ld" -o out/ \
        $(for c in "${cmds[@]}"; do echo "k8s.io/kubernetes/cmd/$c"; done)
    install_outputs out "${cmds[@]}"
    stamp "v$v" "${cmds[@]}"
    cd - >/dev/null
    echo "kubernetes v$v: built in $((SECONDS - start)) s"
}

go_install() { # go_install NAME PACKAGE VERSION [LDFLAG...]: plain `go install` into the bin dir
    # Build tags come from $GO_TAGS (empty: none).
    local name=$1 pkg=$2 v=$3 tags=${GO_TAGS:-}
    shift 3
    # The stamp holds the extra ldflags and tags too: changing one of them (e.g. the Kubernetes version
    # that helm is stamped with) rebuilds the binary.
    local version_stamp="v$v${*:+ $*}${tags:+ tags=$tags}"
    is_built "$name" "$version_stamp" && { echo "$name v$v: cached"; return 0; }
    echo "$name v$v: building..."
    local start=$SECONDS out=$work_dir/$name-$v
    rm -rf "$out" "$log_dir/$name.log"
    mkdir -p "$out"
    GOBIN=$out run_logged "$name" go install -p "$jobs" -trimpath ${tags:+-tags "$tags"} \
        -ldflags "-s -w${*:+ $*}" "$pkg@v$v"
    install_outputs "$out" "$name"
    stamp "$version_stamp" "$name"
    echo "$name v$v: built in $((SECONDS - start)) s"
}

go_build_wrapped() { # go_build_wrapped NAME PACKAGE MODULE VERSION: `go build` in a throwaway module
    local name=$1 pkg=$2 module=$3 v=$4
    is_built "$name" "v$v" && { echo "$name v$v: cached"; return 0; }
    echo "$name v$v: building..."
    local start=$SECONDS mod=$work_dir/$name-$v
    rm -f "$log_dir/$name.log"
    fresh_module "$mod" "local/eaas-$name-build"
    cd "$mod"
    run_logged "$name" go get "$module@v$v"
    mkdir -p out
    run_logged "$name" go build -p "$jobs" -trimpath -ldflags "-s -w" -o "out/$name" "$pkg"
    install_outputs out "$name"
    stamp "v$v" "$name"
    cd - >/dev/null
    echo "$name v$v: built in $((SECONDS - start)) s"
}

helm_ldflags() { # the -X flags of helm: its version, and the Kubernetes version it assumes offline
    local k8s_major=${EAAS_K8S_VERSION%%.*} k8s_minor=${EAAS_K8S_VERSION#*.} p
    k8s_minor=${k8s_minor%%.*}
    echo "-X helm.sh/helm/v3/internal/version.version=v$EAAS_HELM_VERSION"
    # Without a cluster (`helm template`, `helm lint`, `--dry-run=client`) helm checks a chart's
    # `kubeVersion` and `.Capabilities.KubeVersion` against a compiled-in default (v1.20.0 unless set;
    # helm's own release build sets it from its client-go). Use the Kubernetes we build instead.
    for p in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
        echo "-X $p.k8sVersionMajor=$k8s_major -X $p.k8sVersionMinor=$k8s_minor"
    done
}

total_start=$SECONDS
echo "Kubernetes test binaries -> $bin_dir"
# etcd's server/go.mod has replace directives, so `go install` refuses it; its main package is the
# module root (server/main.go).
go_build_wrapped etcd go.etcd.io/etcd/server/v3 go.etcd.io/etcd/server/v3 "$EAAS_ETCD_VERSION"
build_kubernetes
go_install helm helm.sh/helm/v3/cmd/helm "$EAAS_HELM_VERSION" $(helm_ldflags)
go_install kwok sigs.k8s.io/kwok/cmd/kwok "$EAAS_KWOK_VERSION"
# DNS for the process-runner nodes (Services and headless pod names inside pods).
go_install coredns github.com/coredns/coredns "$EAAS_COREDNS_VERSION"
# The metrics pipeline of the autoscaling drills: Prometheus (module v0.3MM.P is Prometheus 3.MM.P)
# with only file, HTTP and Kubernetes service discovery, and prometheus-adapter serving custom.metrics.k8s.io.
prometheus_module_version() { local minor=${EAAS_PROMETHEUS_VERSION#*.}; echo "0.${EAAS_PROMETHEUS_VERSION%%.*}$(printf %02d "${minor%%.*}").${minor#*.}"; }
prom_ld=""
for p in github.com/prometheus/common/version; do
    prom_ld+="-X $p.Version=$EAAS_PROMETHEUS_VERSION -X $p.Branch=release -X $p.Revision=module-v$(prometheus_module_version)"
done
GO_TAGS=remove_all_sd,enable_kubernetes_sd go_install prometheus github.com/prometheus/prometheus/cmd/prometheus \
    "$(prometheus_module_version)" $prom_ld
# `go install …@version` asks the proxy for the module's deprecation (its version list), which it
# refuses for prometheus-adapter: build it in a wrapper module from the exact version instead.
go_build_wrapped prometheus-adapter sigs.k8s.io/prometheus-adapter/cmd/adapter \
    sigs.k8s.io/prometheus-adapter "$EAAS_PROMETHEUS_ADAPTER_VERSION"
# CRDs of projects that are not built here, taken from their module's source so that manifests for
# them are validated by the API server: KEDA (its operator pulls every scaler's SDK, far beyond the
# CI budget) and the Gateway API Inference Extension.
# fetch_crds DIR MODULE VERSION FILE: config/crd/bases/FILE of MODULE@vVERSION into $bin_dir/DIR.
fetch_crds() {
    local name=$1 module=$2 v=$3 file=$4 out=$bin_dir/$1 info dir
    [[ $force == 0 && "$(cat "$out/.version" 2>/dev/null)" == "v$v" ]] && { echo "$name v$v: cached"; return 0; }
    current_step=$name
    current_log=$log_dir/$name.log
    if ! info=$(cd "$work_dir" && go mod download -json "$module@v$v" 2>&1); then
        echo "$info" >>"$current_log"
        false
    fi
    dir=$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p' <<<"$info")
    mkdir -p "$out"
    cp "$dir/config/crd/bases/$file" "$out/"
    chmod u+w "$out"/*.yaml
    echo "v$v" >"$out/.version"
    echo "$name v$v: fetched"
}
fetch_crds keda-crds github.com/kedacore/keda/v2 "$EAAS_KEDA_VERSION" keda.sh_scaledobjects.yaml
fetch_crds inference-crds sigs.k8s.io/gateway-api-inference-extension "$EAAS_INFERENCE_EXTENSION_VERSION" \
    inference.networking.k8s.io_inferencepools.yaml
current_step=verify
for name in etcd kube-apiserver kube-controller-manager kube-scheduler kube-proxy kubectl helm kwok coredns \
    prometheus prometheus-adapter; do
    [[ -x "$bin_dir/$name" ]]
done
echo "All Kubernetes test binaries ready in $bin_dir ($((SECONDS - total_start)) s)"
