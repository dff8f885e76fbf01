//! Network egress of WASI 0.2 components: `wasi:sockets` with every address checked against the job's
//! allowlist, and every connect attempt logged.
//!
//! Without network (`Net::Deny`, the default) a component's WASI context allows no TCP, no UDP and no name
//! lookup, and its address check says no to everything: it has no network at all.
//!
//! With `Net::Allow(specs)` the specs are parsed by [`strata_egress::Allowlist`], whose matching rules, default
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
//!   name resolved to it: a socket sees addresses, not names, which is also why the egress proxy's TLS SNI check
//!   has no equivalent here.
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
//! observed) or `denied` with a `reason`. `bytes_up` and `bytes_down` are **always 0**: the bytes flow through
//! wasmtime-wasi's own socket streams, which Strata cannot count without re-implementing `wasi:sockets`. At most
//! [`MAX_EGRESS_ENTRIES`] are kept per job; further attempts are counted and logged, not kept.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use strata_core::{Capabilities, EgressEntry, Net, TierError};
use strata_egress::{Allowlist, Host, HostPattern};
use wasmtime::component::{HasData, Resource};
use wasmtime_wasi::WasiCtxBuilder;
use wasmtime_wasi::p2::bindings::sockets::ip_name_lookup::{self, HostResolveAddressStream, ResolveAddressStream};
use wasmtime_wasi::p2::bindings::sockets::network::{self, ErrorCode, HostNetwork, IpAddress, Network};
use wasmtime_wasi::p2::{DynPollable, SocketError};
use wasmtime_wasi::sockets::{SocketAddrUse, WasiSocketsCtxView, WasiSocketsView};

use crate::exec::JobState;

/// The `kind` of a wasm component's egress entries: one TCP connect attempt, judged by the address check.
/// Its `bytes_up` and `bytes_down` are always 0 (the socket streams are wasmtime-wasi's and are not counted).
pub const EGRESS_KIND_TCP: &str = "tcp";

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
    entries: Vec<EgressEntry>,
    dropped: u64,
}

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
            Net::Allow(specs) => {
                let allow = parse_allowlist(specs)?;
                Ok(Some(Arc::new(NetPolicy {
                    allow,
                    state: Mutex::new(NetState::default()),
                    rules_resolved: tokio::sync::OnceCell::new(),
                })))
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, NetState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The egress entries so far, and how many attempts were not kept.
    pub(crate) fn take_entries(&self) -> (Vec<EgressEntry>, u64) {
        let mut state = self.lock();
        (std::mem::take(&mut state.entries), std::mem::take(&mut state.dropped))
    }

    /// What wasmtime-wasi asks before every socket operation.
    async fn check(&self, addr: SocketAddr, used: SocketAddrUse) -> bool {
        match used {
            // The implicit bind of a connect (to the wildcard address, port 0); explicit binds elsewhere are refused.
            SocketAddrUse::TcpBind => addr.ip().is_unspecified() && addr.port() == 0,
            SocketAddrUse::TcpConnect => self.connect(addr).await,
            _ => false,
        }
    }

    /// Judges and logs one connect attempt.
    async fn connect(&self, addr: SocketAddr) -> bool {
        let (ip, port) = (addr.ip().to_canonical(), addr.port());
        let mut verdict = self.judge(ip, port);
        if verdict.is_err() && !self.rules_resolved.initialized() {
            self.resolve_rules().await;
            verdict = self.judge(ip, port);
        }
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
        };
        let mut state = self.lock();
        if state.entries.len() < MAX_EGRESS_ENTRIES {
            state.entries.push(entry);
        } else {
            state.dropped += 1;
        }
        allowed
    }

    /// Whether `ip:port` may be reached: `Ok(host)` with the name (or IP) it is allowed as, or `Err((host,
    /// reason))`.
    fn judge(&self, ip: IpAddr, port: u16) -> Result<String, (String, String)> {
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

/// Parses a job's `--allow-net` specs; a malformed one is a `wrong_format` error naming it, as on every tier.
fn parse_allowlist(specs: &[String]) -> Result<Allowlist, TierError> {
    Ok(Allowlist::parse(specs)?)
}

/// Checks a job's network capability before anything is built: every spec parses.
pub(crate) fn check_specs(net: &Net) -> Result<(), TierError> {
    match net {
        Net::Deny => Ok(()),
        Net::Allow(specs) => parse_allowlist(specs).map(|_| ()),
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
                let policy = policy.clone();
                Box::pin(async move { policy.check(addr, used).await })
            });
        }
    }
}

/// `wasi:sockets/ip-name-lookup` as Strata links it: the job's policy in front of wasmtime-wasi's resolver.
pub(crate) struct FilteredLookup;

impl HasData for FilteredLookup {
    type Data<'a> = LookupView<'a>;
}

/// What the lookup filter works on: the store's sockets context and the job's network policy.
pub(crate) struct LookupView<'a> {
    sockets: WasiSocketsCtxView<'a>,
    net: Option<&'a NetPolicy>,
}

/// The filter's view of a job's store.
pub(crate) fn lookup_view(state: &mut JobState) -> LookupView<'_> {
    LookupView { sockets: state.wasi.sockets(), net: state.net.as_deref() }
}

fn ip_of(address: &IpAddress) -> IpAddr {
    match *address {
        IpAddress::Ipv4((a, b, c, d)) => IpAddr::from([a, b, c, d]),
        IpAddress::Ipv6((a, b, c, d, e, f, g, h)) => IpAddr::from([a, b, c, d, e, f, g, h]),
    }
}

// The lookup interface uses `wasi:sockets/network`'s types, so its host trait needs the network's: delegated.
impl network::Host for LookupView<'_> {
    fn convert_error_code(&mut self, error: SocketError) -> wasmtime::Result<ErrorCode> {
        network::Host::convert_error_code(&mut self.sockets, error)
    }

    fn network_error_code(&mut self, err: Resource<wasmtime::Error>) -> wasmtime::Result<Option<ErrorCode>> {
        network::Host::network_error_code(&mut self.sockets, err)
    }
}

impl HostNetwork for LookupView<'_> {
    fn drop(&mut self, this: Resource<Network>) -> wasmtime::Result<()> {
        HostNetwork::drop(&mut self.sockets, this)
    }
}

impl ip_name_lookup::Host for LookupView<'_> {
    fn resolve_addresses(
        &mut self,
        network: Resource<Network>,
        name: String,
    ) -> Result<Resource<ResolveAddressStream>, SocketError> {
        let Some(net) = self.net else {
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

impl HostResolveAddressStream for LookupView<'_> {
    fn resolve_next_address(
        &mut self,
        stream: Resource<ResolveAddressStream>,
    ) -> Result<Option<IpAddress>, SocketError> {
        let rep = stream.rep();
        let next = HostResolveAddressStream::resolve_next_address(&mut self.sockets, stream)?;
        if let (Some(net), Some(address)) = (self.net, &next) {
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
        if let Some(net) = self.net {
            net.lock().lookups.remove(&stream.rep());
        }
        HostResolveAddressStream::drop(&mut self.sockets, stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(specs: &[&str]) -> Arc<NetPolicy> {
        let caps =
            Capabilities { net: Net::Allow(specs.iter().map(|s| s.to_string()).collect()), ..Default::default() };
        NetPolicy::for_caps(&caps).expect("valid specs").expect("a policy")
    }

    fn check(policy: &NetPolicy, addr: &str, used: SocketAddrUse) -> bool {
        let addr: SocketAddr = addr.parse().expect("address");
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(policy.check(addr, used))
    }

    #[test]
    fn no_network_is_no_policy_and_a_malformed_spec_is_refused() {
        assert!(NetPolicy::for_caps(&Capabilities::default()).expect("deny").is_none());
        let caps = Capabilities { net: Net::Allow(vec!["http://x".into()]), ..Default::default() };
        let err = NetPolicy::for_caps(&caps).expect_err("malformed");
        assert!(err.to_string().contains("http://x"), "{err}");
    }

    #[test]
    fn only_connects_to_allowed_ip_and_port_pass_and_each_is_logged() {
        let p = policy(&["127.0.0.1:8080", "[::1]"]);
        assert!(check(&p, "127.0.0.1:8080", SocketAddrUse::TcpConnect));
        assert!(!check(&p, "127.0.0.1:8081", SocketAddrUse::TcpConnect));
        assert!(check(&p, "[::1]:22", SocketAddrUse::TcpConnect), "no port means any port");
        assert!(check(&p, "[::ffff:127.0.0.1]:8080", SocketAddrUse::TcpConnect), "v4-mapped is the v4 address");
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
        assert!(check(&p, "93.184.216.34:443", SocketAddrUse::TcpConnect));
        assert!(!check(&p, "93.184.216.34:80", SocketAddrUse::TcpConnect), "the rule's port");
        assert!(!check(&p, "10.0.0.7:443", SocketAddrUse::TcpConnect), "a private address behind a public name");
        assert!(!check(&p, "93.184.216.35:443", SocketAddrUse::TcpConnect), "an address no allowed name has");
        // The exact-name rule `localhost` is resolved by the host on the first refusal.
        assert!(check(&p, "127.0.0.1:8080", SocketAddrUse::TcpConnect));
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
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        for _ in 0..MAX_EGRESS_ENTRIES + 5 {
            runtime.block_on(p.check("127.0.0.1:1".parse().expect("addr"), SocketAddrUse::TcpConnect));
        }
        let (entries, dropped) = p.take_entries();
        assert_eq!((entries.len(), dropped), (MAX_EGRESS_ENTRIES, 5));
    }
}
