//! Strata's host egress proxy: the one place every tier's network traffic leaves the host (docs/DESIGN.md §3).
//!
//! [`EgressProxy::start`] listens on a Unix socket (bound into a process jail, or fed by the microVM's vsock
//! tunnel) and/or a TCP address, and speaks HTTP/1.1 forward proxy:
//!
//! - `CONNECT host:port` opens a byte tunnel when the [`Allowlist`] allows `host:port`. The proxy answers
//!   `200 Connection established` and looks at the client's first bytes: when they start a TLS handshake record
//!   (`0x16`), it reads the whole ClientHello and closes the tunnel unless its SNI equals the CONNECT host
//!   (case-insensitive; a ClientHello without SNI is accepted only when the CONNECT host is an IP literal).
//!   Bytes that are not TLS are relayed as plain TCP: the allowlist already bounds where they can go. Server
//!   bytes are relayed from the start, so server-speaks-first protocols work.
//! - An absolute-form request (`GET http://host/path HTTP/1.1`, any method) is forwarded to the origin in origin
//!   form with `Host` set to the target, hop-by-hop headers and `Proxy-Authorization` removed and
//!   `Connection: close`; exactly `Content-Length` body bytes go up (`Transfer-Encoding` request bodies are
//!   refused with `501`), the response is relayed verbatim until the origin closes, then the client connection
//!   is closed. One request per client connection: nothing after the body is forwarded.
//! - Anything refused gets a short `403` (`400`/`431`/`501` for malformed, oversized or unsupported requests,
//!   `502` when the origin cannot be reached) and the connection is closed.
//!
//! Names are resolved by the host (tokio's `lookup_host`, i.e. the system resolver). **DNS rebinding:** an
//! allowed *name* that resolves to a loopback, private, link-local, unique-local, CGNAT or otherwise non-public
//! address is refused, unless the allowlist names that IP explicitly (`127.0.0.1:8080`) or the name is
//! `localhost` and the allowlist names `localhost` ([`Allowlist::permits_resolved`]).
//!
//! **Egress secrets** ([`EgressConfig::secrets`], [`secrets`]): in the header values of an absolute-form request
//! to a host a secret is bound to, the guest's placeholder for it becomes its value (or a header is set to it);
//! toward other hosts the placeholder goes out unchanged and the record says the secret was withheld. Tunnels are
//! not opened: the proxy never terminates TLS, so secrets go into plain HTTP only.
//!
//! Every request becomes an [`EgressRecord`] (host, port, kind, bytes up and down, verdict with reason, start,
//! duration) kept in the handle: [`EgressHandle::records`], [`EgressHandle::drain_records`] per job.
//!
//! Limits: [`EgressConfig::max_connections`], [`EgressConfig::max_header_bytes`] (16 KiB),
//! [`EgressConfig::idle_timeout`]. Dropping the [`EgressHandle`] closes the listeners, cancels every connection,
//! joins the proxy's threads and removes the Unix socket file.
//!
//! ```no_run
//! use strata_egress::{Allowlist, EgressConfig, EgressProxy};
//! let allow = Allowlist::parse(["*.pypi.org:443", "files.pythonhosted.org"])?;
//! let proxy = EgressProxy::start(EgressConfig::new(allow).with_tcp("127.0.0.1:0".parse()?))?;
//! println!("HTTPS_PROXY=http://{}", proxy.tcp_addr().expect("tcp listener"));
//! // ... run the job ...
//! for r in proxy.drain_records() {
//!     println!("{}", serde_json::to_string(&r)?);
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs)]

/// The allowlist's rules live in `strata-core` (every tier and the proxy share one parse); re-exported here.
pub use strata_core::allow;
mod env;
pub mod http;
mod proxy;
pub mod record;
pub mod secrets;
pub mod sni;

pub use allow::{AllowRule, Allowlist, AllowlistError, Host, HostPattern};
pub use env::proxy_env;
pub use proxy::{AllowlistSwitch, Drained, EgressConfig, EgressError, EgressHandle, EgressProxy};
pub use record::{EgressKind, EgressRecord, EgressVerdict};
pub use secrets::{EgressSecrets, SecretUse};
