#!/usr/bin/env bash
# Builds what the harness's real node needs (tests/harness/src/real_node.rs), nothing
# installed into the system and nothing pulled from a container registry:
#   - kubelet of the pinned Kubernetes release, from the Go module proxy (the wrapper module
#     in ./kubelet pins the same k8s.io/kubernetes as ../kubernetes);
#   - containerd (with its runc shim and ctr), runc, the CNI plugins (bridge, host-local,
#     loopback) and busybox-static: Debian's packages, fetched with `apt-get download`
#     (into a private apt state, so the system's package lists are not touched) and
#     unpacked with `dpkg -x`;
#   - two images, made here as docker-archive tarballs for `ctr images import`:
#     tensile.local/pause:1 (./pause, a static Go program: the sandbox image) and
#     tensile.local/busybox:1.35.0 (busybox-static and its applet links).
# Idempotent: the result is cached under
#   ${TENSILE_K8S_CACHE:-${XDG_CACHE_HOME:-~/.cache}/tensile/k8s}/real-node-<k8s>-<hash>/
# and a warm run only checks the stamp. Progress goes to stderr; the last line on stdout is
# the directory (bin/, cni/, images/, versions), which the harness reads.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
log_prefix="real node"
# shellcheck source=../lib.sh
. "$here/../lib.sh"
packages=(containerd runc containernetworking-plugins busybox-static)
k8s_version=$(awk '$1 == "require" && $2 == "k8s.io/kubernetes" { print $3 }' "$here/kubelet/go.mod")
[ -n "$k8s_version" ] || { echo "real-node/build.sh: cannot read the kubelet version" >&2; exit 1; }
key=$( (cat "$here/build.sh" "$here/../lib.sh" "$here"/kubelet/go.{mod,sum} "$here"/kubelet/*.go "$here"/pause/go.mod \
  "$here"/pause/*.go; echo "${packages[*]}") | sha256sum | cut -c1-12)
cache_root=$(k8s_cache_root)
out="$cache_root/real-node-$k8s_version-$key"

if [ -f "$out/.complete" ]; then
  echo "real node: cached in $out" >&2
  echo "$out"
  exit 0
fi
mkdir -p "$cache_root"
exec 9>"$cache_root/.build-real-node.lock"
flock 9
if [ -f "$out/.complete" ]; then
  echo "real node: built by a concurrent run in $out" >&2
  echo "$out"
  exit 0
fi
for tool in go apt-get dpkg; do
  command -v "$tool" >/dev/null || { echo "real-node/build.sh: $tool is required (not on PATH)" >&2; exit 1; }
done

start=$(date +%s)
tmp="$out.tmp.$$"
rm -rf "$tmp"
mkdir -p "$tmp/bin" "$tmp/cni" "$tmp/images" "$tmp/work"
trap 'rm -rf "$tmp"' EXIT
export GOFLAGS="${GOFLAGS:-} -mod=mod -trimpath"
export CGO_ENABLED=0

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
step "building kubelet $k8s_version" \
  env -C "$here/kubelet" go build -ldflags "-s -w $kver" -o "$tmp/bin/kubelet" k8s.io/kubernetes/cmd/kubelet
step "building the sandbox program (pause)" \
  env -C "$here/pause" go build -ldflags "-s -w" -o "$tmp/work/pause" .

# Debian's packages, downloaded with a private apt state (../lib.sh).
root="$tmp/work/root"
apt_fetch_unpack "$tmp/work" "$root" "$tmp/work/deb-versions" "${packages[@]}"
install -m 0755 "$root"/usr/bin/{containerd,containerd-shim-runc-v2,ctr} "$root/usr/sbin/runc" "$tmp/bin/"
install -m 0755 "$root"/usr/lib/cni/{bridge,host-local,loopback} "$tmp/cni/"
# runc links libseccomp (Debian's runc is built with seccomp); everything else is static or
# needs only libc.
if ldd "$tmp/bin/runc" | grep -q 'not found'; then
  echo "real-node/build.sh: runc needs a library this system lacks:" >&2
  ldd "$tmp/bin/runc" >&2
  echo "(install Debian's libseccomp2)" >&2
  exit 1
fi

pause_root="$tmp/work/pause-root"
mkdir -p "$pause_root"
install -m 0755 "$tmp/work/pause" "$pause_root/pause"
make_image "$pause_root" tensile.local/pause:1 '["/pause"]' "$tmp/images/pause.tar"
busybox_root="$tmp/work/busybox-root"
busybox_rootfs "$root/bin/busybox" "$busybox_root"
busybox_version=$(awk -F= '$1 == "busybox-static" { print $2 }' "$tmp/work/deb-versions")
make_image "$busybox_root" tensile.local/busybox:1.35.0 '["/bin/sh"]' "$tmp/images/busybox.tar"

{
  echo "kubelet=$k8s_version"
  cat "$tmp/work/deb-versions"
  echo "pause-image=tensile.local/pause:1"
  echo "busybox-image=tensile.local/busybox:1.35.0 (busybox-static $busybox_version)"
} >"$tmp/versions"
rm -rf "$tmp/work"
touch "$tmp/.complete"
rm -rf "$out"
mv "$tmp" "$out"
trap - EXIT
echo "real node: done in $(($(date +%s) - start))s -> $out" >&2
echo "$out"
