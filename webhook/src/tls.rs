//! The serving certificate: read from PEM files, and swapped in when the files change on
//! disk (a renewed Secret, cert-manager), without dropping connections or restarting.

use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use rustls::ServerConfig;
use rustls::crypto::CryptoProvider;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::metrics::Metrics;

/// Why a certificate could not be loaded.
#[derive(thiserror::Error, Debug)]
pub enum TlsError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// No certificate in the PEM.
    #[error("{what}: no PEM certificate found")]
    NoCertificate {
        /// Which file or input.
        what: String,
    },
    /// The PEM could not be parsed.
    #[error("{what}: {source}")]
    Pem {
        /// Which file or input.
        what: String,
        /// Why.
        source: rustls_pki_types::pem::Error,
    },
    /// rustls refused the key or certificate (unsupported key, key not matching).
    #[error("{what}: {source}")]
    Rustls {
        /// Which file or input.
        what: String,
        /// Why.
        source: rustls::Error,
    },
}

/// The crypto provider used for serving (ring, as everywhere in tensile).
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Parses a PEM certificate chain and private key into a key rustls can serve, checking
/// that they belong together.
pub fn certified_key(
    cert_pem: &[u8],
    key_pem: &[u8],
    what: &str,
) -> Result<CertifiedKey, TlsError> {
    let chain = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsError::Pem {
            what: what.to_owned(),
            source,
        })?;
    if chain.is_empty() {
        return Err(TlsError::NoCertificate {
            what: what.to_owned(),
        });
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|source| TlsError::Pem {
        what: what.to_owned(),
        source,
    })?;
    CertifiedKey::from_der(chain, key, &provider()).map_err(|source| TlsError::Rustls {
        what: what.to_owned(),
        source,
    })
}

/// Reads and parses the certificate and key files.
pub fn load(cert: &Path, key: &Path) -> Result<(CertifiedKey, Vec<u8>), TlsError> {
    let read = |path: &Path| {
        std::fs::read(path).map_err(|source| TlsError::Read {
            path: path.to_owned(),
            source,
        })
    };
    let (cert_pem, key_pem) = (read(cert)?, read(key)?);
    let what = format!("{} / {}", cert.display(), key.display());
    let loaded = certified_key(&cert_pem, &key_pem, &what)?;
    Ok((loaded, [cert_pem, key_pem].concat()))
}

/// The certificate handed to each new TLS connection; replaced atomically on reload.
#[derive(Debug)]
pub struct ReloadingCert {
    current: RwLock<Arc<CertifiedKey>>,
}

impl ReloadingCert {
    /// Starts with `key`.
    pub fn new(key: CertifiedKey) -> Self {
        Self {
            current: RwLock::new(Arc::new(key)),
        }
    }

    /// Serves `key` from now on.
    pub fn replace(&self, key: CertifiedKey) {
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(key);
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(
            self.current
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
        )
    }
}

/// A TLS 1.2/1.3 server configuration serving HTTP/1.1 with `cert`.
pub fn server_config(cert: Arc<ReloadingCert>) -> Result<Arc<ServerConfig>, rustls::Error> {
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_cert_resolver(cert);
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Re-reads the files every `interval` and swaps the certificate in when their content
/// changed and parses. A half-written pair fails to parse or to match and is retried at
/// the next tick while the previous certificate stays in use. Runs until `shutdown`.
pub async fn watch(
    cert: PathBuf,
    key: PathBuf,
    mut loaded: Vec<u8>,
    target: Arc<ReloadingCert>,
    metrics: Arc<Metrics>,
    interval: Duration,
    shutdown: CancellationToken,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_error = None;
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let (c, k) = (cert.clone(), key.clone());
        let read = tokio::task::spawn_blocking(move || {
            Ok::<_, std::io::Error>([std::fs::read(&c)?, std::fs::read(&k)?].concat())
        })
        .await;
        let Ok(Ok(bytes)) = read else {
            // Unreadable for a moment while a Secret volume swaps its files; retried.
            continue;
        };
        if bytes == loaded {
            continue;
        }
        match load(&cert, &key) {
            Ok((fresh, bytes)) => {
                target.replace(fresh);
                loaded = bytes;
                last_error = None;
                metrics.cert_reloads.inc();
                info!(cert = %cert.display(), "serving certificate reloaded");
            }
            Err(error) => {
                let message = error.to_string();
                if last_error.as_ref() != Some(&message) {
                    metrics.cert_reload_errors.inc();
                    warn!(%error, "certificate changed on disk but cannot be loaded; keeping the previous one");
                    last_error = Some(message);
                }
            }
        }
    }
}
