//! TLS for clients and mutual TLS inside a fleet (rustls, with *ring*): a server's certificate and key from
//! files, and optionally a CA whose certificates mark a connection as a fleet node's.
//!
//! - **Clients** connect over TLS and present no certificate (API keys authenticate them).
//! - **Nodes** present their own certificate (the same files) when they forward to another node or talk to etcd;
//!   a node verifies the certificate of the node it forwards to against the fleet CA, and the receiving node
//!   verifies the forwarding node's. Only a connection whose client certificate chains to the fleet CA may carry
//!   the fleet's internal headers ([`crate::fleet::proxy::HOP`]); a certificate that does not verify fails the
//!   handshake.
//! - **Reload.** The files are looked at every [`RELOAD_INTERVAL`]; when they change (modification time, size or
//!   inode) and still make a usable configuration, new connections use it; a broken replacement is logged and
//!   the configuration in use kept. Connections already open keep the keys they were made with.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use rustls::RootCertStore;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;

/// How often the certificate files are checked for a change.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(1);

/// The largest certificate, key or CA file read (a chain of a few certificates is a few KiB).
const MAX_PEM: u64 = 1 << 20;

/// Where the certificate, its key and the fleet's CA are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The server's certificate chain (PEM), leaf first; also this node's client certificate in a fleet.
    pub cert: PathBuf,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// The fleet's CA (PEM): node certificates chain to it. `None`: no node connections (a server on its own).
    pub fleet_ca: Option<PathBuf>,
}

/// Why TLS could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("{path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A file is not what it should hold.
    #[error("{path}: {why}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// rustls refused the combination (a key that does not match the certificate, a CA it cannot use).
    #[error("TLS configuration: {0}")]
    Config(String),
}

/// The files' contents, as read.
#[derive(Clone, PartialEq, Eq)]
pub struct Pem {
    /// The certificate chain.
    pub cert: Vec<u8>,
    /// The key.
    pub key: Vec<u8>,
    /// The fleet CA, if any.
    pub ca: Option<Vec<u8>>,
}

impl std::fmt::Debug for Pem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pem").field("cert", &self.cert.len()).field("ca", &self.ca.as_ref().map(Vec::len)).finish()
    }
}

/// One usable configuration, made from one reading of the files.
struct Loaded {
    pem: Pem,
    server: Arc<rustls::ServerConfig>,
    /// For connecting to other nodes (verifies them against the fleet CA, presents this node's certificate).
    client: Option<Arc<rustls::ClientConfig>>,
    generation: u64,
}

/// A file's identity and version, to notice a replacement or a rewrite.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    modified: Option<std::time::SystemTime>,
    len: u64,
    inode: u64,
}

fn stamp(path: &Path) -> Option<Stamp> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).ok()?;
    Some(Stamp { modified: meta.modified().ok(), len: meta.len(), inode: meta.ino() })
}

/// A server's TLS, reloaded when its files change ([`Tls::spawn_reload`]).
pub struct Tls {
    files: TlsFiles,
    loaded: RwLock<Arc<Loaded>>,
    stamps: Mutex<Vec<Option<Stamp>>>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls").field("files", &self.files).field("generation", &self.generation()).finish()
    }
}

/// *ring*, the provider etcd's client (tonic) is built with here too. rustls 0.23.48 deprecates it for lacking
/// post-quantum key exchange; aws-lc-rs has it but adds a C toolchain build (CMake, minutes) to every checkout.
/// The ciphers and key exchanges *ring* offers are rustls' classical defaults (TLS 1.3 and 1.2, X25519, P-256).
#[allow(deprecated)]
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    use std::io::Read;
    let file = std::fs::File::open(path).map_err(|source| TlsError::Read { path: path.to_owned(), source })?;
    let mut bytes = Vec::new();
    file.take(MAX_PEM + 1)
        .read_to_end(&mut bytes)
        .map_err(|source| TlsError::Read { path: path.to_owned(), source })?;
    if bytes.len() as u64 > MAX_PEM {
        return Err(TlsError::Invalid { path: path.to_owned(), why: format!("larger than {MAX_PEM} bytes") });
    }
    Ok(bytes)
}

fn certificates(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Invalid { path: path.to_owned(), why: format!("not PEM certificates: {e}") })?;
    if certs.is_empty() {
        return Err(TlsError::Invalid { path: path.to_owned(), why: "no CERTIFICATE block".into() });
    }
    Ok(certs)
}

fn roots(path: &Path, pem: &[u8]) -> Result<Arc<RootCertStore>, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in certificates(path, pem)? {
        roots
            .add(cert)
            .map_err(|e| TlsError::Invalid { path: path.to_owned(), why: format!("not a usable CA: {e}") })?;
    }
    Ok(Arc::new(roots))
}

impl Loaded {
    fn build(files: &TlsFiles, pem: Pem, generation: u64) -> Result<Loaded, TlsError> {
        let chain = certificates(&files.cert, &pem.cert)?;
        let key = || {
            PrivateKeyDer::from_pem_slice(&pem.key)
                .map_err(|e| TlsError::Invalid { path: files.key.clone(), why: format!("not a PEM private key: {e}") })
        };
        let config = |e: rustls::Error| TlsError::Config(e.to_string());
        let fleet_roots = match (&files.fleet_ca, &pem.ca) {
            (Some(path), Some(ca)) => Some(roots(path, ca)?),
            _ => None,
        };
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(config)?;
        let mut server = match &fleet_roots {
            // Clients need no certificate; one that is presented must chain to the fleet CA.
            Some(roots) => {
                let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
                    .allow_unauthenticated()
                    .build()
                    .map_err(|e| TlsError::Config(e.to_string()))?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        }
        .with_single_cert(chain.clone(), key()?)
        .map_err(config)?;
        server.alpn_protocols = vec![b"http/1.1".to_vec()];
        let client = match fleet_roots {
            Some(roots) => {
                let mut client = rustls::ClientConfig::builder_with_provider(provider())
                    .with_safe_default_protocol_versions()
                    .map_err(config)?
                    .with_root_certificates(roots)
                    .with_client_auth_cert(chain, key()?)
                    .map_err(config)?;
                client.alpn_protocols = vec![b"http/1.1".to_vec()];
                Some(Arc::new(client))
            }
            None => None,
        };
        Ok(Loaded { pem, server: Arc::new(server), client, generation })
    }
}

impl Tls {
    /// Reads the files and builds the configuration.
    pub fn load(files: TlsFiles) -> Result<Arc<Tls>, TlsError> {
        let stamps = Tls::stamps_of(&files);
        let pem = Tls::read_all(&files)?;
        let loaded = Loaded::build(&files, pem, 1)?;
        Ok(Arc::new(Tls { files, loaded: RwLock::new(Arc::new(loaded)), stamps: Mutex::new(stamps) }))
    }

    fn paths(files: &TlsFiles) -> impl Iterator<Item = &PathBuf> {
        [&files.cert, &files.key].into_iter().chain(files.fleet_ca.as_ref())
    }

    fn stamps_of(files: &TlsFiles) -> Vec<Option<Stamp>> {
        Tls::paths(files).map(|p| stamp(p)).collect()
    }

    fn read_all(files: &TlsFiles) -> Result<Pem, TlsError> {
        Ok(Pem {
            cert: read(&files.cert)?,
            key: read(&files.key)?,
            ca: files.fleet_ca.as_deref().map(read).transpose()?,
        })
    }

    fn current(&self) -> Arc<Loaded> {
        self.loaded.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// The files.
    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// Whether there is a fleet CA (so node connections are mutual TLS).
    pub fn has_fleet_ca(&self) -> bool {
        self.files.fleet_ca.is_some()
    }

    /// Counts the configurations loaded (1 at start, one more per reload).
    pub fn generation(&self) -> u64 {
        self.current().generation
    }

    /// The files' contents in use (for etcd's client, which takes PEM).
    pub fn pem(&self) -> Pem {
        self.current().pem.clone()
    }

    /// What accepts a client's connection now.
    pub fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.current().server.clone())
    }

    /// What connects to another node now (`None` without a fleet CA).
    pub fn connector(&self) -> Option<tokio_rustls::TlsConnector> {
        self.current().client.clone().map(tokio_rustls::TlsConnector::from)
    }

    /// Reloads if a file changed since the last look: `Ok(true)` when a new configuration is in use, `Ok(false)`
    /// when nothing changed, an error (the old configuration kept) when the new files do not make one.
    pub fn reload_if_changed(&self) -> Result<bool, TlsError> {
        let now = Tls::stamps_of(&self.files);
        {
            let mut stamps = self.stamps.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if *stamps == now {
                return Ok(false);
            }
            // A broken replacement is reported once, not every second, until the files change again.
            *stamps = now;
        }
        let pem = Tls::read_all(&self.files)?;
        let current = self.current();
        if pem == current.pem {
            return Ok(false);
        }
        let loaded = Loaded::build(&self.files, pem, current.generation + 1)?;
        *self.loaded.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(loaded);
        Ok(true)
    }

    /// Checks the files every [`RELOAD_INTERVAL`] on the current runtime, as long as this `Tls` lives.
    pub fn spawn_reload(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(RELOAD_INTERVAL);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticker.tick().await;
            loop {
                ticker.tick().await;
                let Some(tls) = weak.upgrade() else { return };
                let checked = tokio::task::spawn_blocking(move || {
                    let result = tls.reload_if_changed();
                    (tls, result)
                })
                .await;
                match checked {
                    Ok((tls, Ok(true))) => {
                        tracing::info!(cert = %tls.files.cert.display(), generation = tls.generation(), "TLS certificate reloaded");
                    }
                    Ok((tls, Err(err))) => {
                        tracing::warn!(cert = %tls.files.cert.display(), error = %err, "the changed TLS files are not usable; keeping the ones in use");
                    }
                    Ok((_, Ok(false))) | Err(_) => {}
                }
            }
        });
    }
}

/// Marks a request that came over a connection whose client certificate verified against the fleet CA (the
/// connection of another node), as a request extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodePeer;
