//! HTTPS for the webhook: rustls (aws-lc-rs) in front of the same axum router.
//!
//! The certificate and key are read at start (a bad file fails the flag), then re-read
//! every [`RELOAD_EVERY`]: cert-manager and similar tools rotate the Secret's files in
//! place, and a webhook that kept serving an expired certificate would stop every
//! FleetAutoscaler using it. A rotation that cannot be used keeps the current pair.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use axum::Router;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::{ClientHello, ResolvesServerCert};
use tokio_rustls::rustls::sign::CertifiedKey;
use tokio_util::sync::CancellationToken;

use crate::metrics::{Metrics, WebhookMetrics};

/// How often the certificate files are checked for a rotation.
pub const RELOAD_EVERY: Duration = Duration::from_secs(30);
/// A client that has not finished the TLS handshake by then is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest certificate or key file read.
const MAX_PEM_BYTES: u64 = 1024 * 1024;

/// Why the certificate and key cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}: over the 1 MiB limit")]
    TooLarge(PathBuf),
    #[error("{0}: no PEM certificate (-----BEGIN CERTIFICATE-----) in the file")]
    NoCertificate(PathBuf),
    #[error("{0}: no PEM private key (PKCS#8, PKCS#1 or SEC1) in the file")]
    NoKey(PathBuf),
    #[error("the key does not fit the certificate, or is of an unsupported type: {0}")]
    Pair(#[source] rustls::Error),
}

fn read_pem(path: &Path) -> Result<Vec<u8>, TlsError> {
    let read = |source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(read)?;
    if meta.len() > MAX_PEM_BYTES {
        return Err(TlsError::TooLarge(path.to_path_buf()));
    }
    std::fs::read(path).map_err(read)
}

fn certificates(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(pem)
        .filter_map(Result::ok)
        .collect();
    if certs.is_empty() {
        return Err(TlsError::NoCertificate(path.to_path_buf()));
    }
    Ok(certs)
}

fn private_key(path: &Path, pem: &[u8]) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|_| TlsError::NoKey(path.to_path_buf()))
}

/// Clap value parser for `--webhook-tls-cert`: the file must hold a certificate.
pub fn parse_cert_file(raw: &str) -> Result<PathBuf, String> {
    let path = PathBuf::from(raw.trim());
    let pem = read_pem(&path).map_err(|e| e.to_string())?;
    certificates(&path, &pem).map_err(|e| e.to_string())?;
    Ok(path)
}

/// Clap value parser for `--webhook-tls-key`: the file must hold a private key.
pub fn parse_key_file(raw: &str) -> Result<PathBuf, String> {
    let path = PathBuf::from(raw.trim());
    let pem = read_pem(&path).map_err(|e| e.to_string())?;
    private_key(&path, &pem).map_err(|e| e.to_string())?;
    Ok(path)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// The files' bytes, to notice a rotation without parsing.
type Fingerprint = (Vec<u8>, Vec<u8>);

/// The certificate being served, swapped in place on rotation.
#[derive(Debug)]
pub struct ReloadingCert {
    cert_path: PathBuf,
    key_path: PathBuf,
    current: RwLock<(Arc<CertifiedKey>, Fingerprint)>,
}

/// What a reload found.
#[derive(Debug, PartialEq, Eq)]
pub enum Reload {
    Unchanged,
    Replaced,
}

impl ReloadingCert {
    /// Reads and checks the pair (the key must match the certificate).
    pub fn load(cert_path: &Path, key_path: &Path) -> Result<Self, TlsError> {
        let (key, fingerprint) = Self::read(cert_path, key_path)?;
        Ok(Self {
            cert_path: cert_path.to_path_buf(),
            key_path: key_path.to_path_buf(),
            current: RwLock::new((key, fingerprint)),
        })
    }

    fn read(
        cert_path: &Path,
        key_path: &Path,
    ) -> Result<(Arc<CertifiedKey>, Fingerprint), TlsError> {
        let cert_pem = read_pem(cert_path)?;
        let key_pem = read_pem(key_path)?;
        let certs = certificates(cert_path, &cert_pem)?;
        let key = private_key(key_path, &key_pem)?;
        let certified = CertifiedKey::from_der(certs, key, &provider()).map_err(TlsError::Pair)?;
        Ok((Arc::new(certified), (cert_pem, key_pem)))
    }

    /// Re-reads the files; swaps the pair in if they changed and are usable.
    pub fn reload(&self) -> Result<Reload, TlsError> {
        let cert_pem = read_pem(&self.cert_path)?;
        let key_pem = read_pem(&self.key_path)?;
        {
            let current = self.current.read().unwrap_or_else(|p| p.into_inner());
            if current.1.0 == cert_pem && current.1.1 == key_pem {
                return Ok(Reload::Unchanged);
            }
        }
        let (key, fingerprint) = Self::read(&self.cert_path, &self.key_path)?;
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = (key, fingerprint);
        Ok(Reload::Replaced)
    }

    /// The end-entity certificate being served (DER).
    pub fn current_certificate(&self) -> Vec<u8> {
        let current = self.current.read().unwrap_or_else(|p| p.into_inner());
        current
            .0
            .cert
            .first()
            .map(|c| c.to_vec())
            .unwrap_or_default()
    }

    /// The rustls server configuration serving this certificate (HTTP/1.1, as Agones'
    /// client speaks).
    pub fn server_config(self: &Arc<Self>) -> Result<Arc<rustls::ServerConfig>, TlsError> {
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(TlsError::Pair)?
            .with_no_client_auth()
            .with_cert_resolver(self.clone());
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }

    /// Checks the files every [`RELOAD_EVERY`] until `shutdown`.
    pub async fn watch(self: Arc<Self>, metrics: WebhookMetrics, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(RELOAD_EVERY);
        tick.tick().await;
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            match self.reload() {
                Ok(Reload::Unchanged) => {}
                Ok(Reload::Replaced) => {
                    Metrics::result(&metrics.tls_reloads, "ok");
                    tracing::info!(message = "webhook TLS certificate reloaded", cert = %self.cert_path.display());
                }
                Err(e) => {
                    Metrics::result(&metrics.tls_reloads, "error");
                    tracing::warn!(message = "cannot use the rotated webhook TLS files; serving the current certificate", error = %e);
                }
            }
        }
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(
            self.current
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .0
                .clone(),
        )
    }
}

/// Serves `router` over HTTPS on `listener` until `shutdown`, with the limits every
/// listener has (`lastcall_common::admin::serve_with`) and a handshake timeout.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    config: Arc<rustls::ServerConfig>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let acceptor = TlsAcceptor::from(config);
    lastcall_common::admin::serve_with(listener, router, shutdown, move |stream| {
        let acceptor = acceptor.clone();
        async move {
            let peer = stream.peer_addr().ok();
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => Some(tls),
                Ok(Err(e)) => {
                    tracing::debug!(message = "webhook TLS handshake failed", peer = ?peer, error = %e);
                    None
                }
                Err(_) => None,
            }
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A self-signed certificate and key from the openssl CLI, into `dir/<name>.{crt,key}`.
    fn self_signed(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
        let (crt, key) = (
            dir.join(format!("{name}.crt")),
            dir.join(format!("{name}.key")),
        );
        let out = std::process::Command::new("openssl")
            .args([
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
            ])
            .args(["-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"])
            .args(["-addext", "subjectAltName=IP:127.0.0.1"])
            .arg("-keyout")
            .arg(&key)
            .arg("-out")
            .arg(&crt)
            .output()
            .expect("openssl");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        (crt, key)
    }

    #[test]
    fn files_are_checked_and_a_rotation_is_picked_up_or_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (crt_a, key_a) = self_signed(dir.path(), "a");
        let (crt_b, key_b) = self_signed(dir.path(), "b");
        assert!(parse_cert_file(crt_a.to_str().unwrap()).is_ok());
        assert!(parse_key_file(key_a.to_str().unwrap()).is_ok());
        let err = parse_cert_file(key_a.to_str().unwrap()).unwrap_err();
        assert!(err.contains("no PEM certificate"), "{err}");
        let err = parse_key_file(crt_a.to_str().unwrap()).unwrap_err();
        assert!(err.contains("no PEM private key"), "{err}");
        assert!(parse_cert_file("/nonexistent/tls.crt").is_err());
        assert!(matches!(
            ReloadingCert::load(&crt_a, &key_b),
            Err(TlsError::Pair(_))
        ));

        let (crt, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        std::fs::copy(&crt_a, &crt).unwrap();
        std::fs::copy(&key_a, &key).unwrap();
        let served = Arc::new(ReloadingCert::load(&crt, &key).unwrap());
        assert!(served.server_config().is_ok());
        let first = served.current_certificate();
        assert_eq!(served.reload().unwrap(), Reload::Unchanged);
        // Half a rotation (new cert, old key) is refused and the old pair stays.
        std::fs::copy(&crt_b, &crt).unwrap();
        assert!(matches!(served.reload(), Err(TlsError::Pair(_))));
        assert_eq!(served.current_certificate(), first);
        std::fs::copy(&key_b, &key).unwrap();
        assert_eq!(served.reload().unwrap(), Reload::Replaced);
        assert_ne!(served.current_certificate(), first);
    }
}
