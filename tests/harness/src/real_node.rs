//! One real node in a harness cluster, beside the kwok nodes: a kubelet of the pinned
//! release with containerd, runc and the CNI bridge, which runs real containers from a
//! busybox image made locally ([`BUSYBOX_IMAGE`]). Everything it runs comes from
//! `tests/k8s/real-node/build.sh` (see there for which packages and why); nothing is
//! pulled from a registry.
//!
//! The node is labelled and tainted [`REAL_NODE_LABEL`]` = true` (`NoSchedule`), so only
//! pods that ask for it ([`real_node_placement`]) land there; everything else stays on kwok.
//!
//! Isolation, so that the machine is left as found and several test binaries can each run
//! their own at the same time:
//! - containerd and the kubelet run in their own mount and PID namespaces (`unshare`),
//!   under a `bash` as PID 1: when the harness ends in any way, the reaper kills `unshare`,
//!   the kernel kills PID 1 (`--kill-child`) and with it every process of the node
//!   (containerd, its shims, the containers, the kubelet), and every mount they made goes
//!   with the namespace. In there, the sysctls the kubelet would otherwise set on the host
//!   (`vm.overcommit_memory`, `kernel.panic`, `kernel.panic_on_oops`, ...) are files bound
//!   over `/proc/sys` that already hold the values it wants, and `/run` and `/var` are
//!   private tmpfs (containerd, its shims and runc keep state in `/run/containerd`, libcni
//!   caches in `/var/lib/cni`, the kubelet writes `/var/lib/kubelet/device-plugins` and
//!   `/var/log/containers`, all at fixed paths).
//! - each node claims a slot (a file lock in the temporary directory, released when its
//!   holder ends) that names its cgroup parent (`/tensile-real-node-<slot>` in every
//!   hierarchy), its bridge (`tnsl-rn<slot>`) and its pod subnet (`10.253.<slot>.0/24`);
//!   its directories (kubelet root, containerd root and state, CNI configuration and IPAM,
//!   pod logs) are in its own directory in the cluster's.
//!
//! Cgroups: this machine has cgroup v1 hierarchies (a tmpfs at `/sys/fs/cgroup` holding one
//! mount per controller, and a cgroup2 without controllers at `unified`: the hybrid
//! layout); kubelet 1.36 refuses cgroup v1 unless `failCgroupV1: false`, and
//! uses the `cgroupfs` driver (no systemd here). The container runtime lacks the
//! `RuntimeConfig` CRI call (containerd 1.6), so the kubelet takes the driver from its own
//! configuration. The node registers a non-loopback InternalIP (the machine's address on
//! its default route): a kubelet refuses a loopback node IP, and the API server will not
//! proxy to one.

use std::fs::File;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use serde_json::{Value, json};

use crate::cluster::{Cluster, node_is_ready};
use crate::pair::ClusterPair;
use crate::pki::write_kubeconfig;
use crate::ports::free_port;
use crate::process::{Process, Reaper, tail};
use crate::wait::wait_for;

/// The label (value `true`) and `NoSchedule` taint of a real node.
pub const REAL_NODE_LABEL: &str = "tensile.dev/real-node";
/// The image of busybox-static made by the build script; containers on the real node run it.
pub const BUSYBOX_IMAGE: &str = "tensile.local/busybox:1.35.0";
/// The sandbox (pause) image made by the build script.
pub const PAUSE_IMAGE: &str = "tensile.local/pause:1";
/// How long a real node may take to register and turn Ready.
const READY_TIMEOUT: Duration = Duration::from_secs(120);
/// How many real nodes may run on the machine at once.
const SLOTS: u8 = 32;

/// A pod spec's placement onto real nodes: `{"nodeSelector": .., "tolerations": [..]}`,
/// to merge into a lower pod's spec or to stash in an upper pod's `clusterSelector`.
pub fn real_node_placement() -> Value {
    json!({
        "nodeSelector": {REAL_NODE_LABEL: "true"},
        "tolerations": [{"key": REAL_NODE_LABEL, "operator": "Exists", "effect": "NoSchedule"}],
    })
}

/// The directory `tests/k8s/real-node/build.sh` printed (`bin/`, `cni/`, `images/`).
#[derive(Clone, Debug)]
pub struct RealNodeBinaries {
    dir: PathBuf,
}

static LOCATED: OnceLock<PathBuf> = OnceLock::new();

impl RealNodeBinaries {
    /// Finds them (`TENSILE_REAL_NODE_DIR`), else builds them (once; later calls reuse it).
    pub fn locate() -> Result<Self> {
        if let Some(dir) = LOCATED.get() {
            return Ok(Self { dir: dir.clone() });
        }
        let dir = match std::env::var_os("TENSILE_REAL_NODE_DIR") {
            Some(dir) => PathBuf::from(dir),
            None => build()?,
        };
        if !dir.join(".complete").exists() {
            bail!(
                "{} is not a directory built by tests/k8s/real-node/build.sh",
                dir.display()
            );
        }
        Ok(Self {
            dir: LOCATED.get_or_init(|| dir).clone(),
        })
    }

    fn bin(&self, name: &str) -> PathBuf {
        self.dir.join("bin").join(name)
    }
}

/// The build script of the real node's binaries and images.
pub fn build_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../k8s/real-node/build.sh")
}

fn build() -> Result<PathBuf> {
    crate::binaries::run_build_script(&build_script())
}

/// A running real node. Dropping it kills every process of it and removes its cgroups and
/// bridge; its Node object stays (NotReady) in the cluster.
pub struct RealNode {
    /// The node's name.
    pub name: String,
    /// Its directory: `kubelet.log`, `containerd.log`, the configuration, the state.
    pub dir: PathBuf,
    /// Its InternalIP (where the kubelet listens).
    pub node_ip: Ipv4Addr,
    /// The kubelet's port.
    pub kubelet_port: u16,
    /// Its slot (names its cgroup parent, bridge and subnet).
    pub slot: u8,
    process: Process,
    _slot_lock: File,
}

impl RealNode {
    /// The kubelet's log.
    pub fn kubelet_log(&self) -> PathBuf {
        self.dir.join("kubelet.log")
    }

    /// containerd's log.
    pub fn containerd_log(&self) -> PathBuf {
        self.dir.join("containerd.log")
    }

    /// Fails (with the logs' tails) if the node's processes have ended.
    pub fn check_running(&mut self) -> Result<()> {
        self.process
            .check_running()
            .map_err(|error| error.context(self.logs_tail(20)))
    }

    /// The last `lines` lines of the kubelet's and containerd's logs.
    pub fn logs_tail(&self, lines: usize) -> String {
        format!(
            "--- {}:\n{}\n--- {}:\n{}",
            self.kubelet_log().display(),
            tail(&self.kubelet_log(), lines),
            self.containerd_log().display(),
            tail(&self.containerd_log(), lines),
        )
    }
}

impl Drop for RealNode {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- real node {}:\n{}", self.name, self.logs_tail(40));
        }
        // `unshare` ignores SIGTERM; its SIGKILL takes the namespace's PID 1 with it.
        let _ = self.process.kill();
        remove_cgroups(self.slot);
        delete_bridge(self.slot);
    }
}

fn delete_bridge(slot: u8) {
    let _ = Command::new("ip")
        .args(["link", "delete", &bridge_name(slot)])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// The shell commands that remove a slot's cgroups (retried while its processes die) and
/// bridge, for the reaper.
fn cleanup_script(slot: u8) -> String {
    let parent = cgroup_parent(slot);
    format!(
        "for i in $(seq 50); do left=; for d in /sys/fs/cgroup/*/{parent} /sys/fs/cgroup/{parent}; do \
         [ -d \"$d\" ] && find \"$d\" -depth -type d -exec rmdir {{}} + 2>/dev/null; \
         [ -d \"$d\" ] && left=1; done; [ -z \"$left\" ] && break; sleep 0.1; done; \
         ip link delete {bridge} 2>/dev/null; true",
        bridge = bridge_name(slot),
    )
}

fn bridge_name(slot: u8) -> String {
    format!("tnsl-rn{slot}")
}

fn cgroup_parent(slot: u8) -> String {
    format!("tensile-real-node-{slot}")
}

/// The cgroup hierarchies a kubelet with the cgroupfs driver uses: on cgroup v1, each
/// controller's mount under `/sys/fs/cgroup` (not `unified`, the hybrid layout's cgroup2);
/// on cgroup v2, `/sys/fs/cgroup` itself.
fn hierarchies() -> Vec<PathBuf> {
    let root = Path::new("/sys/fs/cgroup");
    if root.join("cgroup.controllers").exists() {
        return vec![root.to_owned()];
    }
    std::fs::read_dir(root)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    p.join("cgroup.procs").exists() && !p.join("cgroup.controllers").exists()
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Creates the slot's cgroup parent in every hierarchy (the kubelet requires that its
/// `cgroupRoot` exists); a cpuset cgroup needs its CPUs and memory nodes before tasks join.
fn create_cgroups(slot: u8) -> Result<()> {
    for hierarchy in hierarchies() {
        let dir = hierarchy.join(cgroup_parent(slot));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        for file in ["cpuset.cpus", "cpuset.mems"] {
            let parent = hierarchy.join(file);
            let own = dir.join(file);
            if parent.exists() && std::fs::read_to_string(&own).is_ok_and(|s| s.trim().is_empty()) {
                let value = std::fs::read_to_string(&parent)
                    .with_context(|| format!("reading {}", parent.display()))?;
                std::fs::write(&own, value.trim())
                    .with_context(|| format!("writing {}", own.display()))?;
            }
        }
    }
    Ok(())
}

/// Removes the slot's cgroups, deepest first (their processes are gone or going: a cgroup
/// with a task in it cannot be removed, so each is retried for a while).
fn remove_cgroups(slot: u8) {
    fn dirs(dir: &Path, out: &mut Vec<PathBuf>) {
        if let Ok(entries) = std::fs::read_dir(dir) {
            for entry in entries.flatten() {
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    dirs(&entry.path(), out);
                }
            }
        }
        out.push(dir.to_owned());
    }
    // Every hierarchy, the hybrid layout's `unified` too (runc makes the container's
    // cgroup there as well).
    let mut hierarchies = hierarchies();
    let unified = Path::new("/sys/fs/cgroup/unified");
    if unified.join("cgroup.procs").exists() {
        hierarchies.push(unified.to_owned());
    }
    for hierarchy in hierarchies {
        let mut all = Vec::new();
        let top = hierarchy.join(cgroup_parent(slot));
        if !top.exists() {
            continue;
        }
        dirs(&top, &mut all);
        for dir in all {
            for _ in 0..50 {
                if std::fs::remove_dir(&dir).is_ok() || !dir.exists() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// Claims a free slot: an exclusive lock on `<tmp>/tensile-real-node/slot-<n>.lock`, held
/// by the returned file (the kernel releases it when the holder ends, however it ends).
fn claim_slot() -> Result<(u8, File, PathBuf)> {
    let dir = std::env::temp_dir().join("tensile-real-node");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    for slot in 0..SLOTS {
        let path = dir.join(format!("slot-{slot}.lock"));
        let file = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        if file.try_lock().is_ok() {
            return Ok((slot, file, path));
        }
    }
    bail!(
        "all {SLOTS} real-node slots are in use (locks in {})",
        dir.display()
    )
}

fn write(path: &Path, contents: &str) -> Result<()> {
    std::fs::write(path, contents).with_context(|| format!("writing {}", path.display()))
}

/// Single-quotes `s` for the shell.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

impl Cluster {
    /// Starts a real node named `name` in this cluster (see the module's documentation) and
    /// waits until it is Ready. Building its binaries on first use takes a while.
    pub async fn start_real_node(&self, name: &str, reaper: &Reaper) -> Result<RealNode> {
        self.start_real_node_with(name, reaper, &[]).await
    }

    /// [`Cluster::start_real_node`], importing `extra_images` (docker-archive tarballs, as
    /// `tests/k8s/e2e/build.sh` makes) into its containerd besides the build script's two,
    /// before the kubelet starts: pods find them under their own names, never pulled.
    pub async fn start_real_node_with(
        &self,
        name: &str,
        reaper: &Reaper,
        extra_images: &[PathBuf],
    ) -> Result<RealNode> {
        for image in extra_images {
            if !image.is_file() {
                bail!("image tarball {} is not a file", image.display());
            }
        }
        let bins = tokio::task::spawn_blocking(RealNodeBinaries::locate).await??;
        let started = std::time::Instant::now();
        if !Path::new("/proc/self/ns/pid").exists() {
            bail!("a real node needs Linux namespaces (/proc/self/ns/pid is missing)");
        }
        let (slot, lock, lock_path) = claim_slot()?;
        // What a previous holder of the slot left (its processes are gone with its PID
        // namespace; its cgroups and bridge stay when it was killed) ...
        remove_cgroups(slot);
        delete_bridge(slot);
        // ... and what this one will leave if it is never dropped (a test binary's shared
        // node): the reaper removes it, unless the slot is taken again by then.
        reaper.on_exit(&format!(
            "flock -n {lock} sh -c {cleanup}",
            lock = quote(&lock_path.display().to_string()),
            cleanup = quote(&cleanup_script(slot)),
        ))?;
        let node_ip = crate::ports::host_ip()?;
        let kubelet_port = free_port()?;
        let dir = self.dir.join(format!("real-node-{name}"));
        if dir.exists() {
            std::fs::remove_dir_all(&dir)
                .with_context(|| format!("removing the stale {}", dir.display()))?;
        }
        for sub in [
            "pki",
            "cni/net.d",
            "cni/ipam",
            "sysctl",
            "pod-logs",
            "kubelet",
        ] {
            std::fs::create_dir_all(dir.join(sub))
                .with_context(|| format!("creating {}", dir.join(sub).display()))?;
        }
        let p = |path: &Path| path.display().to_string();
        let node_ip_text = node_ip.to_string();
        // The node's namespace has its own /run and /var (below).
        for path in [&dir, &bins.dir] {
            let real = std::fs::canonicalize(path)
                .with_context(|| format!("resolving {}", path.display()))?;
            if real.starts_with("/run") || real.starts_with("/var") {
                bail!(
                    "{} is under /run or /var, which the real node's namespace replaces: \
                     use a state directory (and TENSILE_K8S_CACHE) elsewhere",
                    real.display()
                );
            }
        }

        // Who it is to the API server (the Node authorizer's `system:node:<name>`), and what
        // it serves its kubelet API with (the API server verifies it with the cluster CA).
        let client = self
            .pki
            .issue_client(&format!("system:node:{name}"), &["system:nodes"])?;
        let serving = self
            .pki
            .issue_serving(name, &[&node_ip_text, "127.0.0.1", name])?;
        let kubeconfig = dir.join("kubelet.kubeconfig");
        write_kubeconfig(
            &kubeconfig,
            &self.name,
            &self.server,
            &self.pki.ca_cert,
            &client,
        )?;

        let socket = dir.join("containerd.sock");
        // A Unix socket's path has room for 107 bytes (containerd adds `.ttrpc`).
        if socket.as_os_str().len() > 100 {
            bail!(
                "{} is too long for containerd's socket: use a shorter state directory",
                socket.display()
            );
        }
        let containerd_config = format!(
            r#"version = 2
root = {root}
state = {state}
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.internal.v1.opt", "io.containerd.tracing.processor.v1.otlp"]
[grpc]
  address = {socket}
[ttrpc]
  address = ""
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  # Without CAP_SYS_RESOURCE (this machine's root lacks it) an oom_score_adj below the
  # current one is refused: keep what the kubelet asks within what may be set.
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = {runc}
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = {cni_bin}
    conf_dir = {cni_conf}
"#,
            root = json!(p(&dir.join("containerd/root"))),
            state = json!(p(&dir.join("containerd/state"))),
            socket = json!(p(&socket)),
            runc = json!(p(&bins.bin("runc"))),
            cni_bin = json!(p(&bins.dir.join("cni"))),
            cni_conf = json!(p(&dir.join("cni/net.d"))),
        );
        write(&dir.join("containerd.toml"), &containerd_config)?;

        let cni = json!({
            "cniVersion": "1.0.0",
            "name": format!("tensile-real-node-{slot}"),
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": bridge_name(slot),
                    "isGateway": true,
                    "ipMasq": false,
                    "hairpinMode": true,
                    "ipam": {
                        "type": "host-local",
                        "dataDir": dir.join("cni/ipam"),
                        "ranges": [[{"subnet": format!("10.253.{slot}.0/24")}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                    },
                },
                {"type": "loopback"},
            ],
        });
        write(
            &dir.join("cni/net.d/10-tensile.conflist"),
            &serde_json::to_string_pretty(&cni)?,
        )?;

        let kubelet_config = json!({
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": node_ip_text,
            "port": kubelet_port,
            "readOnlyPort": 0,
            "healthzPort": 0,
            "tlsCertFile": serving.cert,
            "tlsPrivateKeyFile": serving.key,
            "authentication": {
                "anonymous": {"enabled": false},
                "webhook": {"enabled": true},
                "x509": {"clientCAFile": self.pki.ca_cert},
            },
            "authorization": {"mode": "Webhook"},
            // This machine: cgroup v1, no systemd.
            "failCgroupV1": false,
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": format!("/{}", cgroup_parent(slot)),
            "cgroupsPerQOS": true,
            "enforceNodeAllocatable": [],
            "failSwapOn": false,
            // Nothing in the host's iptables (the node is on the host's network).
            "makeIPTablesUtilChains": false,
            "containerRuntimeEndpoint": format!("unix://{}", p(&socket)),
            "podLogsDir": dir.join("pod-logs"),
            "resolvConf": "",
            "registerNode": true,
            "registerWithTaints": [{"key": REAL_NODE_LABEL, "value": "true", "effect": "NoSchedule"}],
            // A test machine's disk may be fuller than eviction would allow; the images
            // are imported, never pulled again, so never collect them either.
            "evictionHard": {},
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "serializeImagePulls": false,
            "syncFrequency": "5s",
            "fileCheckFrequency": "5s",
            "nodeStatusUpdateFrequency": "5s",
            "maxPods": 30,
        });
        write(
            &dir.join("kubelet.json"),
            &serde_json::to_string_pretty(&kubelet_config)?,
        )?;

        let script = format!(
            r#"# PID 1 of the real node's PID and mount namespaces (see real_node.rs).
set -euo pipefail
dir={dir}
bin={bin}
# A private /run and /var: containerd, its shims and runc keep state under /run/containerd,
# libcni caches results in /var/lib/cni, and the kubelet writes
# /var/lib/kubelet/device-plugins and /var/log/containers, all at fixed paths.
mount -t tmpfs -o mode=0755 tensile-run /run
mount -t tmpfs -o mode=0755 tensile-var /var
ln -s /run /var/run
mkdir -p /var/lib/kubelet /var/log
# The values the kubelet sets at start (and the bridge plugin's ip_forward, which no pod
# here needs: they talk over the bridge), bound over /proc/sys so that it changes nothing
# on the host.
for kv in vm/overcommit_memory=1 vm/panic_on_oom=0 kernel/panic=10 kernel/panic_on_oops=1 \
  kernel/keys/root_maxkeys=1000000 kernel/keys/root_maxbytes=25000000 net/ipv4/ip_forward=1; do
  key=${{kv%=*}}
  file=$dir/sysctl/${{key//\//.}}
  echo "${{kv#*=}}" >"$file"
  mount --bind "$file" "/proc/sys/$key"
done
export PATH="$bin:$PATH"
containerd --config "$dir/containerd.toml" >>"$dir/containerd.log" 2>&1 &
containerd=$!
until ctr -a "$dir/containerd.sock" version >/dev/null 2>&1; do
  kill -0 "$containerd" 2>/dev/null || {{ echo "containerd exited" >&2; exit 1; }}
  sleep 0.1
done
for image in {images}/pause.tar {images}/busybox.tar{extra_images}; do
  ctr -a "$dir/containerd.sock" -n k8s.io images import "$image"
done
kubelet --config "$dir/kubelet.json" --kubeconfig "$dir/kubelet.kubeconfig" \
  --hostname-override {name} --node-ip {node_ip} --root-dir "$dir/kubelet" \
  --node-labels {label}=true --v=1 >>"$dir/kubelet.log" 2>&1 &
set +e
wait -n
status=$?
echo "real node: containerd or the kubelet exited ($status)" >&2
exit 1
"#,
            dir = quote(&p(&dir)),
            bin = quote(&p(&bins.dir.join("bin"))),
            images = quote(&p(&bins.dir.join("images"))),
            extra_images = extra_images
                .iter()
                .map(|image| format!(" {}", quote(&p(image))))
                .collect::<String>(),
            name = quote(name),
            node_ip = node_ip_text,
            label = REAL_NODE_LABEL,
        );
        let script_path = dir.join("run.sh");
        write(&script_path, &script)?;

        create_cgroups(slot)?;
        let process = Process::spawn(
            &format!("{}/real-node-{name}", self.name),
            Path::new("unshare"),
            &[
                "--mount".into(),
                "--pid".into(),
                "--fork".into(),
                "--kill-child=SIGKILL".into(),
                "--mount-proc".into(),
                "bash".into(),
                p(&script_path),
            ],
            // Where util-linux's mount keeps its table: in the node's directory, not in the
            // host's /run/mount.
            &[("LIBMOUNT_UTAB".into(), p(&dir.join("utab")))],
            &dir.join("real-node.log"),
            reaper,
        )?;
        let mut node = RealNode {
            name: name.to_owned(),
            dir,
            node_ip,
            kubelet_port,
            slot,
            process,
            _slot_lock: lock,
        };
        let nodes: Api<Node> = Api::all(self.client().await?);
        let what = format!("{}: real node {name} Ready", self.name);
        let ready = wait_for(&what, READY_TIMEOUT, || {
            let exited = node.process.check_running().err();
            let nodes = &nodes;
            async move {
                if let Some(exited) = exited {
                    return Ok(Some(Err(exited)));
                }
                Ok(nodes
                    .get_opt(name)
                    .await?
                    .filter(node_is_ready)
                    .map(|_| Ok(())))
            }
        })
        .await
        .and_then(|ready| ready);
        if let Err(error) = ready {
            return Err(error.context(format!(
                "starting real node {name} (slot {slot}, node IP {node_ip}):\n{}",
                node.logs_tail(30)
            )));
        }
        tracing::info!(
            node = name,
            slot,
            %node_ip,
            kubelet_port,
            elapsed = ?started.elapsed(),
            "real node Ready"
        );
        Ok(node)
    }
}

impl ClusterPair {
    /// Starts a real node named `name` in the lower cluster (see [`Cluster::start_real_node`]).
    pub async fn start_real_node(&self, name: &str) -> Result<RealNode> {
        self.lower.start_real_node(name, self.reaper()).await
    }

    /// Starts a real node in the lower cluster with more images
    /// (see [`Cluster::start_real_node_with`]).
    pub async fn start_real_node_with(
        &self,
        name: &str,
        extra_images: &[PathBuf],
    ) -> Result<RealNode> {
        self.lower
            .start_real_node_with(name, self.reaper(), extra_images)
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting_survives_the_shell() {
        for text in ["plain", "with space", "it's", "$HOME `x` \"q\" \\ ;|&"] {
            let out = Command::new("sh")
                .arg("-c")
                .arg(format!("printf %s {}", quote(text)))
                .output()
                .unwrap();
            assert_eq!(String::from_utf8_lossy(&out.stdout), text);
        }
    }

    #[test]
    fn placement_selects_and_tolerates_the_real_node() {
        let placement = real_node_placement();
        assert_eq!(placement["nodeSelector"][REAL_NODE_LABEL], "true");
        assert_eq!(placement["tolerations"][0]["key"], REAL_NODE_LABEL);
        assert_eq!(placement["tolerations"][0]["effect"], "NoSchedule");
    }

    #[test]
    fn the_cleanup_script_is_valid_shell() {
        let status = Command::new("sh")
            .args(["-n", "-c", &cleanup_script(7)])
            .status()
            .unwrap();
        assert!(status.success());
        assert!(cleanup_script(7).contains("tensile-real-node-7"));
        assert!(cleanup_script(7).contains("tnsl-rn7"));
    }
}
