//! A `virtual-node` process joined to a cluster pair.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Result;
use nix::sys::signal::Signal;

use crate::pair::ClusterPair;
use crate::ports::free_port;
use crate::process::Process;

/// How to start a virtual node.
#[derive(Clone, Debug)]
pub struct VirtualNodeOptions {
    /// The `virtual-node` binary (`env!("CARGO_BIN_EXE_virtual-node")` in tests).
    pub binary: PathBuf,
    /// `--nodename`.
    pub node_name: String,
    /// Further flags.
    pub args: Vec<String>,
    /// Further environment variables.
    pub envs: Vec<(String, String)>,
    /// Upper kubeconfig (default: the pair's admin one).
    pub upper_kubeconfig: Option<PathBuf>,
    /// Lower kubeconfig (default: the pair's admin one).
    pub lower_kubeconfig: Option<PathBuf>,
    /// Whether the flags join a lower cluster (`--client-kubeconfig`); off for a process
    /// that runs only the members of `--members-namespace`.
    pub flags_member: bool,
}

impl VirtualNodeOptions {
    /// A node named `node_name` run from `binary`.
    pub fn new(binary: impl Into<PathBuf>, node_name: &str) -> Self {
        Self {
            binary: binary.into(),
            node_name: node_name.to_owned(),
            args: Vec::new(),
            envs: Vec::new(),
            upper_kubeconfig: None,
            lower_kubeconfig: None,
            flags_member: true,
        }
    }
}

/// A running `virtual-node`. Dropping it kills it.
pub struct VirtualNode {
    process: Process,
    /// Its node name.
    pub node_name: String,
    /// Its kubelet API port (`KUBELET_PORT`).
    pub kubelet_port: u16,
    /// Its metrics port.
    pub metrics_port: u16,
}

impl ClusterPair {
    /// Starts `virtual-node` joining the lower cluster to the upper one, on free ports, with
    /// the kubelet serving certificate the upper API server trusts. Its log is
    /// `<dir>/virtual-node-<name>.log` (appended across restarts).
    pub fn start_virtual_node(&self, options: &VirtualNodeOptions) -> Result<VirtualNode> {
        let kubelet_port = free_port()?;
        let metrics_port = free_port()?;
        let pki = &self.upper.pki;
        let p = |path: &Path| path.display().to_string();
        let mut args = vec![
            "--nodename".to_owned(),
            options.node_name.clone(),
            "--kubeconfig".into(),
            p(options
                .upper_kubeconfig
                .as_ref()
                .unwrap_or(&self.upper.kubeconfig)),
            "--metrics-addr".into(),
            format!("127.0.0.1:{metrics_port}"),
        ];
        if options.flags_member {
            args.push("--client-kubeconfig".into());
            args.push(p(options
                .lower_kubeconfig
                .as_ref()
                .unwrap_or(&self.lower.kubeconfig)));
        }
        args.extend(options.args.iter().cloned());
        let mut envs = vec![
            ("KUBELET_PORT".to_owned(), kubelet_port.to_string()),
            ("VKUBELET_POD_IP".into(), "127.0.0.1".into()),
            (
                "APISERVER_CERT_LOCATION".into(),
                p(&pki.kubelet_serving.cert),
            ),
            ("APISERVER_KEY_LOCATION".into(), p(&pki.kubelet_serving.key)),
            ("APISERVER_CA_CERT_LOCATION".into(), p(&pki.ca_cert)),
        ];
        envs.extend(options.envs.iter().cloned());
        let log = self
            .dir
            .join(format!("virtual-node-{}.log", options.node_name));
        let process = Process::spawn(
            &format!("virtual-node {}", options.node_name),
            &options.binary,
            &args,
            &envs,
            &log,
            self.reaper(),
        )?;
        Ok(VirtualNode {
            process,
            node_name: options.node_name.clone(),
            kubelet_port,
            metrics_port,
        })
    }
}

impl VirtualNode {
    /// Graceful stop: SIGTERM, SIGKILL after 20 s.
    pub fn stop(&mut self) -> Result<()> {
        self.process.stop(Duration::from_secs(20))
    }

    /// `kill -9`.
    pub fn kill(&mut self) -> Result<()> {
        self.process.kill()
    }

    /// Sends a signal without waiting.
    pub fn signal(&self, signal: Signal) -> Result<()> {
        self.process.signal(signal)
    }

    /// Fails with the log's tail if it has exited.
    pub fn check_running(&mut self) -> Result<()> {
        self.process.check_running()
    }

    /// Its log file.
    pub fn log(&self) -> &Path {
        self.process.log()
    }

    /// Its PID.
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }
}

/// Runs `virtual-node join` (of `binary`) for the lower cluster of `lower_kubeconfig`,
/// joined as `node` in the members namespace `namespace` of the upper cluster of
/// `upper_kubeconfig`, as a user would.
pub async fn join_member(
    binary: &Path,
    upper_kubeconfig: &Path,
    lower_kubeconfig: &Path,
    node: &str,
    namespace: &str,
) -> Result<()> {
    let joined = tokio::process::Command::new(binary)
        .args(["join", "--nodename", node, "--members-namespace", namespace])
        .arg("--kubeconfig")
        .arg(upper_kubeconfig)
        .arg("--client-kubeconfig")
        .arg(lower_kubeconfig)
        .output()
        .await?;
    if !joined.status.success() {
        anyhow::bail!(
            "virtual-node join for {node} failed: {}",
            String::from_utf8_lossy(&joined.stderr).trim()
        );
    }
    Ok(())
}

impl ClusterPair {
    /// Joins each (node, lower cluster kubeconfig) of `members` with `virtual-node join`
    /// (of `binary`) into the upper members namespace `namespace`, then
    /// [`ClusterPair::serve_members`].
    pub async fn start_members(
        &self,
        binary: &Path,
        namespace: &str,
        members: &[(&str, &Path)],
        args: &[String],
    ) -> Result<VirtualNode> {
        for (node, kubeconfig) in members {
            join_member(binary, &self.upper.kubeconfig, kubeconfig, node, namespace).await?;
        }
        let nodes: Vec<&str> = members.iter().map(|(node, _)| *node).collect();
        self.serve_members(binary, "vk-members", namespace, &nodes, args)
            .await
    }

    /// Starts one virtual-node (of `binary`, `--nodename process`, which names its log and
    /// its default leader-election Lease) serving the member Secrets of the upper
    /// namespace `namespace` (`--members-namespace`, `args` besides), and waits until each
    /// node of `nodes` is Ready and schedulable: the node lifecycle controller has also
    /// taken its `node.kubernetes.io/not-ready` taint off, which it does a moment after
    /// Ready, and until then the upper scheduler places nothing there. The error carries
    /// the end of its log.
    pub async fn serve_members(
        &self,
        binary: &Path,
        process: &str,
        namespace: &str,
        nodes: &[&str],
        args: &[String],
    ) -> Result<VirtualNode> {
        let mut options = VirtualNodeOptions::new(binary, process);
        options.flags_member = false;
        options.args = ["--members-namespace".to_owned(), namespace.to_owned()]
            .into_iter()
            .chain(args.iter().cloned())
            .collect();
        let mut vn = self.start_virtual_node(&options)?;
        let upper: kube::Api<k8s_openapi::api::core::v1::Node> =
            kube::Api::all(self.upper.client().await?);
        for node in nodes {
            let ready = crate::wait_for(
                &format!("node {node} Ready and schedulable"),
                Duration::from_secs(120),
                || async {
                    Ok(upper
                        .get_opt(node)
                        .await?
                        .filter(crate::node_is_schedulable)
                        .map(|_| ()))
                },
            )
            .await;
            if let Err(error) = ready {
                let _ = vn.check_running();
                anyhow::bail!("{error:#}\n{}", crate::process::tail(vn.log(), 40));
            }
        }
        Ok(vn)
    }
}
