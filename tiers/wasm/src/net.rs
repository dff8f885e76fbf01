//! Network egress of WASI 0.2 components: `wasi:sockets` with every address checked against the job's
//! allowlist, and every connect attempt logged.
//!
//! Without network (`Net::Deny`, the default) a component's WASI context allows no TCP, no UDP and no name
//! lookup, and its address check says no to everything: it has no network at all.
//!
//! With `Net::Allow(allowlist)` (parsed where the job was made, [`strata_core::Allowlist`]) its matching rules, default
//! ports ("no port means any port") and DNS-rebinding defence ([`Allowlist::permits_resolved`]) are the ones the
//! egress proxy of the native tiers applies. The component may then
//!
//! - **connect over TCP** to `IP:PORT` when an IP-literal rule allows it, or when `IP` is an address *the host*
//!   resolved for a name that a hostname rule allows on `PORT`, and that name may resolve to that address (a
//!   private address behind a public name is refused unless a rule names the IP, as on the proxy). The host
//!   learns such addresses two ways: from the guest's own name lookups (below), and by resolving every
//!   exact-name rule itself, once per job. It does that lazily, on the job's first connect that nothing known
//!   allows, rather than when the job starts: a job that never connects costs no DNS query, and a guest that
//!   connects to an address it did not look up is judged the same (the lookups take at most 5 s in all). An
//!   address that an allowed name shares with other names (a CDN, virtual hosting) is reachable once the allowed
//!   name resolved to it: a socket sees addresses, not names.
//! - **speak TLS** only under an allowed name: a connection whose first write is a TLS handshake record must hold
//!   a whole ClientHello whose server name is a name the allowlist allows on that port and the host resolved to
//!   that address (a ClientHello without SNI only where an IP-literal rule allows the address), the egress
//!   proxy's SNI rule on a socket. Otherwise nothing of it leaves: the stream is closed, the guest's write fails,
//!   and the connection's entry turns `denied` with the reason. Bytes that do not start a TLS record pass.
//! - **look up names** through `wasi:sockets/ip-name-lookup`, but only names that some hostname rule allows (on
//!   any port), exact or `*.example.com`; other names fail with `permanent-resolver-failure` before any query is
//!   made. IP literals "resolve" to themselves without a query. wasmtime-wasi 48's own switch for lookups is
//!   all-or-nothing, so Strata links its own `ip-name-lookup` over it: a filter that checks the name, then hands
//!   it to wasmtime-wasi's resolver (the host's system resolver). A `*.example.com` rule thereby works on wasm
//!   sockets too: the addresses the host resolved for `api.example.com` are recorded as that name's, and a
//!   connect to one of them is judged as a connect to `api.example.com` (a bare IP, which the guest did not look
//!   up, matches no wildcard rule and is refused). **DNS exposure:** the queries leave the host as the host's
//!   own. For exact-name rules they are for fixed names; a wildcard rule lets the guest have any name under its
//!   suffix resolved (`<data>.example.com`), which reaches that domain's name servers: a channel to them, as the
//!   connection itself would be.
//!
//! Nothing else: no bind to a chosen address (only the wildcard, port 0 bind that every connect makes
//! implicitly), no listen, no accept, no UDP. Those fail in the guest with `access-denied`.
//!
//! Every TCP connect attempt, allowed or denied, becomes an [`EgressEntry`] of kind [`EGRESS_KIND_TCP`], in the
//! order the guest made them: `host` is the allowlisted name the address was resolved from when known, else the
//! IP; `verdict` is `allowed` (the address check let the connect go ahead; whether the peer accepted it is not
//! observed) or `denied` with a `reason`. At most [`MAX_EGRESS_ENTRIES`] are kept per job; further attempts are
//! counted and logged, not kept. An attempt that wasmtime-wasi refuses as malformed before anything leaves the
//! host (an address of the wrong family, port 0, a socket already connecting) is not egress unless it was denied.
//!
//! **Bytes.** An allowed connection's `bytes_up` are the bytes the guest wrote to its output stream that
//! wasmtime-wasi accepted, and its `bytes_down` the bytes the guest read (or skipped) from its input stream:
//! payload on the guest's side of the socket, not TCP/IP overhead, counted as they pass and read out when the job
//! ends. Strata counts them without re-implementing `wasi:sockets`, by shadowing two functions of
//! `wasi:sockets/tcp` in the component linker, each a thin layer over wasmtime-wasi's own:
//!
//! - `tcp-socket.start-connect` judges the address *first* (it is async, so the host may resolve the rules'
//!   names here) and logs the attempt. A denied attempt fails right there with `access-denied` and the socket
//!   is left as it was; an allowed one goes on to wasmtime-wasi's `start-connect`, and the socket's resource
//!   is remembered with the byte counters of its entry. Judging here rather than in wasmtime-wasi's address
//!   check is what ties an entry to its socket: that check runs later, inside the connect, and is told only the
//!   address, so two sockets connecting to one address could not be told apart there. It still runs, re-judging
//!   without logging, as a second line (a verdict never turns from allowed to denied within a job: the addresses
//!   known for allowed names only grow).
//! - `tcp-socket.finish-connect` calls wasmtime-wasi's; once that hands out the connection's streams, each is
//!   replaced in the resource table, under the same handle, by a wrapper that delegates to it and counts what
//!   passes into the entry's counters.
//!
//! So several connections of one job to one address, in any order of connects and finishes, each count into
//! their own entry. An allowed connect the peer refuses keeps 0/0, as does every denied attempt, and an attempt
//! past the [`MAX_EGRESS_ENTRIES`] kept is not counted.
//!
//! The layers are linked for any store whose data is a `NetView`: one that gives its sockets and its job's
//! policy, as wasmtime-wasi's `WasiView` gives its WASI context.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use strata_core::{Capabilities, EgressEntry, Net, TierError};
use strata_egress::sni::{ClientHelloParse, HANDSHAKE_RECORD, parse_client_hello};
use strata_egress::{Allowlist, Host, HostPattern};
use wasmtime::StoreContextMut;
use wasmtime::component::{HasData, Linker, Resource, ResourceTable};
use wasmtime_wasi::WasiCtxBuilder;
use wasmtime_wasi::p2::bindings::sockets::ip_name_lookup::{self, HostResolveAddressStream, ResolveAddressStream};
use wasmtime_wasi::p2::bindings::sockets::network::{
    self, ErrorCode, HostNetwork, IpAddress, IpSocketAddress, Network,
};
use wasmtime_wasi::p2::bindings::sockets::tcp::HostTcpSocket;
use wasmtime_wasi::p2::pipe::{ClosedInputStream, ClosedOutputStream};
use wasmtime_wasi::p2::{
    DynInputStream, DynOutputStream, DynPollable, InputStream, OutputStream, Pollable, SocketError, StreamError,
    StreamResult, TcpSocket,
};
use wasmtime_wasi::sockets::{SocketAddrUse, WasiSocketsCtxView};

use crate::error::lock;

/// The `kind` of a wasm component's egress entries: one TCP connect attempt, judged by the address check. An
/// allowed one's `bytes_up` and `bytes_down` are what the guest wrote to and read from the connection's streams.
pub const EGRESS_KIND_TCP: &str = "tcp";

/// The `wasi:sockets/tcp` instance of wasmtime-wasi 48's component linker (its WIT is `wasi:sockets@0.2.12`;
/// a guest importing any 0.2 version is linked to it). A unit test checks that this is the name wasmtime-wasi
/// defines, so that [`add_to_linker`] shadows its functions rather than defining a second instance.
const TCP_INSTANCE: &str = "wasi:sockets/tcp@0.2.12";

/// The most egress entries one job keeps; further connect attempts are counted, not kept.
pub const MAX_EGRESS_ENTRIES: usize = 1024;

/// The most addresses remembered per job as resolved from allowed names.
const MAX_RESOLVED: usize = 4096;

/// The most allowed names remembered per address (a wildcard domain may resolve all its names to one address).
const MAX_NAMES_PER_ADDRESS: usize = 16;

/// How long the host's own resolution of the exact-name rules may take, in all.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);

/// One job's network: its allowlist, the addresses the host resolved for allowed names, and its egress log.
/// Shared by the address check (which wasmtime-wasi calls without the store) and the name-lookup filter.
pub(crate) struct NetPolicy {
    allow: Allowlist,
    state: Mutex<NetState>,
    /// Set once the exact-name rules were resolved by the host (successfully or not).
    rules_resolved: tokio::sync::OnceCell<()>,
}

#[derive(Default)]
struct NetState {
    /// Each address resolved for allowed names, and those names.
    resolved: HashMap<IpAddr, Vec<String>>,
    /// The name each of the guest's open lookups is for, by resource.
    lookups: HashMap<u32, String>,
    /// The attempts kept, each allowed one with its connection's byte counters.
    entries: Vec<(EgressEntry, Option<Arc<Counters>>)>,
    dropped: u64,
    /// The counters and address of each socket whose allowed connect is under way (started, not yet finished),
    /// by resource. A socket dropped while connecting leaves its slot behind until its handle is reused by a
    /// socket that starts a connect, which overwrites it; at most one slot per live handle.
    connecting: HashMap<u32, (Arc<Counters>, SocketAddr)>,
}

/// The bytes of one allowed connection so far, shared by its streams' wrappers and its egress entry, and why it
/// was closed after all when its TLS ClientHello was refused.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    /// Bytes the guest wrote to the connection that wasmtime-wasi accepted.
    up: AtomicU64,
    /// Bytes the guest read or skipped from the connection.
    down: AtomicU64,
    /// Set when the connection's first write was a TLS ClientHello the allowlist refuses.
    refused: Mutex<Option<String>>,
}

impl Counters {
    fn add(counter: &AtomicU64, bytes: usize) {
        counter.fetch_add(u64::try_from(bytes).unwrap_or(u64::MAX), Ordering::Relaxed);
    }
}

/// What [`NetPolicy::judge`] says of one address: `Ok(host)` with the name (or IP) it is allowed as, or
/// `Err((host, reason))`.
type Verdict = Result<String, (String, String)>;

impl std::fmt::Debug for NetPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetPolicy").field("allow", &self.allow).finish_non_exhaustive()
    }
}

impl NetPolicy {
    /// The policy of a job with these capabilities: `None` without network.
    pub(crate) fn for_caps(caps: &Capabilities) -> Result<Option<Arc<NetPolicy>>, TierError> {
        match &caps.net {
            Net::Deny => Ok(None),
            Net::Allow(allow) => {
                let allow = allow.clone();
                Ok(Some(Arc::new(NetPolicy {
                    allow,
                    state: Mutex::new(NetState::default()),
                    rules_resolved: tokio::sync::OnceCell::new(),
                })))
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, NetState> {
        lock(&self.state)
    }

    /// The egress entries so far, each with its connection's bytes up to now, and how many attempts were not kept.
    pub(crate) fn take_entries(&self) -> (Vec<EgressEntry>, u64) {
        let mut state = self.lock();
        let entries = std::mem::take(&mut state.entries)
            .into_iter()
            .map(|(mut entry, counters)| {
                if let Some(counters) = counters {
                    entry.bytes_up = counters.up.load(Ordering::Relaxed);
                    entry.bytes_down = counters.down.load(Ordering::Relaxed);
                    if let Some(reason) = lock(&counters.refused).take() {
                        entry.verdict = "denied".to_owned();
                        entry.reason = Some(reason);
                    }
                }
                entry
            })
            .collect();
        (entries, std::mem::take(&mut state.dropped))
    }

    /// What wasmtime-wasi asks before every socket operation. A connect was judged and logged by
    /// [`start_connect`] before wasmtime-wasi started it, and is judged again here, without logging, as a
    /// second line.
    fn check(&self, addr: SocketAddr, used: SocketAddrUse) -> bool {
        match used {
            // The implicit bind of a connect (to the wildcard address, port 0); explicit binds elsewhere are refused.
            SocketAddrUse::TcpBind => addr.ip().is_unspecified() && addr.port() == 0,
            SocketAddrUse::TcpConnect => self.judge(addr.ip().to_canonical(), addr.port()).is_ok(),
            _ => false,
        }
    }

    /// Judges one connect attempt, resolving the rules' names on the host first if nothing known allows it.
    async fn judge_connect(&self, addr: SocketAddr) -> Verdict {
        let (ip, port) = (addr.ip().to_canonical(), addr.port());
        let verdict = self.judge(ip, port);
        if verdict.is_err() && !self.rules_resolved.initialized() {
            self.resolve_rules().await;
            return self.judge(ip, port);
        }
        verdict
    }

    /// Logs one connect attempt to `port` with its verdict; the counters of its entry when it was allowed and kept.
    fn log(&self, port: u16, verdict: Verdict) -> Option<Arc<Counters>> {
        let allowed = verdict.is_ok();
        let (host, reason) = match verdict {
            Ok(host) => (host, None),
            Err((host, reason)) => (host, Some(reason)),
        };
        let entry = EgressEntry {
            host,
            port,
            kind: EGRESS_KIND_TCP.to_owned(),
            bytes_up: 0,
            bytes_down: 0,
            verdict: if allowed { "allowed" } else { "denied" }.to_owned(),
            reason,
            secrets_injected: Vec::new(),
            secrets_withheld: Vec::new(),
        };
        let mut state = self.lock();
        if state.entries.len() >= MAX_EGRESS_ENTRIES {
            state.dropped += 1;
            return None;
        }
        let counters = allowed.then(|| Arc::new(Counters::default()));
        state.entries.push((entry, counters.clone()));
        counters
    }

    /// Whether `ip:port` may be reached: `Ok(host)` with the name (or IP) it is allowed as, or `Err((host,
    /// reason))`.
    fn judge(&self, ip: IpAddr, port: u16) -> Verdict {
        if self.allow.allows(&Host::Ip(ip), port) {
            return Ok(ip.to_string());
        }
        let names = self.lock().resolved.get(&ip).cloned().unwrap_or_default();
        let mut private_behind = None;
        for name in &names {
            let host = Host::Name(name.clone());
            if self.allow.allows(&host, port) {
                if self.allow.permits_resolved(&host, ip, port) {
                    return Ok(name.clone());
                }
                private_behind.get_or_insert(name);
            }
        }
        if let Some(name) = private_behind {
            return Err((
                name.clone(),
                format!("{name} resolved to {ip}, a non-public address the allowlist does not name"),
            ));
        }
        match names.first() {
            Some(name) => Err((name.clone(), format!("{name}:{port} ({ip}) is not in the allowlist"))),
            None => Err((ip.to_string(), format!("{}:{port} is not in the allowlist", Host::Ip(ip).to_authority()))),
        }
    }

    /// The TLS rule, as on the egress proxy: a ClientHello's server name must be a name the allowlist allows on
    /// `port` that the host resolved to `ip` (so a connection allowed for one name cannot present another, the
    /// domain-fronting case); a ClientHello without one is accepted only when an IP-literal rule allows `ip`.
    fn judge_sni(&self, ip: IpAddr, port: u16, sni: Option<&str>) -> Result<(), String> {
        match sni {
            None if self.allow.allows(&Host::Ip(ip), port) => Ok(()),
            None => Err(format!(
                "TLS ClientHello without SNI to {}:{port}, allowed only by name",
                Host::Ip(ip).to_authority()
            )),
            Some(name) => {
                let resolved = self.lock().resolved.get(&ip).is_some_and(|names| names.iter().any(|n| n == name));
                if resolved && self.allow.allows(&Host::Name(name.to_owned()), port) {
                    Ok(())
                } else {
                    Err(format!("TLS SNI {name} is not an allowed name of {}:{port}", Host::Ip(ip).to_authority()))
                }
            }
        }
    }

    /// Records that the host resolved `name` (an allowed name) to `ip`.
    fn note(&self, ip: IpAddr, name: &str) {
        let ip = ip.to_canonical();
        let mut state = self.lock();
        if state.resolved.len() >= MAX_RESOLVED && !state.resolved.contains_key(&ip) {
            return;
        }
        let names = state.resolved.entry(ip).or_default();
        if names.len() < MAX_NAMES_PER_ADDRESS && !names.iter().any(|n| n == name) {
            names.push(name.to_owned());
        }
    }

    /// Resolves every exact-name rule on the host, once per job.
    async fn resolve_rules(&self) {
        self.rules_resolved
            .get_or_init(|| async {
                let mut lookups = tokio::task::JoinSet::new();
                for rule in self.allow.rules() {
                    if let HostPattern::Exact(name) = &rule.host {
                        let name = name.clone();
                        lookups.spawn(async move {
                            let addrs = tokio::net::lookup_host((name.as_str(), 0))
                                .await
                                .map(|addrs| addrs.map(|a| a.ip()).collect::<Vec<IpAddr>>());
                            (name, addrs)
                        });
                    }
                }
                let collect = async {
                    while let Some(done) = lookups.join_next().await {
                        match done {
                            Ok((name, Ok(ips))) => ips.into_iter().for_each(|ip| self.note(ip, &name)),
                            Ok((name, Err(err))) => log::debug!("cannot resolve allowlisted {name}: {err}"),
                            Err(err) => log::debug!("a lookup of an allowlisted name failed: {err}"),
                        }
                    }
                };
                if tokio::time::timeout(RESOLVE_TIMEOUT, collect).await.is_err() {
                    log::debug!("resolving the allowlist's names took over {RESOLVE_TIMEOUT:?}; the rest are skipped");
                }
            })
            .await;
    }

    /// Whether the guest may look `name` up: `Ok(Some(name))` for a name some hostname rule allows (normalised),
    /// `Ok(None)` for an IP literal (which resolves to itself without a query), `Err` otherwise.
    fn lookup_allowed(&self, name: &str) -> Result<Option<String>, ErrorCode> {
        match Host::parse(name) {
            Ok(Host::Ip(_)) => Ok(None),
            Ok(host @ Host::Name(_)) => {
                // A lookup has no port: any port a rule allows will do.
                let allowed = self.allow.rules().iter().any(|rule| rule.matches(&host, rule.port.unwrap_or(1)));
                match host {
                    Host::Name(name) if allowed => Ok(Some(name)),
                    _ => Err(ErrorCode::PermanentResolverFailure),
                }
            }
            // Bare IPv6 addresses are not hosts to the allowlist's parser, which wants them in brackets.
            Err(_) if name.parse::<std::net::Ipv6Addr>().is_ok() => Ok(None),
            Err(_) => Err(ErrorCode::InvalidArgument),
        }
    }
}

/// Grants a component's WASI context its network: none without a policy; with one, TCP and name lookups, each
/// address checked by the policy, and no UDP.
pub(crate) fn configure(builder: &mut WasiCtxBuilder, net: Option<&Arc<NetPolicy>>) {
    builder.allow_udp(false);
    match net {
        None => {
            builder.allow_tcp(false).allow_ip_name_lookup(false).socket_addr_check(|_, _| Box::pin(async { false }));
        }
        Some(policy) => {
            let policy = policy.clone();
            builder.allow_tcp(true).allow_ip_name_lookup(true).socket_addr_check(move |addr, used| {
                let allowed = policy.check(addr, used);
                Box::pin(async move { allowed })
            });
        }
    }
}

/// What the network layers work on: a store's sockets context and its job's network policy, borrowed together.
pub(crate) struct NetCtxView<'a> {
    /// wasmtime-wasi's sockets, which the layers delegate to.
    pub(crate) sockets: WasiSocketsCtxView<'a>,
    /// The job's network; `None` is no network at all.
    pub(crate) policy: Option<&'a Arc<NetPolicy>>,
}

/// A store's data with a network, as [`add_to_linker`]'s layers reach it.
pub(crate) trait NetView: Send + 'static {
    /// The store's sockets and network policy.
    fn net(&mut self) -> NetCtxView<'_>;
}

/// Links Strata's layers over wasmtime-wasi's `wasi:sockets` into a component linker that already holds
/// wasmtime-wasi's WASI 0.2: the name-lookup filter ([`FilteredLookup`]) and the TCP connect functions that log
/// each attempt and count each connection's bytes ([`start_connect`], [`finish_connect`]).
pub(crate) fn add_to_linker<T: NetView>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
    linker.allow_shadowing(true);
    ip_name_lookup::add_to_linker::<T, FilteredLookup>(linker, T::net)?;
    let mut tcp = linker.instance(TCP_INSTANCE)?;
    tcp.func_wrap_async(
        "[method]tcp-socket.start-connect",
        |store, (socket, network, remote): (Resource<TcpSocket>, Resource<Network>, IpSocketAddress)| {
            Box::new(start_connect(store, socket, network, remote))
        },
    )?;
    tcp.func_wrap("[method]tcp-socket.finish-connect", |store, (socket,): (Resource<TcpSocket>,)| {
        finish_connect(store, socket)
    })?;
    linker.allow_shadowing(false);
    Ok(())
}

/// `tcp-socket.start-connect`: the address judged and the attempt logged, then (if allowed) wasmtime-wasi's.
async fn start_connect<T: NetView>(
    mut store: StoreContextMut<'_, T>,
    socket: Resource<TcpSocket>,
    network: Resource<Network>,
    remote: IpSocketAddress,
) -> wasmtime::Result<(Result<(), ErrorCode>,)> {
    let net = store.data_mut().net().policy.cloned();
    let rep = socket.rep();
    let addr = SocketAddr::from(remote);
    let verdict = match &net {
        Some(net) => match net.judge_connect(addr).await {
            Ok(host) => Some(host),
            Err(denied) => {
                net.log(addr.port(), Err(denied));
                return Ok((Err(ErrorCode::AccessDenied),));
            }
        },
        // No network: wasmtime-wasi refuses to make sockets at all, and its check says no to everything.
        None => None,
    };
    let mut sockets = store.data_mut().net().sockets;
    if let Err(err) = HostTcpSocket::start_connect(&mut sockets, socket, network, remote) {
        return Ok((Err(network::Host::convert_error_code(&mut sockets, err)?),));
    }
    if let (Some(net), Some(host)) = (net, verdict) {
        let counters = net.log(addr.port(), Ok(host));
        let mut state = net.lock();
        match counters {
            Some(counters) => state.connecting.insert(rep, (counters, addr)),
            None => state.connecting.remove(&rep),
        };
    }
    Ok((Ok(()),))
}

/// The streams of a connection, as wasm sees them.
type Streams = (Resource<DynInputStream>, Resource<DynOutputStream>);

/// `tcp-socket.finish-connect`: wasmtime-wasi's, with the connection's streams counted when it is made.
fn finish_connect<T: NetView>(
    mut store: StoreContextMut<'_, T>,
    socket: Resource<TcpSocket>,
) -> wasmtime::Result<(Result<Streams, ErrorCode>,)> {
    let rep = socket.rep();
    let NetCtxView { mut sockets, policy } = store.data_mut().net();
    let net = policy.cloned();
    let finished = HostTcpSocket::finish_connect(&mut sockets, socket);
    // The connect is over unless it is still under way; either way its slot goes once it is.
    let connection = match &finished {
        Err(err) if matches!(err.downcast_ref(), Some(ErrorCode::WouldBlock)) => None,
        _ => net.and_then(|net| {
            let (counters, addr) = net.lock().connecting.remove(&rep)?;
            Some((counters, TlsGate { net, addr }))
        }),
    };
    match finished {
        Ok(streams) => {
            if let Some((counters, gate)) = connection {
                count_streams(sockets.table, &streams, &counters, gate)?;
            }
            Ok((Ok(streams),))
        }
        Err(err) => Ok((Err(network::Host::convert_error_code(&mut sockets, err)?),)),
    }
}

/// Puts counting wrappers in place of a connection's streams, under the same handles; the output's first write
/// goes through `gate`.
fn count_streams(
    table: &mut ResourceTable,
    (input, output): &Streams,
    counters: &Arc<Counters>,
    gate: TlsGate,
) -> wasmtime::Result<()> {
    let stream = table.get_mut(input)?;
    let inner = std::mem::replace(stream, Box::new(ClosedInputStream));
    *stream = Box::new(CountedInput { inner, counters: counters.clone() });
    let stream = table.get_mut(output)?;
    let inner = std::mem::replace(stream, Box::new(ClosedOutputStream));
    *stream = Box::new(CountedOutput { inner, counters: counters.clone(), gate: Some(gate) });
    Ok(())
}

/// The TLS check of a connection's first write: the policy and the address the connection was allowed to.
struct TlsGate {
    net: Arc<NetPolicy>,
    addr: SocketAddr,
}

impl TlsGate {
    /// Judges a connection's first write, as the proxy judges a tunnel's first bytes: not TLS passes (the address
    /// check already bounds where it goes); a TLS handshake record must hold the whole ClientHello (a guest's TLS
    /// library writes it at once) with a server name [`NetPolicy::judge_sni`] accepts.
    fn judge(&self, first: &[u8]) -> Result<(), String> {
        if first.first() != Some(&HANDSHAKE_RECORD) {
            return Ok(());
        }
        match parse_client_hello(first) {
            Ok(ClientHelloParse::Complete(sni)) => {
                self.net.judge_sni(self.addr.ip().to_canonical(), self.addr.port(), sni.as_deref())
            }
            Ok(ClientHelloParse::Incomplete) => {
                Err("TLS ClientHello split across writes (the wasm tier judges a connection's first write)".into())
            }
            Err(err) => Err(err.to_string()),
        }
    }
}

/// A connection's input stream, counting what the guest reads. Only the methods wasmtime-wasi's TCP stream
/// implements itself are delegated; the rest (`skip`, the blocking forms) are the trait's, built on these, as
/// they are for the wrapped stream.
struct CountedInput {
    inner: DynInputStream,
    counters: Arc<Counters>,
}

#[wasmtime_wasi::async_trait]
impl Pollable for CountedInput {
    async fn ready(&mut self) {
        self.inner.ready().await
    }
}

#[wasmtime_wasi::async_trait]
impl InputStream for CountedInput {
    fn read(&mut self, size: usize) -> StreamResult<bytes::Bytes> {
        if lock(&self.counters.refused).is_some() {
            return Err(StreamError::Closed);
        }
        let bytes = self.inner.read(size)?;
        Counters::add(&self.counters.down, bytes.len());
        Ok(bytes)
    }

    async fn cancel(&mut self) {
        self.inner.cancel().await
    }
}

/// A connection's output stream, counting what wasmtime-wasi accepts of the guest's writes. As for
/// [`CountedInput`], `write_zeroes` and the blocking forms are the trait's, built on `check_write` and `write`.
struct CountedOutput {
    inner: DynOutputStream,
    counters: Arc<Counters>,
    /// Until the first write.
    gate: Option<TlsGate>,
}

#[wasmtime_wasi::async_trait]
impl Pollable for CountedOutput {
    async fn ready(&mut self) {
        self.inner.ready().await
    }
}

#[wasmtime_wasi::async_trait]
impl OutputStream for CountedOutput {
    fn write(&mut self, bytes: bytes::Bytes) -> StreamResult<()> {
        if let Some(gate) = self.gate.take()
            && let Err(reason) = gate.judge(&bytes)
        {
            // Nothing of it leaves: the stream is closed, and the connection's entry says why.
            *lock(&self.counters.refused) = Some(reason);
            self.inner = Box::new(ClosedOutputStream);
            return Err(StreamError::Closed);
        }
        let len = bytes.len();
        self.inner.write(bytes)?;
        Counters::add(&self.counters.up, len);
        Ok(())
    }

    fn flush(&mut self) -> StreamResult<()> {
        self.inner.flush()
    }

    fn check_write(&mut self) -> StreamResult<usize> {
        self.inner.check_write()
    }

    async fn cancel(&mut self) {
        self.inner.cancel().await
    }
}

/// `wasi:sockets/ip-name-lookup` as Strata links it: the job's policy in front of wasmtime-wasi's resolver.
pub(crate) struct FilteredLookup;

impl HasData for FilteredLookup {
    type Data<'a> = NetCtxView<'a>;
}

fn ip_of(address: &IpAddress) -> IpAddr {
    match *address {
        IpAddress::Ipv4((a, b, c, d)) => IpAddr::from([a, b, c, d]),
        IpAddress::Ipv6((a, b, c, d, e, f, g, h)) => IpAddr::from([a, b, c, d, e, f, g, h]),
    }
}

// The lookup interface uses `wasi:sockets/network`'s types, so its host trait needs the network's: delegated.
impl network::Host for NetCtxView<'_> {
    fn convert_error_code(&mut self, error: SocketError) -> wasmtime::Result<ErrorCode> {
        network::Host::convert_error_code(&mut self.sockets, error)
    }

    fn network_error_code(&mut self, err: Resource<wasmtime::Error>) -> wasmtime::Result<Option<ErrorCode>> {
        network::Host::network_error_code(&mut self.sockets, err)
    }
}

impl HostNetwork for NetCtxView<'_> {
    fn drop(&mut self, this: Resource<Network>) -> wasmtime::Result<()> {
        HostNetwork::drop(&mut self.sockets, this)
    }
}

impl ip_name_lookup::Host for NetCtxView<'_> {
    fn resolve_addresses(
        &mut self,
        network: Resource<Network>,
        name: String,
    ) -> Result<Resource<ResolveAddressStream>, SocketError> {
        let Some(net) = self.policy else {
            return Err(ErrorCode::PermanentResolverFailure.into());
        };
        let allowed = net.lookup_allowed(&name)?;
        let stream = ip_name_lookup::Host::resolve_addresses(&mut self.sockets, network, name)?;
        if let Some(name) = allowed {
            net.lock().lookups.insert(stream.rep(), name);
        }
        Ok(stream)
    }
}

impl HostResolveAddressStream for NetCtxView<'_> {
    fn resolve_next_address(
        &mut self,
        stream: Resource<ResolveAddressStream>,
    ) -> Result<Option<IpAddress>, SocketError> {
        let rep = stream.rep();
        let next = HostResolveAddressStream::resolve_next_address(&mut self.sockets, stream)?;
        if let (Some(net), Some(address)) = (self.policy, &next) {
            let name = net.lock().lookups.get(&rep).cloned();
            if let Some(name) = name {
                net.note(ip_of(address), &name);
            }
        }
        Ok(next)
    }

    fn subscribe(&mut self, stream: Resource<ResolveAddressStream>) -> wasmtime::Result<Resource<DynPollable>> {
        HostResolveAddressStream::subscribe(&mut self.sockets, stream)
    }

    fn drop(&mut self, stream: Resource<ResolveAddressStream>) -> wasmtime::Result<()> {
        if let Some(net) = self.policy {
            net.lock().lookups.remove(&stream.rep());
        }
        HostResolveAddressStream::drop(&mut self.sockets, stream)
    }
}

#[cfg(test)]
mod tests {
    use wasmtime::AsContextMut;
    use wasmtime_wasi::sockets::WasiSocketsView;

    use super::*;

    fn policy(specs: &[&str]) -> Arc<NetPolicy> {
        let caps = Capabilities { net: Net::allow(specs).expect("valid allowlist"), ..Default::default() };
        NetPolicy::for_caps(&caps).expect("valid specs").expect("a policy")
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime")
    }

    fn check(policy: &NetPolicy, addr: &str, used: SocketAddrUse) -> bool {
        policy.check(addr.parse().expect("address"), used)
    }

    /// A connect attempt as `start-connect` judges and logs it.
    fn connect(policy: &NetPolicy, addr: &str) -> bool {
        let addr: SocketAddr = addr.parse().expect("address");
        let verdict = runtime().block_on(policy.judge_connect(addr));
        let allowed = verdict.is_ok();
        policy.log(addr.port(), verdict);
        allowed
    }

    #[test]
    fn no_network_is_no_policy_and_a_malformed_spec_is_refused() {
        assert!(NetPolicy::for_caps(&Capabilities::default()).expect("deny").is_none());
        let err = Net::allow(["http://x"]).expect_err("malformed");
        assert!(err.to_string().contains("http://x"), "{err}");
    }

    #[test]
    fn only_connects_to_allowed_ip_and_port_pass_and_each_is_logged() {
        let p = policy(&["127.0.0.1:8080", "[::1]"]);
        assert!(connect(&p, "127.0.0.1:8080"));
        assert!(!connect(&p, "127.0.0.1:8081"));
        assert!(connect(&p, "[::1]:22"), "no port means any port");
        assert!(connect(&p, "[::ffff:127.0.0.1]:8080"), "v4-mapped is the v4 address");
        // wasmtime-wasi's own check, run inside each connect, agrees and logs nothing.
        assert!(check(&p, "127.0.0.1:8080", SocketAddrUse::TcpConnect));
        assert!(!check(&p, "127.0.0.1:8081", SocketAddrUse::TcpConnect));
        let (entries, dropped) = p.take_entries();
        assert_eq!(dropped, 0);
        let summary: Vec<_> = entries.iter().map(|e| (e.host.as_str(), e.port, e.verdict.as_str())).collect();
        assert_eq!(
            summary,
            [
                ("127.0.0.1", 8080, "allowed"),
                ("127.0.0.1", 8081, "denied"),
                ("::1", 22, "allowed"),
                ("127.0.0.1", 8080, "allowed")
            ]
        );
        assert!(entries.iter().all(|e| e.kind == "tcp" && e.bytes_up == 0 && e.bytes_down == 0));
        assert_eq!(entries[1].reason.as_deref(), Some("127.0.0.1:8081 is not in the allowlist"));
        assert!(entries[0].reason.is_none());
    }

    #[test]
    fn binds_listens_accepts_and_udp_are_refused_but_the_implicit_bind_of_a_connect_is_not() {
        let p = policy(&["127.0.0.1"]);
        assert!(check(&p, "0.0.0.0:0", SocketAddrUse::TcpBind));
        assert!(check(&p, "[::]:0", SocketAddrUse::TcpBind));
        for (addr, used) in [
            ("127.0.0.1:0", SocketAddrUse::TcpBind),
            ("0.0.0.0:8080", SocketAddrUse::TcpBind),
            ("0.0.0.0:0", SocketAddrUse::TcpListen),
            ("127.0.0.1:5555", SocketAddrUse::TcpAccept),
            ("0.0.0.0:0", SocketAddrUse::UdpBind),
            ("127.0.0.1:53", SocketAddrUse::UdpSend),
            ("127.0.0.1:53", SocketAddrUse::UdpReceive),
        ] {
            assert!(!check(&p, addr, used), "{addr} {used:?}");
        }
        assert!(p.take_entries().0.is_empty(), "only connects are egress");
    }

    #[test]
    fn a_name_rule_allows_what_the_host_resolved_for_it_within_the_rebinding_defence() {
        let p = policy(&["*.example.com:443", "localhost:8080"]);
        p.note("93.184.216.34".parse().expect("ip"), "api.example.com");
        p.note("10.0.0.7".parse().expect("ip"), "internal.example.com");
        assert!(connect(&p, "93.184.216.34:443"));
        assert!(!connect(&p, "93.184.216.34:80"), "the rule's port");
        assert!(!connect(&p, "10.0.0.7:443"), "a private address behind a public name");
        assert!(!connect(&p, "93.184.216.35:443"), "an address no allowed name has");
        // The exact-name rule `localhost` is resolved by the host on the first refusal.
        assert!(connect(&p, "127.0.0.1:8080"));
        assert!(check(&p, "127.0.0.1:8080", SocketAddrUse::TcpConnect), "and stays allowed");
        let (entries, _) = p.take_entries();
        let hosts: Vec<_> = entries.iter().map(|e| (e.host.as_str(), e.verdict.as_str())).collect();
        assert_eq!(
            hosts,
            [
                ("api.example.com", "allowed"),
                ("api.example.com", "denied"),
                ("internal.example.com", "denied"),
                ("93.184.216.35", "denied"),
                ("localhost", "allowed"),
            ]
        );
        assert!(entries[2].reason.as_deref().is_some_and(|r| r.contains("non-public")), "{:?}", entries[2]);
    }

    #[test]
    fn a_tls_client_hello_must_name_an_allowed_name_of_the_address() {
        use strata_egress::sni::testing::client_hello;
        let p = policy(&["*.example.com:443", "10.1.2.3"]);
        p.note("93.184.216.34".parse().expect("ip"), "api.example.com");
        let gate = |addr: &str| TlsGate { net: p.clone(), addr: addr.parse().expect("address") };
        assert_eq!(gate("93.184.216.34:443").judge(&client_hello(Some("api.example.com"))), Ok(()));
        assert_eq!(gate("93.184.216.34:443").judge(b"GET / HTTP/1.1\r\n\r\n"), Ok(()), "not TLS");
        for (addr, hello) in [
            ("93.184.216.34:443", client_hello(Some("evil.org"))),
            ("93.184.216.34:443", client_hello(Some("www.example.com"))), // allowed, but not resolved to it
            ("93.184.216.34:443", client_hello(None)),                    // allowed by name only
            ("10.1.2.3:443", client_hello(Some("api.example.com"))),      // fronting through an IP rule
        ] {
            assert!(gate(addr).judge(&hello).is_err(), "{addr}");
        }
        assert_eq!(gate("10.1.2.3:443").judge(&client_hello(None)), Ok(()), "no SNI where an IP rule allows");
        let hello = client_hello(Some("api.example.com"));
        let err = gate("93.184.216.34:443").judge(&hello[..hello.len() - 1]).expect_err("split");
        assert!(err.contains("split across writes"), "{err}");
        let err = gate("93.184.216.34:443").judge(&[0x16, 3, 1, 0, 4, 9, 0, 0, 0]).expect_err("malformed");
        assert!(err.contains("ClientHello"), "{err}");
    }

    #[test]
    fn lookups_are_limited_to_allowed_names() {
        let p = policy(&["*.example.com:443", "pypi.org", "10.0.0.1"]);
        assert_eq!(p.lookup_allowed("API.example.com."), Ok(Some("api.example.com".into())));
        assert_eq!(p.lookup_allowed("pypi.org"), Ok(Some("pypi.org".into())));
        assert_eq!(p.lookup_allowed("10.0.0.9"), Ok(None), "IP literals need no query");
        assert_eq!(p.lookup_allowed("::1"), Ok(None));
        for name in ["example.com", "evil.org", "files.pypi.org", "localhost"] {
            assert!(matches!(p.lookup_allowed(name), Err(ErrorCode::PermanentResolverFailure)), "{name}");
        }
        assert!(matches!(p.lookup_allowed("bad name"), Err(ErrorCode::InvalidArgument)));
    }

    #[test]
    fn the_log_is_capped_and_counts_the_rest() {
        let p = policy(&["127.0.0.1:1"]);
        for _ in 0..MAX_EGRESS_ENTRIES {
            assert!(p.log(1, Ok("127.0.0.1".into())).is_some(), "a kept allowed entry has counters");
        }
        for _ in 0..5 {
            assert!(connect(&p, "127.0.0.1:1"));
            assert!(p.log(1, Ok("127.0.0.1".into())).is_none(), "an entry not kept has none");
        }
        let (entries, dropped) = p.take_entries();
        assert_eq!((entries.len(), dropped), (MAX_EGRESS_ENTRIES, 10));
    }

    #[test]
    fn the_tcp_functions_strata_shadows_are_wasmtime_wasis() {
        let engine = wasmtime::Engine::default();
        let mut linker = Linker::<Job>::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker).expect("wasi");
        // Without shadowing, defining a function wasmtime-wasi defined fails: the instance's name is its.
        let err = linker
            .instance(TCP_INSTANCE)
            .expect("instance")
            .func_wrap("[method]tcp-socket.finish-connect", |_, (): ()| Ok(()))
            .expect_err("wasmtime-wasi defines finish-connect under this name");
        assert!(err.to_string().contains("defined twice"), "{err}");
        add_to_linker(&mut linker).expect("shadowed");
    }

    /// A store's data with a WASI context and a network: what a job's has for these layers.
    struct Job {
        wasi: wasmtime_wasi::p1::WasiP1Ctx,
        net: Option<Arc<NetPolicy>>,
    }

    impl wasmtime_wasi::WasiView for Job {
        fn ctx(&mut self) -> wasmtime_wasi::WasiCtxView<'_> {
            self.wasi.ctx()
        }
    }

    impl NetView for Job {
        fn net(&mut self) -> NetCtxView<'_> {
            NetCtxView { sockets: self.wasi.sockets(), policy: self.net.as_ref() }
        }
    }

    /// A job's store with the network of `policy`, outside any component.
    fn store(policy: &Arc<NetPolicy>) -> wasmtime::Store<Job> {
        let mut builder = WasiCtxBuilder::new();
        configure(&mut builder, Some(policy));
        let job = Job { wasi: builder.build_p1(), net: Some(policy.clone()) };
        wasmtime::Store::new(&wasmtime::Engine::default(), job)
    }

    /// A host server on 127.0.0.1 that echoes what each connection sends.
    fn echo_server() -> u16 {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                std::thread::spawn(move || {
                    let mut reader = stream.try_clone().expect("clone");
                    let mut writer = stream;
                    let _ = std::io::copy(&mut reader, &mut writer);
                });
            }
        });
        port
    }

    fn borrow<T: 'static>(resource: &Resource<T>) -> Resource<T> {
        Resource::new_borrow(resource.rep())
    }

    /// Sends `n` bytes on a connection's streams and reads back as many.
    async fn echo(table: &mut ResourceTable, (input, output): &Streams, n: usize) {
        let sent = bytes::Bytes::from(vec![b'x'; n]);
        table.get_mut(output).expect("output").blocking_write_and_flush(sent).await.expect("write");
        let mut got = 0;
        while got < n {
            got += table.get_mut(input).expect("input").blocking_read(n - got).await.expect("read").len();
        }
    }

    #[test]
    fn connections_to_one_address_count_into_their_own_entries_whatever_the_order() {
        let port = echo_server();
        let p = policy(&[&format!("127.0.0.1:{port}")]);
        let mut store = store(&p);
        let runtime = runtime();
        runtime.block_on(async {
            let (network, [a, b, c]) = {
                let mut sockets = store.data_mut().wasi.sockets();
                let network = network_host(&mut sockets);
                let sockets = [(); 3].map(|()| {
                    wasmtime_wasi::p2::bindings::sockets::tcp_create_socket::Host::create_tcp_socket(
                        &mut sockets,
                        network::IpAddressFamily::Ipv4,
                    )
                    .expect("socket")
                });
                (network, sockets)
            };
            let to = |port: u16| IpSocketAddress::from(SocketAddr::from(([127, 0, 0, 1], port)));
            // A and B start connecting to the same address; C is denied; B finishes first.
            for socket in [&a, &b] {
                let started = start_connect(store.as_context_mut(), borrow(socket), borrow(&network), to(port)).await;
                assert_eq!(started.expect("no trap").0, Ok(()));
            }
            let started = start_connect(store.as_context_mut(), borrow(&c), borrow(&network), to(port + 1)).await;
            assert_eq!(started.expect("no trap").0, Err(ErrorCode::AccessDenied));
            let mut streams = Vec::new();
            for socket in [&b, &a] {
                loop {
                    match finish_connect(store.as_context_mut(), borrow(socket)).expect("no trap").0 {
                        Ok(pair) => break streams.push(pair),
                        Err(ErrorCode::WouldBlock) => tokio::time::sleep(Duration::from_millis(1)).await,
                        Err(err) => panic!("connect: {err:?}"),
                    }
                }
            }
            let table = store.data_mut().wasi.sockets().table;
            echo(table, &streams[0], 1000).await; // B
            echo(table, &streams[1], 10).await; // A
        });
        let (entries, _) = p.take_entries();
        let summary: Vec<_> = entries.iter().map(|e| (e.port, e.verdict.as_str(), e.bytes_up, e.bytes_down)).collect();
        assert_eq!(summary, [(port, "allowed", 10, 10), (port, "allowed", 1000, 1000), (port + 1, "denied", 0, 0)]);
    }

    fn network_host(sockets: &mut WasiSocketsCtxView<'_>) -> Resource<Network> {
        wasmtime_wasi::p2::bindings::sockets::instance_network::Host::instance_network(sockets).expect("network")
    }

    #[test]
    fn the_stream_wrappers_count_what_passes_and_delegate_the_rest() {
        use wasmtime_wasi::p2::pipe::{MemoryInputPipe, MemoryOutputPipe};
        let counters = Arc::new(Counters::default());
        let mut input =
            CountedInput { inner: Box::new(MemoryInputPipe::new(vec![7u8; 100])), counters: counters.clone() };
        let sink = MemoryOutputPipe::new(1 << 20);
        let mut output = CountedOutput { inner: Box::new(sink.clone()), counters: counters.clone(), gate: None };
        runtime().block_on(async {
            assert_eq!(input.read(30).expect("read").len(), 30);
            assert_eq!(input.skip(20).expect("skip"), 20);
            assert_eq!(input.blocking_read(1000).await.expect("read").len(), 50);
            assert!(matches!(input.read(1), Err(wasmtime_wasi::p2::StreamError::Closed)));
            output.write(bytes::Bytes::from_static(b"hello")).expect("write");
            output.write_zeroes(3).expect("zeroes");
            output.blocking_write_and_flush(bytes::Bytes::from(vec![1u8; 5000])).await.expect("write");
        });
        assert_eq!(sink.contents().len(), 5008);
        assert_eq!((counters.up.load(Ordering::Relaxed), counters.down.load(Ordering::Relaxed)), (5008, 100));
    }
}
