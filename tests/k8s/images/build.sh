#!/usr/bin/env bash
# Builds tensile's four container images, the ones the Dockerfile describes, without docker
# and without a container registry, as docker-archive tarballs that a node's containerd
# imports (`ctr -n k8s.io images import`):
#   tensile/virtual-node:<tag>                (EXPOSE 10250 10255)
#   tensile/tensile-webhook:<tag>             (EXPOSE 8443)
#   tensile/tensile-descheduler:<tag>         (EXPOSE 10258)
#   tensile/tensile-scheduler-extender:<tag>  (EXPOSE 8888)
# Each is what `docker build --target <binary>` makes on gcr.io/distroless/cc-debian12:nonroot:
# the binary at /usr/local/bin/<binary> (its ENTRYPOINT), glibc and libgcc_s, the CA
# certificates (/etc/ssl/certs/ca-certificates.crt), no shell and no other program, the users
# root, nobody and nonroot (65532, home /home/nonroot), /tmp 1777, USER 65532:65532 (numeric,
# so the kubelet's runAsNonRoot check can verify it), WorkingDir /home/nonroot and the Env
# (PATH, SSL_CERT_FILE) of the distroless base. The Debian packages (libc6, libgcc-s1,
# ca-certificates) come from this system's apt sources, fetched with a private apt state and
# unpacked with `dpkg -x` (../lib.sh); no maintainer script runs, so the certificate bundle is
# assembled here as update-ca-certificates would. The release they come from is written to
# /etc/os-release (VERSION_ID), as distroless does. tests/images.rs reads the Dockerfile and
# these images and fails when they drift apart (entrypoint, ports, user, base).
#
# The images are made with ../lib.sh's make_image_config (one layer, the format the e2e
# images use), not with buildah or an OCI crate: buildah from scratch needs its storage set
# up and a dozen more packages, and the layer is one `tar` call either way.
#
# The binaries are the ones cargo already built for --profile (default dist, what the
# Dockerfile ships) in ${CARGO_TARGET_DIR:-target}/<profile> (dev: target/debug). CI and
# the tests use --profile dev, the binaries the test build made: the dist profile's fat LTO
# takes ~8 minutes a binary on two cores. --build builds them first (`cargo build --profile
# <p> --workspace --bin ...`).
#
# Usage: build.sh [--profile dist|release|dev] [--build] [--tag TAG]
#   --tag   the image tag (default: the workspace version in Cargo.toml, the chart's
#           appVersion); a second tag makes the same images under another name (upgrades).
#
# Cached by content under ${TENSILE_K8S_CACHE:-${XDG_CACHE_HOME:-~/.cache}/tensile/k8s}:
#   image-packages-<hash>/        the unpacked packages, their versions and Debian release
#                                 (fetched once per recipe; delete it to take Debian's updates)
#   images-<tag>-<hash>/<binary>.tar and `versions`, the hash of the four binaries, the
#                                 package versions, the Dockerfile, this script, ../lib.sh,
#                                 the tag and the profile.
# Directories of either kind unused for a day are removed.
# A warm run hashes the binaries and checks the stamp. Progress goes to stderr; the last line
# on stdout is the images' directory.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../../.." && pwd)
log_prefix="images"
# shellcheck source=../lib.sh
. "$here/../lib.sh"
umask 022

usage() { echo "usage: build.sh [--profile dist|release|dev] [--build] [--tag TAG]" >&2; }
die() { echo "images/build.sh: $*" >&2; exit 1; }

profile=dist build=false tag=
while [ $# -gt 0 ]; do
  case $1 in
    --profile) [ $# -ge 2 ] || die "--profile needs a value"; profile=$2; shift 2 ;;
    --profile=*) profile=${1#*=}; shift ;;
    --tag) [ $# -ge 2 ] || die "--tag needs a value"; tag=$2; shift 2 ;;
    --tag=*) tag=${1#*=}; shift ;;
    --build) build=true; shift ;;
    -h | --help) usage; exit 0 ;;
    *) usage; die "unknown argument $1" ;;
  esac
done
case $profile in
  dist | release) profile_dir=$profile ;;
  dev) profile_dir=debug ;;
  *) die "--profile is dist, release or dev, not $profile" ;;
esac
if [ -z "$tag" ]; then
  tag=$(awk '/^\[/ { section = $0 } section == "[workspace.package]" && $1 == "version" { gsub(/"/, "", $3); print $3 }' \
    "$repo/Cargo.toml")
  [ -n "$tag" ] || die "cannot read the workspace version from $repo/Cargo.toml"
fi
[[ $tag =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$ ]] || die "$tag is not an image tag"

# The recipe: each image's binary and the ports its Dockerfile stage EXPOSEs.
images=(
  "virtual-node 10250 10255"
  "tensile-webhook 8443"
  "tensile-descheduler 10258"
  "tensile-scheduler-extender 8888"
)
binaries=()
for image in "${images[@]}"; do binaries+=("${image%% *}"); done
packages=(libc6 libgcc-s1 ca-certificates)
nonroot=65532

bin_dir="${CARGO_TARGET_DIR:-$repo/target}/$profile_dir"
if $build; then
  bin_args=()
  for binary in "${binaries[@]}"; do bin_args+=(--bin "$binary"); done
  step "cargo build --profile $profile" \
    env -C "$repo" cargo build --profile "$profile" --locked --workspace "${bin_args[@]}"
fi
for binary in "${binaries[@]}"; do
  [ -x "$bin_dir/$binary" ] ||
    die "$bin_dir/$binary is missing: build it (cargo build --profile $profile --workspace --bins) or pass --build"
done

cache_root=$(k8s_cache_root)
mkdir -p "$cache_root"
exec 9>"$cache_root/.build-images.lock"

# The Debian packages, unpacked, with their versions and the Debian release they come from.
pkg_key=$( (cat "$here/build.sh" "$here/../lib.sh"; echo "${packages[*]}") | sha256sum | cut -c1-12)
pkg_dir="$cache_root/image-packages-$pkg_key"
if [ -f "$pkg_dir/.complete" ]; then
  touch "$pkg_dir/.complete"
else
  flock 9
fi
if [ ! -f "$pkg_dir/.complete" ]; then
  for tool in apt-get dpkg dpkg-deb; do
    command -v "$tool" >/dev/null || die "$tool is required (not on PATH)"
  done
  tmp="$pkg_dir.tmp.$$"
  rm -rf "$tmp"
  mkdir -p "$tmp/work"
  trap 'rm -rf "$tmp"' EXIT
  apt_fetch_unpack "$tmp/work" "$tmp/root" "$tmp/versions" "${packages[@]}"
  # Each package's control fields where distroless keeps them, so that scanners (and
  # tests/images.rs) see what the image holds.
  mkdir -p "$tmp/root/var/lib/dpkg/status.d"
  for deb in "$tmp"/work/debs/*.deb; do
    dpkg-deb -f "$deb" >"$tmp/root/var/lib/dpkg/status.d/$(dpkg-deb -f "$deb" Package)"
  done
  # The release of the suites apt read (apt_fetch_unpack's private lists: bookworm,
  # bookworm-updates and bookworm-security all say 12): one, or the packages may come from
  # several.
  releases=$(sed -n 's/^Version: \([0-9][0-9]*\).*/\1/p' "$tmp"/work/apt/lists/*Release | sort -u)
  codenames=$(sed -n 's/^Codename: \([a-z][a-z]*\).*/\1/p' "$tmp"/work/apt/lists/*Release | sort -u)
  origins=$(sed -n 's/^Origin: //p' "$tmp"/work/apt/lists/*Release | sort -u)
  [ "$origins" = Debian ] || die "the apt sources are not all Debian's (origins: $origins)"
  [ "$(wc -w <<<"$releases $codenames")" = 2 ] ||
    die "the apt sources mix Debian releases ($releases; $codenames): which one the images are is unclear"
  printf 'debian=%s\ndebian-codename=%s\n' "$releases" "$codenames" >"$tmp/release"
  rm -rf "$tmp/work"
  touch "$tmp/.complete"
  rm -rf "$pkg_dir"
  mv "$tmp" "$pkg_dir"
  trap - EXIT
fi

key=$( (sha256sum "${binaries[@]/#/$bin_dir/}" | cut -d' ' -f1
  cat "$pkg_dir/versions" "$pkg_dir/release" "$repo/Dockerfile" "$here/build.sh" "$here/../lib.sh"
  echo "$tag $profile") | sha256sum | cut -c1-12)
out="$cache_root/images-$tag-$key"
if [ -f "$out/.complete" ]; then
  touch "$out/.complete"
  echo "images: cached in $out" >&2
  echo "$out"
  exit 0
fi
flock 9
if [ -f "$out/.complete" ]; then
  echo "images: built by a concurrent run in $out" >&2
  echo "$out"
  exit 0
fi

start=$(date +%s)
tmp="$out.tmp.$$"
rm -rf "$tmp"
mkdir -p "$tmp/work"
trap 'rm -rf "$tmp"' EXIT
debian=$(sed -n 's/^debian=//p' "$pkg_dir/release")
debian_codename=$(sed -n 's/^debian-codename=//p' "$pkg_dir/release")

# The root file system of distroless/cc-debian12 (its passwd, group, nsswitch.conf,
# os-release, /tmp, homes) over the packages' files.
base="$tmp/work/base"
cp -a "$pkg_dir/root" "$base"
# update-ca-certificates: a shell script (no shell to run it); the bundle is made below. The
# documentation's examples: a package's sources (an executable debian/rules).
rm -rf "$base/usr/sbin/update-ca-certificates" "$base/usr/share/doc/ca-certificates/examples"
programs=$(find "$base" -path '*bin/*' ! -type d)
[ -z "$programs" ] || die "the packages bring programs the images must not have (no shell): $programs"
(
  shopt -s failglob
  export LC_ALL=C
  mkdir -p "$base/etc/ssl/certs"
  for crt in "$base"/usr/share/ca-certificates/mozilla/*.crt; do
    sed -e '$a\' "$crt"
  done >"$base/etc/ssl/certs/ca-certificates.crt"
)
cat >"$base/etc/passwd" <<EOF
root:x:0:0:root:/root:/sbin/nologin
nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin
nonroot:x:$nonroot:$nonroot:nonroot:/home/nonroot:/sbin/nologin
EOF
cat >"$base/etc/group" <<EOF
root:x:0:
nobody:x:65534:
tty:x:5:
staff:x:50:
nonroot:x:$nonroot:
EOF
echo 'hosts: files dns' >"$base/etc/nsswitch.conf"
cat >"$base/etc/os-release" <<EOF
PRETTY_NAME="Distroless (tensile's)"
NAME="Debian GNU/Linux"
ID="debian"
VERSION_ID="$debian"
VERSION="Debian GNU/Linux $debian ($debian_codename)"
VERSION_CODENAME=$debian_codename
EOF
mkdir -p "$base/tmp" "$base/root" "$base/home/nonroot" "$base/usr/local/bin"
chmod 1777 "$base/tmp"
chmod 0700 "$base/root" "$base/home/nonroot"

path_env="PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
certs_env="SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt"
t0=$(date +%s)
for image in "${images[@]}"; do
  read -r binary ports <<<"$image"
  root="$tmp/work/$binary"
  cp -a "$base" "$root"
  install -m 0755 "$bin_dir/$binary" "$root/usr/local/bin/$binary"
  exposed=$(for port in $ports; do printf '"%s/tcp":{}\n' "$port"; done | paste -sd,)
  config="{\"User\":\"$nonroot:$nonroot\",\"ExposedPorts\":{$exposed},\"Env\":[\"$path_env\",\"$certs_env\"],"
  config+="\"Entrypoint\":[\"/usr/local/bin/$binary\"],\"WorkingDir\":\"/home/nonroot\"}"
  make_image_config "$root" "tensile/$binary:$tag" "$config" "$tmp/$binary.tar" \
    "$nonroot:$nonroot:home/nonroot"
  rm -rf "$root"
  echo "images: tensile/$binary:$tag ($(du -m "$tmp/$binary.tar" | cut -f1) MiB)" >&2
done
echo "images: made in $(($(date +%s) - t0))s" >&2

{
  echo "tag=$tag"
  echo "profile=$profile"
  for binary in "${binaries[@]}"; do echo "$binary-image=tensile/$binary:$tag"; done
  cat "$pkg_dir/release" "$pkg_dir/versions"
} >"$tmp/versions"
rm -rf "$tmp/work"
touch "$tmp/.complete"
rm -rf "$out"
mv "$tmp" "$out"
trap - EXIT
# Images of other binaries (every dev build makes new ones) and packages unused for a day.
find "$cache_root" -mindepth 2 -maxdepth 2 -name .complete -mtime +0 \
  \( -path "$cache_root/images-*" -o -path "$cache_root/image-packages-*" \) -printf '%h\n' |
  while read -r old; do rm -rf "$old"; done
echo "images: done in $(($(date +%s) - start))s -> $out" >&2
echo "$out"
