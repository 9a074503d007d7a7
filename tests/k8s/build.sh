#!/usr/bin/env bash
# Builds the pinned Kubernetes binaries (kube-apiserver, kube-controller-manager,
# kube-scheduler, kubectl), etcd, kwok and metrics-server from the Go module proxy, using
# the wrapper modules beside this script. Idempotent: the result is cached under
#   ${TENSILE_K8S_CACHE:-${XDG_CACHE_HOME:-~/.cache}/tensile/k8s}/<versions>-<go.sum hash>/
# and a warm run only checks the stamp. Progress goes to stderr, one line per binary with its
# build time; the last line on stdout is the directory holding bin/ and stages/, which the
# harness reads.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

require_version() { # module-dir module-path
  awk -v m="$2" '$1 == "require" && $2 == m { print $3 } $1 == m && $2 ~ /^v/ { print $2 }' \
    "$here/$1/go.mod" | head -n 1
}

k8s_version=$(require_version kubernetes k8s.io/kubernetes)
etcd_version=$(require_version etcd go.etcd.io/etcd/server/v3)
kwok_version=$(require_version kwok sigs.k8s.io/kwok)
for v in k8s_version etcd_version kwok_version; do
  [ -n "${!v}" ] || { echo "build.sh: cannot read $v from the wrapper go.mod files" >&2; exit 1; }
done

# The key covers every input of the build, so editing a wrapper module rebuilds.
# metrics-server is built into the same directory as an addition with a stamp of its own
# (below), so adding or bumping it does not rebuild the rest.
key=$(cat "$here"/{etcd,kubernetes,kwok}/go.mod "$here"/{etcd,kubernetes,kwok}/go.sum \
  "$here"/{etcd,kubernetes,kwok}/*.go | sha256sum | cut -c1-12)
ms_version=$(require_version metrics-server sigs.k8s.io/metrics-server)
[ -n "$ms_version" ] || { echo "build.sh: cannot read the metrics-server version" >&2; exit 1; }
ms_key=$(cat "$here"/metrics-server/go.mod "$here"/metrics-server/go.sum "$here"/metrics-server/*.go |
  sha256sum | cut -c1-12)
ms_stamp=".metrics-server-$ms_version-$ms_key"
cache_root=${TENSILE_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tensile/k8s}
out="$cache_root/k8s-$k8s_version-etcd-$etcd_version-kwok-$kwok_version-$key"

if [ -f "$out/.complete" ] && [ -f "$out/$ms_stamp" ]; then
  echo "k8s binaries: cached in $out" >&2
  echo "$out"
  exit 0
fi

# Concurrent callers (several test binaries, the playground) wait for one build.
mkdir -p "$cache_root"
exec 9>"$cache_root/.build.lock"
flock 9
if [ -f "$out/.complete" ] && [ -f "$out/$ms_stamp" ]; then
  echo "k8s binaries: built by a concurrent run in $out" >&2
  echo "$out"
  exit 0
fi

command -v go >/dev/null || { echo "build.sh: Go is required to build the Kubernetes binaries (go not on PATH)" >&2; exit 1; }

start=$(date +%s)
export GOFLAGS="${GOFLAGS:-} -mod=mod -trimpath"
export CGO_ENABLED=0

step() { # name, then the command
  local name=$1 t0
  shift
  t0=$(date +%s)
  echo "k8s binaries: building $name ..." >&2
  "$@" >&2
  echo "k8s binaries: built $name in $(($(date +%s) - t0))s" >&2
}

# metrics-server (and kwok's resource-metrics simulation, which ships in kwok's module),
# added to a complete directory.
add_metrics_server() { # dir
  step "metrics-server $ms_version" \
    env -C "$here/metrics-server" go build \
    -ldflags "-s -w -X k8s.io/client-go/pkg/version.gitVersion=$ms_version" \
    -o "$1/bin/metrics-server" sigs.k8s.io/metrics-server/cmd/metrics-server
  local kwok_dir
  kwok_dir=$(env -C "$here/kwok" go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)
  install -m 0644 "$kwok_dir/kustomize/metrics/resource/metrics-resource.yaml" "$1/stages/"
  echo "metrics-server=$ms_version" >>"$1/versions"
  touch "$1/$ms_stamp"
}

if [ -f "$out/.complete" ]; then
  add_metrics_server "$out"
  echo "k8s binaries: metrics-server added in $(($(date +%s) - start))s -> $out" >&2
  echo "$out"
  exit 0
fi

tmp="$out.tmp.$$"
rm -rf "$tmp"
mkdir -p "$tmp/bin" "$tmp/stages"
trap 'rm -rf "$tmp"' EXIT

minor=${k8s_version#v1.}
minor=${minor%%.*}
kver="-X k8s.io/component-base/version.gitVersion=$k8s_version \
 -X k8s.io/component-base/version.gitMajor=1 \
 -X k8s.io/component-base/version.gitMinor=$minor \
 -X k8s.io/component-base/version.gitTreeState=clean \
 -X k8s.io/client-go/pkg/version.gitVersion=$k8s_version \
 -X k8s.io/client-go/pkg/version.gitMajor=1 \
 -X k8s.io/client-go/pkg/version.gitMinor=$minor \
 -X k8s.io/client-go/pkg/version.gitTreeState=clean"

echo "k8s binaries: first build of Kubernetes $k8s_version, etcd, kwok and metrics-server from" \
  "the Go module proxy: about 12 minutes on 2 cores, once (then cached in $out)" >&2
# One `go build` per command, so each says when it is done; they share the Go build cache,
# so the first (kube-apiserver) takes most of the time and the others reuse its packages.
for cmd in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
  step "$cmd $k8s_version" \
    env -C "$here/kubernetes" go build -ldflags "-s -w $kver" -o "$tmp/bin/$cmd" \
    "k8s.io/kubernetes/cmd/$cmd"
done
step "etcd $etcd_version" \
  env -C "$here/etcd" go build -ldflags "-s -w" -o "$tmp/bin/etcd" .
step "kwok $kwok_version" \
  env -C "$here/kwok" go build -ldflags "-s -w" -o "$tmp/bin/kwok" sigs.k8s.io/kwok/cmd/kwok

# kwok only simulates what its Stage objects describe; they ship inside its module.
kwok_dir=$(env -C "$here/kwok" go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)
for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
  pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
  install -m 0644 "$kwok_dir/kustomize/stage/$f" "$tmp/stages/$(basename "$f")"
done

cat >"$tmp/versions" <<EOF
kubernetes=$k8s_version
etcd=$etcd_version
kwok=$kwok_version
EOF
add_metrics_server "$tmp"
touch "$tmp/.complete"
rm -rf "$out"
mv "$tmp" "$out"
trap - EXIT
echo "k8s binaries: done in $(($(date +%s) - start))s -> $out" >&2
echo "$out"
