//! Certificates and kubeconfigs for one local cluster: a CA, the API server's serving
//! certificate, client certificates for each component, the service-account signing key,
//! and the kubelet pair that lets the API server reach a virtual node's kubelet API.

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

/// A client identity: the certificate and key files for one user.
#[derive(Clone, Debug)]
pub struct ClientCert {
    /// PEM certificate.
    pub cert: PathBuf,
    /// PEM private key.
    pub key: PathBuf,
}

/// Every file of a cluster's PKI, written under `<cluster dir>/pki`.
#[derive(Clone, Debug)]
pub struct Pki {
    /// The cluster's name.
    pub name: String,
    /// The directory the files are in.
    pub dir: PathBuf,
    /// The cluster CA: signs every certificate below and verifies clients.
    pub ca_cert: PathBuf,
    /// The CA key (kube-controller-manager signs CSRs with it).
    pub ca_key: PathBuf,
    /// kube-apiserver's serving certificate.
    pub apiserver: ClientCert,
    /// `system:masters` administrator.
    pub admin: ClientCert,
    /// `system:kube-controller-manager`.
    pub controller_manager: ClientCert,
    /// `system:kube-scheduler`.
    pub scheduler: ClientCert,
    /// The client certificate kube-apiserver presents to kubelets (and virtual nodes).
    pub apiserver_kubelet_client: ClientCert,
    /// A serving certificate for a kubelet API on loopback (virtual-node's), signed by the CA
    /// that kube-apiserver trusts for kubelets.
    pub kubelet_serving: ClientCert,
    /// Service-account token signing key (PKCS#8) and its public half.
    pub service_account_key: PathBuf,
    /// Public key matching `service_account_key`.
    pub service_account_pub: PathBuf,
}

struct Ca {
    issuer: Issuer<'static, KeyPair>,
}

/// The CA's parameters; rebuilt identically, with its key, they make the same issuer.
fn ca_params(name: &str) -> Result<CertificateParams> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(DnType::CommonName, format!("tensile-harness-{name}-ca"));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    Ok(params)
}

impl Ca {
    fn new(name: &str) -> Result<(Self, String, String)> {
        let key = KeyPair::generate()?;
        let params = ca_params(name)?;
        let cert = params.self_signed(&key)?;
        let key_pem = key.serialize_pem();
        Ok((
            Self {
                issuer: Issuer::new(params, key),
            },
            cert.pem(),
            key_pem,
        ))
    }

    /// Issues a leaf certificate; `user`/`groups` become CN/O, `sans` the subject alt names.
    fn issue(
        &self,
        user: &str,
        groups: &[&str],
        sans: &[&str],
        usage: ExtendedKeyUsagePurpose,
    ) -> Result<(String, String)> {
        self.issue_with(
            user,
            groups,
            sans,
            usage,
            CertificateParams::new(Vec::<String>::new())?,
        )
    }

    fn issue_with(
        &self,
        user: &str,
        groups: &[&str],
        sans: &[&str],
        usage: ExtendedKeyUsagePurpose,
        mut params: CertificateParams,
    ) -> Result<(String, String)> {
        let key = KeyPair::generate()?;
        params.distinguished_name.push(DnType::CommonName, user);
        for group in groups {
            params
                .distinguished_name
                .push(DnType::OrganizationName, *group);
        }
        params.subject_alt_names = sans
            .iter()
            .map(|san| match san.parse::<IpAddr>() {
                Ok(ip) => Ok(SanType::IpAddress(ip)),
                Err(_) => Ok(SanType::DnsName((*san).try_into()?)),
            })
            .collect::<Result<_, rcgen::Error>>()?;
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![usage];
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok((cert.pem(), key.serialize_pem()))
    }
}

fn write(path: &Path, contents: &str) -> Result<()> {
    std::fs::write(path, contents).with_context(|| format!("writing {}", path.display()))
}

fn write_pair(dir: &Path, name: &str, (cert, key): (String, String)) -> Result<ClientCert> {
    let pair = ClientCert {
        cert: dir.join(format!("{name}.crt")),
        key: dir.join(format!("{name}.key")),
    };
    write(&pair.cert, &cert)?;
    write(&pair.key, &key)?;
    Ok(pair)
}

impl Pki {
    /// Generates a fresh PKI for the cluster `name` under `dir`; `service_ip` is the first
    /// address of the cluster's service range (the `kubernetes` Service); `host_ips` are
    /// more addresses the API server's certificate names (where pods reach it).
    pub fn generate(
        dir: &Path,
        name: &str,
        service_ip: Ipv4Addr,
        host_ips: &[Ipv4Addr],
    ) -> Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let (ca, ca_cert_pem, ca_key_pem) = Ca::new(name)?;
        let ca_cert = dir.join("ca.crt");
        let ca_key = dir.join("ca.key");
        write(&ca_cert, &ca_cert_pem)?;
        write(&ca_key, &ca_key_pem)?;

        let service_ip = service_ip.to_string();
        let host_ips: Vec<String> = host_ips.iter().map(ToString::to_string).collect();
        let mut apiserver_names = vec![
            "127.0.0.1",
            "localhost",
            &service_ip,
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local",
        ];
        apiserver_names.extend(host_ips.iter().map(String::as_str));
        let server = ExtendedKeyUsagePurpose::ServerAuth;
        let client = || ExtendedKeyUsagePurpose::ClientAuth;
        let apiserver = write_pair(
            dir,
            "apiserver",
            ca.issue("kube-apiserver", &[], &apiserver_names, server.clone())?,
        )?;
        let admin = write_pair(
            dir,
            "admin",
            ca.issue("kubernetes-admin", &["system:masters"], &[], client())?,
        )?;
        let controller_manager = write_pair(
            dir,
            "controller-manager",
            ca.issue("system:kube-controller-manager", &[], &[], client())?,
        )?;
        let scheduler = write_pair(
            dir,
            "scheduler",
            ca.issue("system:kube-scheduler", &[], &[], client())?,
        )?;
        let apiserver_kubelet_client = write_pair(
            dir,
            "apiserver-kubelet-client",
            ca.issue(
                "kube-apiserver-kubelet-client",
                &["system:masters"],
                &[],
                client(),
            )?,
        )?;
        let kubelet_serving = write_pair(
            dir,
            "kubelet-serving",
            ca.issue(
                "tensile-virtual-node",
                &[],
                &["127.0.0.1", "localhost"],
                server,
            )?,
        )?;

        let sa = KeyPair::generate()?;
        let service_account_key = dir.join("sa.key");
        let service_account_pub = dir.join("sa.pub");
        write(&service_account_key, &sa.serialize_pem())?;
        write(&service_account_pub, &sa.public_key_pem())?;

        Ok(Self {
            name: name.to_owned(),
            dir: dir.to_owned(),
            ca_cert,
            ca_key,
            apiserver,
            admin,
            controller_manager,
            scheduler,
            apiserver_kubelet_client,
            kubelet_serving,
            service_account_key,
            service_account_pub,
        })
    }
}

impl Pki {
    /// Issues a client certificate for `user` in `groups`, signed by the cluster CA.
    pub fn issue_client(&self, user: &str, groups: &[&str]) -> Result<ClientCert> {
        let key_pem = std::fs::read_to_string(&self.ca_key)
            .with_context(|| format!("reading {}", self.ca_key.display()))?;
        let ca = Ca {
            issuer: Issuer::new(ca_params(&self.name)?, KeyPair::from_pem(&key_pem)?),
        };
        let file = format!(
            "user-{}",
            user.replace(|c: char| !c.is_ascii_alphanumeric(), "-")
        );
        write_pair(
            &self.dir,
            &file,
            ca.issue(user, groups, &[], ExtendedKeyUsagePurpose::ClientAuth)?,
        )
    }

    /// Issues a serving certificate for `name` valid for `sans` (addresses or DNS names),
    /// signed by the cluster CA: a real kubelet's, which the API server verifies.
    pub fn issue_serving(&self, name: &str, sans: &[&str]) -> Result<ClientCert> {
        let key_pem = std::fs::read_to_string(&self.ca_key)
            .with_context(|| format!("reading {}", self.ca_key.display()))?;
        let ca = Ca {
            issuer: Issuer::new(ca_params(&self.name)?, KeyPair::from_pem(&key_pem)?),
        };
        let file = format!(
            "serving-{}",
            name.replace(|c: char| !c.is_ascii_alphanumeric(), "-")
        );
        write_pair(
            &self.dir,
            &file,
            ca.issue(name, &[], sans, ExtendedKeyUsagePurpose::ServerAuth)?,
        )
    }

    /// Issues a client certificate for `user` that expired in 2001 (signed by the cluster
    /// CA, so only its dates are wrong).
    pub fn issue_expired_client(&self, user: &str) -> Result<ClientCert> {
        let key_pem = std::fs::read_to_string(&self.ca_key)
            .with_context(|| format!("reading {}", self.ca_key.display()))?;
        let ca = Ca {
            issuer: Issuer::new(ca_params(&self.name)?, KeyPair::from_pem(&key_pem)?),
        };
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.not_before = rcgen::date_time_ymd(2000, 1, 1);
        params.not_after = rcgen::date_time_ymd(2001, 1, 1);
        let file = format!(
            "expired-{}",
            user.replace(|c: char| !c.is_ascii_alphanumeric(), "-")
        );
        write_pair(
            &self.dir,
            &file,
            ca.issue_with(user, &[], &[], ExtendedKeyUsagePurpose::ClientAuth, params)?,
        )
    }
}

/// Writes a kubeconfig (JSON, which every client reads as YAML) for `user` against `server`,
/// the certificates and key inline (`*-data`), as `virtual-node join` writes them: a member
/// Secret may hold no file paths.
pub fn write_kubeconfig(
    path: &Path,
    cluster: &str,
    server: &str,
    ca: &Path,
    user: &ClientCert,
) -> Result<()> {
    let inline = |file: &Path| -> Result<serde_json::Value> {
        let bytes = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
        Ok(serde_json::to_value(k8s_openapi::ByteString(bytes))?)
    };
    let config = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": cluster, "cluster": {
            "server": server,
            "certificate-authority-data": inline(ca)?,
        }}],
        "users": [{"name": cluster, "user": {
            "client-certificate-data": inline(&user.cert)?,
            "client-key-data": inline(&user.key)?,
        }}],
        "contexts": [{"name": cluster, "context": {"cluster": cluster, "user": cluster}}],
        "current-context": cluster,
    });
    write(path, &serde_json::to_string_pretty(&config)?)
}

/// Has `tensile-webhook` (`bin`) generate its serving certificate for 127.0.0.1 into `dir`
/// with the generator the project ships (`gen-certs`), and returns the CA bundle it
/// prints (base64 PEM, for a webhook configuration's `caBundle`).
pub fn webhook_serving_certs(bin: &Path, dir: &Path) -> Result<String> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let generated = std::process::Command::new(bin)
        .args(["gen-certs", "--host", "127.0.0.1", "--days", "2", "--out"])
        .arg(dir)
        .output()
        .with_context(|| format!("running {} gen-certs", bin.display()))?;
    anyhow::ensure!(
        generated.status.success(),
        "{} gen-certs failed: {}",
        bin.display(),
        String::from_utf8_lossy(&generated.stderr)
    );
    Ok(String::from_utf8(generated.stdout)
        .context("gen-certs printed no UTF-8")?
        .trim()
        .to_owned())
}
