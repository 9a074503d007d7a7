//! `tensile-webhook gen-certs`: a CA and a serving certificate for the webhook's Service,
//! for clusters without cert-manager.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

/// Why certificates could not be made or written.
#[derive(thiserror::Error, Debug)]
pub enum CertError {
    /// rcgen refused a parameter (e.g. an invalid DNS name).
    #[error("generating certificates: {0}")]
    Generate(#[from] rcgen::Error),
    /// A file could not be written.
    #[error("writing {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// A CA and a serving certificate signed by it, all PEM.
#[derive(Debug, Clone)]
pub struct Certs {
    /// The CA certificate: the webhook configuration's `caBundle`.
    pub ca_pem: String,
    /// The serving certificate.
    pub cert_pem: String,
    /// Its private key.
    pub key_pem: String,
}

impl Certs {
    /// The `caBundle` value: the CA certificate, base64.
    pub fn ca_bundle(&self) -> String {
        base64::engine::general_purpose::STANDARD.encode(&self.ca_pem)
    }

    /// Writes `ca.crt`, `tls.crt` and `tls.key` (mode 0600) into `dir`, creating it.
    pub fn write(&self, dir: &Path) -> Result<(), CertError> {
        let write = |name: &str, content: &str, private: bool| {
            let path = dir.join(name);
            let result = write_file(&path, content.as_bytes(), private);
            result.map_err(|source| CertError::Write { path, source })
        };
        std::fs::create_dir_all(dir).map_err(|source| CertError::Write {
            path: dir.to_owned(),
            source,
        })?;
        write("ca.crt", &self.ca_pem, false)?;
        write("tls.crt", &self.cert_pem, false)?;
        write("tls.key", &self.key_pem, true)
    }
}

fn write_file(path: &Path, content: &[u8], private: bool) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    if private {
        options.mode(0o600);
    }
    options.open(path)?.write_all(content)
}

/// The names a Service is reached by inside the cluster.
pub fn service_names(service: &str, namespace: &str) -> Vec<String> {
    vec![
        service.to_owned(),
        format!("{service}.{namespace}"),
        format!("{service}.{namespace}.svc"),
        format!("{service}.{namespace}.svc.cluster.local"),
    ]
}

/// Longest validity accepted, in days.
pub const MAX_DAYS: u32 = 36_500;

/// A CA and a serving certificate for `names` (DNS names, or IP addresses), valid from the
/// start of yesterday (UTC, so a clock slightly behind accepts it) for `days` more days
/// (at most [`MAX_DAYS`]).
pub fn generate(common_name: &str, names: &[String], days: u32) -> Result<Certs, CertError> {
    let at = |day: i64| {
        let (y, m, d) = civil_from_days(day);
        rcgen::date_time_ymd(y, m, d)
    };
    let today = today();
    let (not_before, not_after) = (at(today - 1), at(today + i64::from(days.min(MAX_DAYS))));

    let ca_key = KeyPair::generate()?;
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.distinguished_name
        .push(DnType::CommonName, format!("{common_name} CA"));
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    (ca.not_before, ca.not_after) = (not_before, not_after);
    let ca_cert = ca.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca, ca_key);

    let key = KeyPair::generate()?;
    let mut leaf = CertificateParams::new(Vec::<String>::new())?;
    leaf.distinguished_name
        .push(DnType::CommonName, common_name);
    for name in names {
        leaf.subject_alt_names.push(match name.parse::<IpAddr>() {
            Ok(ip) => SanType::IpAddress(ip),
            Err(_) => SanType::DnsName(name.clone().try_into()?),
        });
    }
    leaf.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    (leaf.not_before, leaf.not_after) = (not_before, not_after);
    let cert = leaf.signed_by(&key, &issuer)?;

    Ok(Certs {
        ca_pem: ca_cert.pem(),
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// Days since 1970-01-01, UTC.
fn today() -> i64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    i64::try_from(now / 86_400).unwrap_or(0)
}

/// Proleptic Gregorian date of a day number since 1970-01-01 (H. Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i32, u8, u8) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (
        i32::try_from(year).unwrap_or(i32::MAX),
        u8::try_from(month).unwrap_or(1),
        u8::try_from(day).unwrap_or(1),
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn civil_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(59), (1970, 3, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(20_000), (2024, 10, 4));
    }

    #[test]
    fn generates_a_pair_rustls_serves() {
        let mut names = service_names("tensile-webhook", "tensile-system");
        names.push("127.0.0.1".into());
        let certs = generate("tensile-webhook", &names, 365).unwrap();
        crate::tls::certified_key(certs.cert_pem.as_bytes(), certs.key_pem.as_bytes(), "test")
            .unwrap();
        assert!(certs.ca_pem.starts_with("-----BEGIN CERTIFICATE-----"));
        let dir = tempfile::tempdir().unwrap();
        certs.write(dir.path()).unwrap();
        for file in ["ca.crt", "tls.crt", "tls.key"] {
            assert!(dir.path().join(file).exists(), "{file}");
        }
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join("tls.key"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }
}
