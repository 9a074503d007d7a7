//! The kubelet API through the virtual node against a REAL kubelet: a real node
//! (kubelet, containerd, runc, the CNI bridge; `tensile_harness::real_node`) in the lower
//! cluster beside the kwok nodes, pods placed on it through the virtual node, and each
//! kubectl command run upstairs (through the virtual node) and straight to the lower
//! cluster, with the same result. Its own test binary: its pair runs a real node and
//! metrics-servers. Nothing here is skipped: a machine that cannot run the real node fails
//! these tests with the reason.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::process::{Output, Stdio};
use std::time::Duration;

use common::{Streaming, TIMEOUT, kubectl, start_node};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, PostParams};
use serde_json::{Value, json};
use tensile_harness::fixtures::{bound_pod, merge};
use tensile_harness::real_node::BUSYBOX_IMAGE;
use tensile_harness::{
    ClusterPair, PairOptions, RealNode, TestNamespace, VirtualNode, real_node_placement, wait_for,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;
use tokio::sync::OnceCell;

const NODE: &str = "vk-real";
const REAL_NODE: &str = "lower-real-0";
/// Usage goes through metrics-server's 10 s resolution (twice upstairs).
const METRICS_TIMEOUT: Duration = Duration::from_secs(240);

/// The pair, its real node and the virtual node, shared by this binary's tests.
struct Setup {
    pair: ClusterPair,
    real: RealNode,
    _vk: VirtualNode,
}

static SETUP: OnceCell<Setup> = OnceCell::const_new();

async fn setup() -> &'static Setup {
    SETUP
        .get_or_init(|| async {
            let mut options = PairOptions::default();
            options.upper.metrics = true;
            options.lower.metrics = true;
            let pair = ClusterPair::start(options).await.unwrap();
            let real = pair.start_real_node(REAL_NODE).await.unwrap_or_else(|error| {
                panic!("the real node did not start (see tests/harness/src/real_node.rs): {error:#}")
            });
            let vk = start_node(&pair, NODE, &[]).await;
            Setup {
                pair,
                real,
                _vk: vk,
            }
        })
        .await
}

/// A pod bound to the virtual node whose lower copy goes to the real node (the placement
/// stashed in `clusterSelector`, as the webhook would), running `script` in busybox;
/// `extra` is merged into its spec (a list replaces the list).
fn real_pod(name: &str, script: &str, extra: Value) -> Pod {
    let mut pod = bound_pod(name, NODE);
    pod.metadata.annotations = Some(
        [(
            "clusterSelector".to_owned(),
            real_node_placement().to_string(),
        )]
        .into(),
    );
    let mut spec = serde_json::to_value(pod.spec.take().unwrap()).unwrap();
    merge(
        &mut spec,
        json!({
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "app",
                "image": BUSYBOX_IMAGE,
                "command": ["sh", "-c", script],
            }],
        }),
    );
    merge(&mut spec, extra);
    pod.spec = Some(serde_json::from_value(spec).unwrap());
    pod
}

/// Creates `pods` upstairs in a new namespace and waits until each runs on the real node
/// below and is Running upstairs.
async fn run_on_real_node(setup: &Setup, prefix: &str, pods: Vec<Pod>) -> TestNamespace {
    let upper = setup.pair.upper.client().await.unwrap();
    let lower = setup.pair.lower.client().await.unwrap();
    let ns = TestNamespace::create(&upper, prefix).await.unwrap();
    let upper_pods: Api<Pod> = Api::namespaced(upper, &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower, &ns.name);
    let names: Vec<String> = pods
        .iter()
        .map(|p| p.metadata.name.clone().unwrap())
        .collect();
    for pod in pods {
        upper_pods
            .create(&PostParams::default(), &pod)
            .await
            .unwrap();
    }
    for name in &names {
        let ran = wait_for(
            &format!("{}/{name} Running on {REAL_NODE} and upstairs", ns.name),
            TIMEOUT,
            || async {
                let below = lower_pods.get_opt(name).await?;
                let on_real = below.as_ref().is_some_and(|p| {
                    p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(REAL_NODE)
                        && common::running(p)
                });
                let above = upper_pods.get_opt(name).await?;
                Ok((on_real && above.as_ref().is_some_and(common::running)).then_some(()))
            },
        )
        .await;
        if let Err(error) = ran {
            let below = lower_pods.get_opt(name).await.ok().flatten();
            panic!(
                "{error:#}\nlower pod: {}\n{}",
                serde_json::to_string(&below.map(|p| p.status)).unwrap(),
                setup.real.logs_tail(30)
            );
        }
    }
    ns
}

/// The same kubectl command upstairs (through the virtual node) and straight below.
async fn both(setup: &Setup, args: &[&str], stdin: &[u8]) -> [(&'static str, Output); 2] {
    let pair = &setup.pair;
    [
        (
            "upper",
            kubectl(pair, pair.upper_kubeconfig(), args, stdin).await,
        ),
        (
            "lower",
            kubectl(pair, pair.lower_kubeconfig(), args, stdin).await,
        ),
    ]
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[tokio::test]
async fn exec_exit_code_stdin_and_tty_size_through_the_virtual_node() {
    let setup = setup().await;
    let ns = run_on_real_node(
        setup,
        "real-exec",
        vec![real_pod("shell", "exec sleep 3600", json!({}))],
    )
    .await;
    let n = ns.name.as_str();

    // The command's exit code comes back as kubectl's.
    for (cluster, out) in both(
        setup,
        &[
            "-n",
            n,
            "exec",
            "shell",
            "--",
            "sh",
            "-c",
            "echo out; echo err >&2; exit 3",
        ],
        b"",
    )
    .await
    {
        assert_eq!(out.status.code(), Some(3), "{cluster}: {out:?}");
        assert_eq!(text(&out.stdout), "out\n", "{cluster}: {out:?}");
        assert!(text(&out.stderr).contains("err\n"), "{cluster}: {out:?}");
    }
    // Stdin piped in comes back out, to its end (the container sees the end of input).
    let input: String = (0..2000).map(|i| format!("line {i}\n")).collect();
    for (cluster, out) in both(
        setup,
        &[
            "-n",
            n,
            "exec",
            "-i",
            "shell",
            "--",
            "sh",
            "-c",
            "cat; echo done",
        ],
        input.as_bytes(),
    )
    .await
    {
        assert!(out.status.success(), "{cluster}: {out:?}");
        assert_eq!(text(&out.stdout), format!("{input}done\n"), "{cluster}");
    }
    // A TTY: kubectl in a pseudo-terminal (`script`) whose size is 33x77 sends that size,
    // which the container's terminal takes (the size travels apart from the start of the
    // command, so the command waits for it, up to 30 s); output comes back through the
    // TTY (CRLF).
    for kubeconfig in [setup.pair.upper_kubeconfig(), setup.pair.lower_kubeconfig()] {
        let kubectl = setup.pair.bin("kubectl");
        let inner = format!(
            "stty rows 33 cols 77; exec {} --kubeconfig {} -n {n} exec -it shell -- timeout 30 sh -c 'until [ \"$(stty size)\" = \"33 77\" ]; do usleep 20000; done; stty size; tty; exit 4'",
            kubectl.display(),
            kubeconfig.display()
        );
        let out = tokio::time::timeout(
            TIMEOUT,
            Command::new("script")
                .args(["-qefc", &inner, "/dev/null"])
                .stdin(Stdio::null())
                .output(),
        )
        .await
        .expect("kubectl exec -it in time")
        .expect("running script (util-linux)");
        let shown = text(&out.stdout);
        assert!(
            shown.contains("33 77\r\n"),
            "{}: {shown:?} {out:?}",
            kubeconfig.display()
        );
        assert!(
            shown.contains("/dev/pts/"),
            "{}: {shown:?}",
            kubeconfig.display()
        );
        assert_eq!(
            out.status.code(),
            Some(4),
            "{}: {out:?}",
            kubeconfig.display()
        );
    }
    // A resize during the session reaches the container.
    for (cluster, client) in [
        ("upper", setup.pair.upper.client().await.unwrap()),
        ("lower", setup.pair.lower.client().await.unwrap()),
    ] {
        tty_resize(client, n, "shell").await;
        println!("{cluster}: resize seen");
    }
    ns.delete().await.unwrap();
}

/// A TTY session resized after it started (what kubectl does on SIGWINCH): the container
/// sees the new size. Through the API server's WebSocket with kube's client.
async fn tty_resize(client: kube::Client, ns: &str, name: &str) {
    use futures::SinkExt;
    use kube::api::{AttachParams, TerminalSize};
    let pods: Api<Pod> = Api::namespaced(client, ns);
    let mut process = pods
        .exec(
            name,
            ["sh", "-c", "while read -r line; do stty size; done"],
            &AttachParams::interactive_tty(),
        )
        .await
        .unwrap();
    let mut size = process.terminal_size().unwrap();
    let mut stdin = process.stdin().unwrap();
    let mut stdout = process.stdout().unwrap();
    for (height, width) in [(33, 77), (41, 99)] {
        size.send(TerminalSize { width, height }).await.unwrap();
        common::until_shown(&mut stdin, &mut stdout, &format!("{height} {width}")).await;
    }
    // End of input (^D on the TTY) ends the loop, and the command, successfully.
    let status = process.take_status().unwrap();
    stdin.write_all(&[4]).await.unwrap();
    drop(stdin);
    let status = tokio::time::timeout(TIMEOUT, status)
        .await
        .expect("the command ends at the end of input");
    assert_eq!(
        status.as_ref().and_then(|s| s.status.as_deref()),
        Some("Success"),
        "{status:?}"
    );
    process.join().await.unwrap();
}

#[tokio::test]
async fn logs_follow_and_previous_through_the_virtual_node() {
    let setup = setup().await;
    let ticker = "i=0; while true; do echo tick $i; i=$((i+1)); sleep 1; done";
    // Each run counts itself in an emptyDir (it outlives the container) and fails.
    let crasher = "n=$(($(cat /data/runs 2>/dev/null || echo 0) + 1)); echo $n >/data/runs; echo run $n; exit 1";
    let volume = json!({
        "restartPolicy": "Always",
        "volumes": [{"name": "data", "emptyDir": {}}],
        "containers": [{"name": "app", "image": BUSYBOX_IMAGE, "command": ["sh", "-c", crasher],
            "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
    });
    let upper = setup.pair.upper.client().await.unwrap();
    let ns = run_on_real_node(
        setup,
        "real-logs",
        vec![real_pod("ticker", ticker, json!({}))],
    )
    .await;
    let n = ns.name.as_str();

    // -f follows: three consecutive lines as the container prints them, a second apart.
    for kubeconfig in [setup.pair.upper_kubeconfig(), setup.pair.lower_kubeconfig()] {
        let mut follow = Streaming::start(
            &setup.pair,
            kubeconfig,
            &["-n", n, "logs", "-f", "--tail=1", "ticker"],
        );
        let first = follow.next_line().await;
        let start: u64 = first.strip_prefix("tick ").unwrap().parse().unwrap();
        for i in 1..=3 {
            assert_eq!(
                follow.next_line().await,
                format!("tick {}", start + i),
                "{}",
                kubeconfig.display()
            );
        }
        follow.child.kill().await.unwrap();
    }
    // Plain logs: the same lines both ways (the first three, printed before the -f reads
    // above saw three more).
    let [(_, up), (_, down)] =
        both(setup, &["-n", n, "logs", "ticker", "--limit-bytes=21"], b"").await;
    assert!(
        up.status.success() && down.status.success(),
        "{up:?} {down:?}"
    );
    assert_eq!(text(&up.stdout), "tick 0\ntick 1\ntick 2\n", "{up:?}");
    assert_eq!(text(&up.stdout), text(&down.stdout));

    // --previous after a real restart: the previous run's output.
    let pods: Api<Pod> = Api::namespaced(upper, n);
    let crashing = real_pod("crasher", crasher, volume);
    pods.create(&PostParams::default(), &crashing)
        .await
        .unwrap();
    let restarts = |pod: &Pod| -> i32 {
        pod.status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .and_then(|cs| cs.first())
            .map_or(0, |c| c.restart_count)
    };
    wait_for(
        "crasher restarted (reflected upstairs)",
        TIMEOUT,
        || async {
            Ok(pods
                .get_opt("crasher")
                .await?
                .filter(|p| restarts(p) >= 1)
                .map(|_| ()))
        },
    )
    .await
    .unwrap();
    // The two reads agree unless it restarted between them (back-off: 10 s, then 20 s ...).
    let agreed = wait_for(
        "kubectl logs --previous to agree above and below",
        TIMEOUT,
        || async {
            let [(_, up), (_, down)] =
                both(setup, &["-n", n, "logs", "--previous", "crasher"], b"").await;
            let (up, down) = (text(&up.stdout), text(&down.stdout));
            Ok((!up.is_empty() && up == down).then_some(up))
        },
    )
    .await
    .unwrap();
    let run: u32 = agreed.trim().strip_prefix("run ").unwrap().parse().unwrap();
    assert!(run >= 1, "{agreed:?}");
    ns.delete().await.unwrap();
}

#[tokio::test]
async fn port_forward_to_a_real_listener_through_the_virtual_node() {
    let setup = setup().await;
    // busybox nc: a persistent server that runs `cat` (an echo) for each connection.
    let ns = run_on_real_node(
        setup,
        "real-forward",
        vec![real_pod("echo", "exec nc -ll -p 8080 -e cat", json!({}))],
    )
    .await;
    let n = ns.name.as_str();
    for kubeconfig in [setup.pair.upper_kubeconfig(), setup.pair.lower_kubeconfig()] {
        let mut forward = Streaming::start(
            &setup.pair,
            kubeconfig,
            &[
                "-n",
                n,
                "port-forward",
                "pod/echo",
                ":8080",
                "--address=127.0.0.1",
            ],
        );
        // "Forwarding from 127.0.0.1:40123 -> 8080"
        let line = forward.next_line().await;
        let port: u16 = line
            .strip_prefix("Forwarding from 127.0.0.1:")
            .and_then(|rest| rest.split(' ').next())
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("{line:?}"));
        for connection in 0..10 {
            let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .unwrap();
            // More than one read's worth, both ways.
            let message: String = (0..200)
                .map(|i| format!("connection {connection} line {i}\n"))
                .collect();
            let (mut read, mut write) = conn.split();
            let send = async {
                write.write_all(message.as_bytes()).await.unwrap();
            };
            let mut back = vec![0; message.len()];
            let receive = tokio::time::timeout(TIMEOUT, read.read_exact(&mut back));
            let ((), received) = tokio::join!(send, receive);
            received.expect("the echo in time").unwrap();
            assert_eq!(
                text(&back),
                message,
                "{} connection {connection}",
                kubeconfig.display()
            );
        }
        forward.child.kill().await.unwrap();
    }
    ns.delete().await.unwrap();
}

#[tokio::test]
async fn kubectl_cp_both_ways_through_the_virtual_node() {
    let setup = setup().await;
    let ns = run_on_real_node(
        setup,
        "real-cp",
        vec![real_pod("files", "exec sleep 3600", json!({}))],
    )
    .await;
    let n = ns.name.as_str();
    let local = tempfile::tempdir().unwrap();
    let content: String = (0..5000).map(|i| format!("{i} of the file\n")).collect();
    let sent = local.path().join("sent.txt");
    std::fs::write(&sent, &content).unwrap();
    let pair = &setup.pair;
    for (cluster, kubeconfig) in [
        ("upper", pair.upper_kubeconfig()),
        ("lower", pair.lower_kubeconfig()),
    ] {
        // Up to the container ...
        let to = format!("{n}/files:/tmp/{cluster}.txt");
        let out = kubectl(pair, kubeconfig, &["cp", sent.to_str().unwrap(), &to], b"").await;
        assert!(out.status.success(), "{cluster}: {out:?}");
        // ... and back.
        let back = local.path().join(format!("back-{cluster}.txt"));
        let from = format!("{n}/files:/tmp/{cluster}.txt");
        let out = kubectl(
            pair,
            kubeconfig,
            &["cp", &from, back.to_str().unwrap()],
            b"",
        )
        .await;
        assert!(out.status.success(), "{cluster}: {out:?}");
        assert_eq!(
            std::fs::read_to_string(&back).unwrap(),
            content,
            "{cluster}"
        );
    }
    // What went up through the virtual node is in the container, as seen from below.
    let out = kubectl(
        pair,
        pair.lower_kubeconfig(),
        &[
            "-n",
            n,
            "exec",
            "files",
            "--",
            "md5sum",
            "/tmp/upper.txt",
            "/tmp/lower.txt",
        ],
        b"",
    )
    .await;
    let sums: Vec<&str> = std::str::from_utf8(&out.stdout)
        .unwrap()
        .lines()
        .map(|l| l.split(' ').next().unwrap())
        .collect();
    assert_eq!(sums.len(), 2, "{out:?}");
    assert_eq!(sums[0], sums[1], "{out:?}");
    ns.delete().await.unwrap();
}

/// A pod's CPU in millicores from `cluster`'s metrics API (`None` until it has a sample).
async fn pod_cpu(client: &kube::Client, ns: &str, name: &str) -> Option<u64> {
    let request = http::Request::get(format!(
        "/apis/metrics.k8s.io/v1beta1/namespaces/{ns}/pods/{name}"
    ))
    .body(Vec::new())
    .unwrap();
    let metrics: Value = client.request(request).await.ok()?;
    let cpu = metrics["containers"][0]["usage"]["cpu"].as_str()?;
    if let Some(n) = cpu.strip_suffix('n') {
        return n.parse::<u64>().ok().map(|n| n / 1_000_000);
    }
    if let Some(u) = cpu.strip_suffix('u') {
        return u.parse::<u64>().ok().map(|u| u / 1000);
    }
    if let Some(m) = cpu.strip_suffix('m') {
        return m.parse().ok();
    }
    cpu.parse::<u64>().ok().map(|c| c * 1000)
}

/// `--upper-identity` with a real kubelet: the lower pod mounts the token Secret the
/// virtual node keeps (kwok mounts nothing), and what the container reads is an upper
/// token of its upper ServiceAccount bound to its upper pod, the upper CA and the upper
/// namespace, with `kubernetes.default` and the service variables pointing upstairs.
#[tokio::test]
async fn upper_identity_tokens_are_what_a_real_container_reads() {
    let setup = setup().await;
    let pair = &setup.pair;
    let node = "vk-real-identity";
    let address = pair.upper.server.trim_start_matches("https://").to_owned();
    let _vk = start_node(
        pair,
        node,
        &[
            "--upper-identity",
            &format!("--upper-api-address={address}"),
        ],
    )
    .await;
    let script = "d=/var/run/secrets/kubernetes.io/serviceaccount; \
        echo \"token $(cat $d/token)\"; echo \"namespace $(cat $d/namespace)\"; \
        echo \"ca $(head -n 1 $d/ca.crt)\"; \
        echo \"api $KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT\"; \
        echo \"alias $(grep -c kubernetes.default /etc/hosts)\"; exec sleep 3600";
    let pod = real_pod(
        "reader",
        script,
        json!({"nodeName": node, "nodeSelector": {"kubernetes.io/hostname": node},
            "automountServiceAccountToken": true}),
    );
    let ns = run_on_real_node(setup, "real-identity", vec![pod]).await;
    let n = ns.name.as_str();
    let upper = pair.upper.client().await.unwrap();
    let upper_pod = Api::<Pod>::namespaced(upper.clone(), n)
        .get("reader")
        .await
        .unwrap();

    let out = kubectl(
        pair,
        pair.upper_kubeconfig(),
        &["-n", n, "logs", "reader"],
        b"",
    )
    .await;
    assert!(out.status.success(), "{out:?}");
    let printed = text(&out.stdout);
    let read = |what: &str| -> String {
        printed
            .lines()
            .find_map(|l| l.strip_prefix(what)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("no {what} line in {printed:?}"))
            .to_owned()
    };
    assert_eq!(read("namespace"), n);
    assert_eq!(read("ca"), "-----BEGIN CERTIFICATE-----");
    assert_eq!(read("api"), address);
    assert_ne!(read("alias"), "0", "a hostAlias for kubernetes.default");
    let status = common::review(&upper, &read("token"), None).await;
    assert_eq!(status.authenticated, Some(true), "{status:?}");
    let user = status.user.unwrap();
    assert_eq!(
        user.username.as_deref(),
        Some(format!("system:serviceaccount:{n}:default").as_str())
    );
    let bound = user
        .extra
        .as_ref()
        .and_then(|e| e.get("authentication.kubernetes.io/pod-uid"))
        .cloned()
        .unwrap_or_default();
    assert_eq!(bound, vec![upper_pod.metadata.uid.unwrap()], "{user:?}");
    ns.delete().await.unwrap();
}

#[tokio::test]
async fn metrics_show_the_cpu_of_a_real_container_rising() {
    let setup = setup().await;
    // Idle until /tmp/burn exists, then burning a core.
    let burner = "while true; do if [ -e /tmp/burn ]; then :; else sleep 1; fi; done";
    let ns = run_on_real_node(
        setup,
        "real-metrics",
        vec![real_pod("burner", burner, json!({}))],
    )
    .await;
    let n = ns.name.as_str();
    let lower = setup.pair.lower.client().await.unwrap();
    let upper = setup.pair.upper.client().await.unwrap();
    // Idle first: the lower metrics-server has read the real kubelet's /metrics/resource.
    let idle = wait_for(
        "an idle sample of burner below",
        METRICS_TIMEOUT,
        || async { Ok(pod_cpu(&lower, n, "burner").await.filter(|cpu| *cpu < 100)) },
    )
    .await;
    if let Err(error) = idle {
        panic!("{error:#}\n{}", setup.real.logs_tail(30));
    }
    let out = kubectl(
        &setup.pair,
        setup.pair.upper_kubeconfig(),
        &["-n", n, "exec", "burner", "--", "touch", "/tmp/burn"],
        b"",
    )
    .await;
    assert!(out.status.success(), "{out:?}");
    // Then burning, below and upstairs (the virtual node's /metrics/resource, read by the
    // upper metrics-server, carries the lower usage up).
    for (cluster, client) in [("lower", &lower), ("upper", &upper)] {
        wait_for(
            &format!("burner above 300m ({cluster})"),
            METRICS_TIMEOUT,
            || async { Ok(pod_cpu(client, n, "burner").await.filter(|cpu| *cpu >= 300)) },
        )
        .await
        .unwrap();
    }
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(lower.clone());
    let real = nodes.get(REAL_NODE).await.unwrap();
    let labels = real.metadata.labels.unwrap_or_default();
    assert_eq!(
        labels
            .get(tensile_harness::real_node::REAL_NODE_LABEL)
            .map(String::as_str),
        Some("true")
    );
    // Nothing else runs on the real node: only this binary's pods (the placement) land there.
    let on_real = Api::<Pod>::all(lower)
        .list(&ListParams::default().fields(&format!("spec.nodeName={REAL_NODE}")))
        .await
        .unwrap();
    for pod in on_real.items {
        let ns = pod.metadata.namespace.unwrap_or_default();
        assert!(
            ns.starts_with("real-"),
            "{ns}/{:?} on the real node",
            pod.metadata.name
        );
    }
    ns.delete().await.unwrap();
}

/// The status of a pod while it terminates reaches the upper pod, as a kubelet writes it:
/// Ready turns False while the lower pod still runs (its readiness probe fails once it got
/// TERM), and, the upper pod held by a finalizer, its container shows how it ended (exit
/// code, finishedAt) once the lower pod is gone. Kubernetes' "should mark readiness on pods
/// to false while pod is in progress of terminating" and the Lifecycle Sleep Hook tests.
#[tokio::test]
async fn a_terminating_pod_shows_not_ready_then_its_terminated_container() {
    use k8s_openapi::api::core::v1::ContainerStateTerminated;
    use kube::api::{DeleteParams, Patch, PatchParams};

    const FINALIZER: &str = "example.com/hold";
    let setup = setup().await;
    // As Kubernetes' test has it: the probe starts after 5 s, and the pod is deleted
    // once Ready.
    // A TCP probe: this node's exec probes of a terminating container error (context
    // canceled), which leaves readiness as it was.
    let script = "nc -ll -p 8080 -e true & listener=$!; \
                  trap 'kill $listener; sleep 15; exit 0' TERM; \
                  while true; do sleep 1; done";
    let mut pod = real_pod(
        "ending",
        script,
        json!({
            "terminationGracePeriodSeconds": 30,
            "containers": [{
                "name": "app",
                "image": BUSYBOX_IMAGE,
                "command": ["sh", "-c", script],
                "readinessProbe": {"tcpSocket": {"port": 8080},
                                   "initialDelaySeconds": 5, "periodSeconds": 2,
                                   "failureThreshold": 1},
            }],
        }),
    );
    pod.metadata.finalizers = Some(vec![FINALIZER.to_owned()]);
    let ns = run_on_real_node(setup, "real-ending", vec![pod]).await;
    let upper = setup.pair.upper.client().await.unwrap();
    let lower = setup.pair.lower.client().await.unwrap();
    let upper_pods: Api<Pod> = Api::namespaced(upper, &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower, &ns.name);
    let ready = |pod: &Pod| {
        pod.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
            .map(|c| c.status.clone())
    };
    wait_for("the upper pod Ready", TIMEOUT, || async {
        let pod = upper_pods.get("ending").await?;
        Ok((ready(&pod).as_deref() == Some("True")).then_some(()))
    })
    .await
    .unwrap();

    upper_pods
        .delete("ending", &DeleteParams::default())
        .await
        .unwrap();
    // Not Ready upstairs while the container still runs below (15 s after TERM).
    wait_for(
        "the upper pod not Ready while the lower one runs",
        TIMEOUT,
        || async {
            let pod = upper_pods.get("ending").await?;
            if ready(&pod).as_deref() != Some("False") {
                return Ok(None);
            }
            let below = lower_pods.get_opt("ending").await?;
            let still_running = below.as_ref().is_some_and(|p| {
                p.status
                    .as_ref()
                    .and_then(|s| s.container_statuses.as_ref())
                    .is_some_and(|c| {
                        c.iter()
                            .any(|c| c.state.as_ref().is_some_and(|s| s.running.is_some()))
                    })
            });
            assert!(
                still_running,
                "Ready False reached upstairs only once the container had stopped below: {:?}",
                below.and_then(|p| p.status)
            );
            Ok(Some(()))
        },
    )
    .await
    .unwrap();

    // The lower pod goes; the upper one stays for its finalizer, showing how it ended.
    let terminated = wait_for("the upper container terminated", TIMEOUT, || async {
        let pod = upper_pods.get("ending").await?;
        let state: Option<ContainerStateTerminated> = pod
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .and_then(|c| c.first())
            .and_then(|c| c.state.as_ref())
            .and_then(|s| s.terminated.clone());
        let gone_below = lower_pods.get_opt("ending").await?.is_none();
        Ok(state.filter(|_| gone_below).map(|t| (t, pod)))
    })
    .await;
    let (state, pod) = match terminated {
        Ok(found) => found,
        Err(error) => {
            let pod = upper_pods.get("ending").await.unwrap();
            panic!("{error:#}\nupper status: {:?}", pod.status);
        }
    };
    assert_eq!(state.exit_code, 0, "{state:?}");
    assert!(state.finished_at.is_some(), "{state:?}");
    assert_eq!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded"),
        "{:?}",
        pod.status
    );
    assert_eq!(ready(&pod).as_deref(), Some("False"));

    let release = json!({"metadata": {"finalizers": null}});
    upper_pods
        .patch("ending", &PatchParams::default(), &Patch::Merge(&release))
        .await
        .unwrap();
    wait_for("the upper pod gone", TIMEOUT, || async {
        Ok(upper_pods.get_opt("ending").await?.is_none().then_some(()))
    })
    .await
    .unwrap();
    ns.delete().await.unwrap();
}

/// The resources a container status reports (`status.containerStatuses[0].resources`), as
/// JSON, and the pod's resize conditions (type, reason).
fn reported(pod: &Pod) -> (Value, Vec<(String, Option<String>)>) {
    let status = pod.status.clone().unwrap_or_default();
    let resources = status
        .container_statuses
        .as_ref()
        .and_then(|c| c.first())
        .and_then(|c| c.resources.clone());
    let conditions = status
        .conditions
        .iter()
        .flatten()
        .filter(|c| c.type_.starts_with("PodResize"))
        .map(|c| (c.type_.clone(), c.reason.clone()))
        .collect();
    (serde_json::to_value(resources).unwrap(), conditions)
}

/// `kubectl patch pod <name> --subresource resize` upstairs, as a user resizes a pod.
async fn kubectl_resize(setup: &Setup, ns: &str, name: &str, resources: &Value) {
    let patch = json!({"spec": {"containers": [{"name": "app", "resources": resources}]}});
    let out = kubectl(
        &setup.pair,
        setup.pair.upper_kubeconfig(),
        &[
            "-n",
            ns,
            "patch",
            "pod",
            name,
            "--subresource",
            "resize",
            "-p",
            &patch.to_string(),
        ],
        b"",
    )
    .await;
    assert!(
        out.status.success(),
        "kubectl patch --subresource resize: {}",
        text(&out.stderr)
    );
}

#[tokio::test]
async fn a_resize_on_the_virtual_node_is_actuated_deferred_or_infeasible_as_a_kubelet_says() {
    let setup = setup().await;
    let small = json!({"requests": {"cpu": "100m", "memory": "32Mi"},
                       "limits": {"cpu": "200m", "memory": "64Mi"}});
    let pod = real_pod(
        "resized",
        "while true; do sleep 1; done",
        json!({"containers": [{"name": "app", "image": BUSYBOX_IMAGE,
                               "command": ["sh", "-c", "while true; do sleep 1; done"],
                               "resources": small}]}),
    );
    let ns = run_on_real_node(setup, "real-resize", vec![pod]).await;
    let upper_pods: Api<Pod> = Api::namespaced(setup.pair.upper.client().await.unwrap(), &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(setup.pair.lower.client().await.unwrap(), &ns.name);
    let before_upper = upper_pods.get("resized").await.unwrap();
    let before_lower = lower_pods.get("resized").await.unwrap();

    // Within the node: actuated below in place, reported upstairs, the generation observed.
    let bigger = json!({"requests": {"cpu": "150m", "memory": "48Mi"},
                        "limits": {"cpu": "300m", "memory": "96Mi"}});
    kubectl_resize(setup, &ns.name, "resized", &bigger).await;
    let resized = wait_for(
        "the resize reported upstairs, done, its generation observed",
        TIMEOUT,
        || async {
            let pod = upper_pods.get("resized").await?;
            let (resources, conditions) = reported(&pod);
            let observed = pod.status.as_ref().and_then(|s| s.observed_generation);
            Ok((resources == bigger
                && conditions.is_empty()
                && observed.is_some()
                && observed == pod.metadata.generation)
                .then_some(pod))
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", setup.real.logs_tail(20)));
    let after_lower = lower_pods.get("resized").await.unwrap();
    assert_eq!(
        resized.metadata.uid, before_upper.metadata.uid,
        "the same upper pod"
    );
    assert_eq!(
        after_lower.metadata.uid, before_lower.metadata.uid,
        "the same lower pod: resized, not recreated"
    );
    let restarts = |pod: &Pod| {
        pod.status
            .as_ref()
            .unwrap()
            .container_statuses
            .as_ref()
            .unwrap()[0]
            .restart_count
    };
    assert_eq!(
        (restarts(&resized), restarts(&after_lower)),
        (0, 0),
        "resized without a restart"
    );
    let lower_spec =
        serde_json::to_value(&after_lower.spec.as_ref().unwrap().containers[0].resources).unwrap();
    assert_eq!(
        lower_spec, bigger,
        "the lower copy's spec carries the resize"
    );

    // More than the virtual node has left beside another pod's requests (within its
    // allocatable: the upper API server refuses a resize beyond that itself): deferred by
    // the virtual node, as a kubelet defers it, and nothing written below. The other pod
    // runs on a kwok node below.
    let mut filler = bound_pod("filler", NODE);
    filler.spec.as_mut().unwrap().containers[0].resources = Some(
        serde_json::from_value(json!({"requests": {"cpu": "2"}, "limits": {"cpu": "2"}})).unwrap(),
    );
    upper_pods
        .create(&PostParams::default(), &filler)
        .await
        .unwrap();
    wait_for("the filler pod copied below", TIMEOUT, || async {
        Ok(lower_pods.get_opt("filler").await?.map(|_| ()))
    })
    .await
    .unwrap();
    let nodes: Api<k8s_openapi::api::core::v1::Node> =
        Api::all(setup.pair.upper.client().await.unwrap());
    let allocatable = nodes
        .get(NODE)
        .await
        .unwrap()
        .status
        .unwrap()
        .allocatable
        .unwrap();
    let millis = |q: &str| -> i64 {
        q.strip_suffix('m')
            .map_or_else(|| q.parse::<i64>().unwrap() * 1000, |m| m.parse().unwrap())
    };
    let cpu = format!("{}m", millis(&allocatable["cpu"].0) - 1000);
    let huge = json!({"requests": {"cpu": cpu, "memory": "48Mi"},
                      "limits": {"cpu": cpu, "memory": "96Mi"}});
    kubectl_resize(setup, &ns.name, "resized", &huge).await;
    let deferred = wait_for("PodResizePending Deferred upstairs", TIMEOUT, || async {
        let pod = upper_pods.get("resized").await?;
        let (_, conditions) = reported(&pod);
        Ok(
            (conditions == [("PodResizePending".to_owned(), Some("Deferred".to_owned()))])
                .then_some(pod),
        )
    })
    .await
    .unwrap();
    let condition = deferred
        .status
        .as_ref()
        .unwrap()
        .conditions
        .as_ref()
        .unwrap()
        .iter()
        .find(|c| c.type_ == "PodResizePending")
        .unwrap()
        .clone();
    assert!(
        condition
            .message
            .as_deref()
            .unwrap_or_default()
            .starts_with("Node didn't have enough resource: cpu, requested: "),
        "the kubelet's words: {:?}",
        condition.message
    );
    assert_eq!(
        condition.observed_generation, deferred.metadata.generation,
        "decided on this generation"
    );
    let below = lower_pods.get("resized").await.unwrap();
    assert_eq!(
        serde_json::to_value(&below.spec.as_ref().unwrap().containers[0].resources).unwrap(),
        bigger,
        "a deferred resize is not carried"
    );

    // Undone upstairs: the condition goes, the pod keeps running as it was.
    kubectl_resize(setup, &ns.name, "resized", &bigger).await;
    wait_for(
        "PodResizePending gone once the resize is undone",
        TIMEOUT,
        || async {
            let pod = upper_pods.get("resized").await?;
            let (resources, conditions) = reported(&pod);
            let observed = pod.status.as_ref().and_then(|s| s.observed_generation);
            Ok((conditions.is_empty()
                && resources == bigger
                && observed == pod.metadata.generation)
                .then_some(()))
        },
    )
    .await
    .unwrap();

    // Refused below (a LimitRange of the lower namespace's, which the upper one lacks): the
    // virtual node admits it, the lower API server does not, so it is Infeasible upstairs
    // with the lower refusal's words, as a kubelet reports a resize it cannot actuate.
    let lower_client = setup.pair.lower.client().await.unwrap();
    let limits: Api<k8s_openapi::api::core::v1::LimitRange> =
        Api::namespaced(lower_client, &ns.name);
    let limit: k8s_openapi::api::core::v1::LimitRange = serde_json::from_value(json!({
        "metadata": {"name": "at-most-350m"},
        "spec": {"limits": [{"type": "Container", "max": {"cpu": "350m"}}]},
    }))
    .unwrap();
    limits.create(&PostParams::default(), &limit).await.unwrap();
    let refused_below = json!({"requests": {"cpu": "150m", "memory": "48Mi"},
                               "limits": {"cpu": "400m", "memory": "96Mi"}});
    let dry_run = kube::api::PatchParams {
        dry_run: true,
        ..Default::default()
    };
    let resize_below =
        json!({"spec": {"containers": [{"name": "app", "resources": refused_below}]}});
    wait_for("the lower LimitRange in force", TIMEOUT, || async {
        let result = lower_pods
            .patch_subresource(
                "resize",
                "resized",
                &dry_run,
                &kube::api::Patch::Strategic(&resize_below),
            )
            .await;
        Ok(matches!(result, Err(kube::Error::Api(ref s)) if s.code == 403).then_some(()))
    })
    .await
    .unwrap();
    kubectl_resize(setup, &ns.name, "resized", &refused_below).await;
    let infeasible = wait_for("PodResizePending Infeasible upstairs", TIMEOUT, || async {
        let pod = upper_pods.get("resized").await?;
        let (_, conditions) = reported(&pod);
        Ok(
            (conditions == [("PodResizePending".to_owned(), Some("Infeasible".to_owned()))])
                .then_some(pod),
        )
    })
    .await
    .unwrap();
    let message = infeasible
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "PodResizePending"))
        .and_then(|c| c.message.clone())
        .unwrap_or_default();
    assert!(
        message.starts_with("the lower cluster refused the resize: ")
            && message.contains("maximum cpu usage per Container is 350m"),
        "the lower refusal's words: {message:?}"
    );
    let events: Api<k8s_openapi::api::core::v1::Event> =
        Api::namespaced(setup.pair.upper.client().await.unwrap(), &ns.name);
    wait_for(
        "a ResizeInfeasible Event on the upper pod",
        TIMEOUT,
        || async {
            let found = events
                .list(&ListParams::default().fields("involvedObject.name=resized"))
                .await?
                .items
                .iter()
                .any(|e| e.reason.as_deref() == Some("ResizeInfeasible"));
            Ok(found.then_some(()))
        },
    )
    .await
    .unwrap();
    let below = lower_pods.get("resized").await.unwrap();
    assert_eq!(
        serde_json::to_value(&below.spec.as_ref().unwrap().containers[0].resources).unwrap(),
        bigger,
        "a refused resize leaves the lower copy as it was"
    );
}
