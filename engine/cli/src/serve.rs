//! `strata serve`: argument parsing and logging; the server is `strata-serve`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use strata_engine::{EngineConfig, Policy};
use strata_serve::{ConnectionLimits, KeyStore, ServeConfig};

use crate::Failure;

#[derive(Args)]
pub(crate) struct ServeArgs {
    /// Address to listen on. Without --keys only a loopback address is accepted.
    #[arg(long, value_name = "ADDR", default_value = strata_serve::DEFAULT_LISTEN)]
    listen: SocketAddr,

    /// API keys file (TOML, or JSON by its .json name): [[key]] name, sha256 (hex of the key), and optional
    /// quotas max_sandboxes (sandboxes at once) and max_memory (the sum of their memory limits, e.g. "8GiB").
    /// Without it every request is served as `anonymous` and the server listens on loopback only.
    #[arg(long, value_name = "FILE")]
    keys: Option<PathBuf>,

    /// A policy file: its limits are every sandbox's defaults and the ceiling of what requests may ask.
    #[arg(long, value_name = "FILE")]
    policy: Option<PathBuf>,

    /// A sandbox's time to live when its request names none, e.g. 300s, 10m.
    #[arg(long, value_name = "DURATION", default_value = "300s", value_parser = parse_duration)]
    ttl: Duration,

    /// The longest time to live a request may ask for.
    #[arg(long, value_name = "DURATION", default_value = "24h", value_parser = parse_duration)]
    max_ttl: Duration,

    /// A domain whose names `{port}-{sandboxId}.DOMAIN` reach a sandbox's port (behind a wildcard DNS name for
    /// `*.DOMAIN` pointing at this server), as E2B's `get_host(port)` names them.
    #[arg(long, value_name = "DOMAIN")]
    domain: Option<String>,

    /// An E2B template name for a custom image, ALIAS=IMAGE (repeatable); a template that is no alias names an
    /// image of `strata images list` directly.
    #[arg(long = "template", value_name = "ALIAS=IMAGE", value_parser = parse_template)]
    templates: Vec<(String, strata_core::ImageName)>,

    /// Kill a sandbox idle (no job, no request) this long, before its TTL, e.g. 60s.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    idle_timeout: Option<Duration>,

    /// Sandboxes the server holds at most, over every key.
    #[arg(long, value_name = "N", default_value_t = 256)]
    max_sandboxes: usize,

    /// The most memory all sandboxes may commit (the sum of their memory limits), e.g. 16GiB; past it creates
    /// get 429 server_at_capacity. Default: no budget.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    memory_budget: Option<strata_core::ByteSize>,

    /// The most virtual CPUs all sandboxes may commit (the sum of their vcpus limits); past it creates get 429
    /// server_at_capacity. Default: no budget.
    #[arg(long, value_name = "N")]
    cpu_budget: Option<u64>,

    /// vCPU slots per host CPU: admission packs sandboxes onto this host's CPUs (a sandbox takes one slot on each of
    /// `vcpus` distinct CPUs, sorted first-fit) and answers 429 server_at_capacity when none fit; 0 turns it off.
    #[arg(long, value_name = "N", default_value_t = strata_serve::DEFAULT_CPU_OVERCOMMIT)]
    cpu_overcommit: u32,

    /// The host memory admission keeps free: a create is refused (429 server_at_capacity) unless MemAvailable
    /// covers the new sandboxes' memory limits on top of it. Default: 5% of MemTotal, at least 256MiB (0: no floor,
    /// the limits alone must fit).
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    min_free_memory: Option<strata_core::ByteSize>,

    /// Let requests grant host directories (`capabilities.grants`) to sandboxes.
    #[arg(long)]
    allow_grants: bool,

    /// Close a connection whose request header is not whole this long after its first byte (or after the
    /// connection opened). Checked before authentication, like every connection limit below.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = parse_duration)]
    header_timeout: Duration,

    /// Close a connection with no request in flight for this long (a long job, a stream or a WebSocket in
    /// progress is not idle).
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_duration)]
    keep_alive_timeout: Duration,

    /// A request body (a WebSocket's job message too) must arrive whole this long after its header; past it,
    /// 408 body_timeout and the connection is closed.
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_duration)]
    body_timeout: Duration,

    /// Close a connection whose client accepts no byte of a response (or a stream, a WebSocket) for this long.
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_duration)]
    write_timeout: Duration,

    /// The largest request body: 413 body_too_large, at once when Content-Length says so, else when the body
    /// reaches it.
    #[arg(long, value_name = "SIZE", default_value = "64MiB", value_parser = parse_size)]
    max_body: strata_core::ByteSize,

    /// Connections open at once, over every client; past it a new one gets 503 too_many_connections at accept,
    /// before anything is read, and is closed.
    #[arg(long, value_name = "N", default_value_t = 1024)]
    max_connections: usize,

    /// Connections open at once from one client address (IPv6: one /64); past it a new one gets 429
    /// too_many_connections at accept and is closed.
    #[arg(long, value_name = "N", default_value_t = 256)]
    max_connections_per_peer: usize,

    /// Keep the caches under $STRATA_HOME at most this size (e.g. 20GiB): `strata images prune --budget SIZE` at
    /// start and every 10 minutes. Default: $STRATA_CACHE_BUDGET when set, else no pruning.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    cache_budget: Option<strata_core::ByteSize>,

    /// Log one JSON object per line instead of text.
    #[arg(long)]
    log_json: bool,

    /// Join a fleet of nodes coordinated through etcd at these client URLs (comma-separated `http://host:port`,
    /// all loopback; `https://host:port` with --tls-cert, --tls-key and --fleet-ca): placement across nodes, any
    /// node answers for any sandbox. Needs --node and --advertise.
    #[arg(long, value_name = "URLS", value_delimiter = ',', requires_all = ["node", "advertise"])]
    cluster: Vec<String>,

    /// This node's name in the fleet (unique: letters, digits, '.', '_', ':', '-').
    #[arg(long, value_name = "NAME", requires = "cluster")]
    node: Option<String>,

    /// The URL other nodes reach this node's API at (`http://host:port`; `https://` with --fleet-ca).
    #[arg(long, value_name = "URL", requires = "cluster")]
    advertise: Option<String>,

    /// How long a node that stops renewing its etcd lease stays in the fleet (its sandboxes are then lost).
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = parse_duration)]
    lease_ttl: Duration,

    /// Serve clients over TLS with this certificate chain (PEM, leaf first); reloaded when the file changes.
    /// In a fleet with --fleet-ca it is also this node's certificate towards the other nodes and etcd.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<PathBuf>,

    /// The private key of --tls-cert (PEM).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,

    /// The fleet's CA (PEM): node certificates chain to it. Nodes forward to each other and talk to etcd over
    /// mutual TLS; only a connection presenting a certificate of this CA is taken for a node's.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    fleet_ca: Option<PathBuf>,

    /// The CA etcd's certificates chain to, when it is not --fleet-ca.
    #[arg(long, value_name = "FILE", requires = "fleet_ca")]
    etcd_ca: Option<PathBuf>,
}

fn parse_size(text: &str) -> Result<strata_core::ByteSize, String> {
    text.parse::<strata_core::ByteSize>().map_err(|e| e.to_string())
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    strata_core::parse_duration(text).map_err(|e| e.to_string())
}

pub(crate) fn serve(args: ServeArgs) -> Result<i32, Failure> {
    use std::io::IsTerminal;
    let builder = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_max_level(tracing::Level::INFO);
    let installed = if args.log_json { builder.json().try_init() } else { builder.try_init() };
    if let Err(err) = installed {
        return Err(Failure::new("internal", format!("cannot install the logger: {err}")));
    }
    let policy = match &args.policy {
        Some(path) => Policy::from_file(path).map_err(strata_engine::EngineError::from)?,
        None => Policy::default(),
    };
    let keys = match &args.keys {
        Some(path) => Some(KeyStore::from_file(path).map_err(|e| Failure::new("invalid_keys", e.to_string()))?),
        None => None,
    };
    let config = ServeConfig {
        listen: args.listen,
        keys,
        default_ttl: args.ttl,
        max_ttl: args.max_ttl,
        max_sandboxes: args.max_sandboxes,
        idle_timeout: args.idle_timeout,
        domain: args.domain.clone(),
        templates: args.templates.iter().cloned().collect(),
        memory_budget: args.memory_budget.map(|m| m.0),
        cpu_budget: args.cpu_budget,
        cpu_overcommit: args.cpu_overcommit,
        min_free_memory: args.min_free_memory.map(|m| m.0),
        allow_grants: args.allow_grants,
        cache_budget: args.cache_budget.map_or_else(crate::prune::budget_from_env, |b| Ok(Some(b)))?.map(|b| b.0),
        connections: ConnectionLimits {
            header_timeout: args.header_timeout,
            keep_alive_timeout: args.keep_alive_timeout,
            body_timeout: args.body_timeout,
            write_timeout: args.write_timeout,
            max_body: usize::try_from(args.max_body.0).unwrap_or(usize::MAX),
            max_connections: args.max_connections,
            max_connections_per_peer: args.max_connections_per_peer,
        },
        fleet: match (&args.node, &args.advertise) {
            (Some(node), Some(advertise)) if !args.cluster.is_empty() => Some(strata_serve::fleet::FleetConfig {
                lease_ttl: args.lease_ttl,
                etcd_ca: args.etcd_ca.clone(),
                ..strata_serve::fleet::FleetConfig::new(args.cluster.clone(), node, advertise)
            }),
            _ => None,
        },
        tls: match (&args.tls_cert, &args.tls_key) {
            (Some(cert), Some(key)) => Some(strata_serve::tls::TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                fleet_ca: args.fleet_ca.clone(),
            }),
            _ => None,
        },
        ..ServeConfig::new(EngineConfig { policy, ..EngineConfig::from_env()? })
    };
    strata_serve::serve(config).map_err(|e| Failure::new("serve", error_chain(&e)))?;
    Ok(0)
}

/// An error and its sources on one line.
fn error_chain(err: &dyn std::error::Error) -> String {
    let mut message = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    message
}

fn parse_template(spec: &str) -> Result<(String, strata_core::ImageName), String> {
    let (alias, image) = spec.split_once('=').ok_or_else(|| format!("{spec:?} is not ALIAS=IMAGE"))?;
    if alias.is_empty() {
        return Err(format!("{spec:?}: an empty alias"));
    }
    Ok((alias.to_owned(), image.parse().map_err(|e: strata_core::ImageNameError| e.to_string())?))
}
