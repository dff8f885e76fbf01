//! Many `strata serve` nodes as one service, coordinated through etcd ([`strata_fleet`] is the protocol, without
//! I/O; this module runs it).
//!
//! - **Membership.** A node registers `{prefix}nodes/{name}` under an etcd lease it keeps alive (TTL
//!   [`FleetConfig::lease_ttl`]), with its capacity (CPUs, vCPU slots per CPU, memory it admits), then rewrites its
//!   alloc to what it actually runs (nothing, after a start) and deletes the catalog entries of an earlier
//!   incarnation of itself. A node that loses its lease (etcd expired it: a partition, a stall) kills what it runs —
//!   the fleet has reported those sandboxes `sandbox_lost` — and registers again as a new incarnation.
//! - **Placement.** A create goes through [`Fleet::place`]: the protocol's sorted first-fit over the nodes'
//!   allocs, reserved in one transaction that checks the node's lease and its alloc's mod revision (the fencing
//!   revision), so two nodes placing at once never over-commit a third. The chosen node confirms the reservation
//!   before it creates anything; a node that cannot honour a placement refuses, the reservation is released and
//!   the placer tries the next node ([`placement`]).
//! - **Routing.** Any node answers any request for any sandbox: one it does not hold is looked up in the catalog
//!   and the request forwarded, unchanged, to the owner (HTTP, WebSocket and E2B Connect streams alike); a
//!   sandbox whose owner's lease is gone is `410 sandbox_lost`, never a hang or a silent 404.
//!
//! Every etcd call is bounded ([`FleetConfig::etcd_timeout`]): with etcd unreachable a node keeps serving the
//! sandboxes it holds and refuses new placements with `503 fleet_unavailable`.

pub mod api;
pub mod placement;
pub mod proxy;
pub mod route;
pub mod snapshots;
pub mod store;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use strata_fleet::{
    AllocEntry, NodeRecord, Owner, PlanError, Protocol, Release, RequestError, SandboxRequest, View, valid_name,
};

pub use store::Store;

use crate::AppState;
use crate::tls::Tls;

/// How a node joins a fleet.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    /// etcd's client URLs (`http://host:port`, or `https://host:port` in a fleet with mutual TLS).
    pub endpoints: Vec<String>,
    /// This node's name, unique in the fleet (letters, digits, `.`, `_`, `:`, `-`).
    pub node: String,
    /// The URL other nodes reach this node's API at (`http://host:port`, or `https://` with mutual TLS).
    pub advertise: String,
    /// The lease's time to live: a node that stops renewing it is out of the fleet after this long.
    pub lease_ttl: Duration,
    /// The keys' prefix in etcd ([`strata_fleet::protocol::DEFAULT_PREFIX`] by default).
    pub prefix: String,
    /// How long one etcd request may take before it counts as failed.
    pub etcd_timeout: Duration,
    /// The CA etcd's server certificates chain to, when it is not the fleet CA.
    pub etcd_ca: Option<std::path::PathBuf>,
    /// How often the node releases reservations on it that nobody confirmed: one still reserved a whole period
    /// later is released (a placer forwards at once; the node confirms before it creates). 15 s by default.
    pub reservation_sweep: Duration,
}

impl FleetConfig {
    /// `node` at `advertise`, through etcd at `endpoints`, with a 5 s lease.
    pub fn new(endpoints: Vec<String>, node: &str, advertise: &str) -> FleetConfig {
        FleetConfig {
            endpoints,
            node: node.to_owned(),
            advertise: advertise.to_owned(),
            lease_ttl: Duration::from_secs(5),
            prefix: strata_fleet::protocol::DEFAULT_PREFIX.to_owned(),
            etcd_timeout: Duration::from_secs(2),
            etcd_ca: None,
            reservation_sweep: RESERVATION_SWEEP,
        }
    }

    /// Checks the names and URLs against the TLS the node has: with mutual TLS (a certificate and a fleet CA)
    /// every URL is `https://`; without, every URL is `http://` and loopback (traffic that never leaves the
    /// machine), and the fleet runs with a warning.
    pub fn validate(&self, tls: Option<&Tls>) -> Result<(), FleetError> {
        if !valid_name(&self.node) {
            return Err(FleetError::Config(format!(
                "{:?} is not a node name (letters, digits, '.', '_', ':', '-'; at most 128)",
                self.node
            )));
        }
        if self.endpoints.is_empty() {
            return Err(FleetError::Config("no etcd endpoint".into()));
        }
        let mutual = match tls {
            Some(tls) if tls.has_fleet_ca() => true,
            Some(_) => {
                return Err(FleetError::Config(
                    "a node serving over TLS talks to its fleet over mutual TLS: pass --fleet-ca (the CA node \
                     certificates chain to)"
                        .into(),
                ));
            }
            None => false,
        };
        for url in self.endpoints.iter().chain([&self.advertise]) {
            let parsed = proxy::NodeUrl::parse(url).map_err(|why| FleetError::Config(format!("{url:?}: {why}")))?;
            if mutual && !parsed.tls {
                return Err(FleetError::Config(format!(
                    "{url:?}: a fleet with mutual TLS names its nodes and etcd members by https:// URLs"
                )));
            }
            if !mutual && parsed.tls {
                return Err(FleetError::Config(format!(
                    "{url:?}: an https:// URL needs this node to speak mutual TLS: pass --tls-cert, --tls-key and --fleet-ca"
                )));
            }
            if !mutual && !parsed.is_loopback() {
                return Err(FleetError::Config(format!(
                    "{url:?} is not a loopback address: a fleet whose traffic leaves the machine runs over mutual \
                     TLS (pass --tls-cert, --tls-key and --fleet-ca, and https:// URLs)"
                )));
            }
        }
        if self.lease_ttl < Duration::from_secs(1) {
            return Err(FleetError::Config("the lease TTL must be at least 1 s".into()));
        }
        Ok(())
    }
}

/// Why the fleet could not do something.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    /// The configuration is not usable.
    #[error("fleet configuration: {0}")]
    Config(String),
    /// etcd could not be reached at all.
    #[error("etcd at {endpoints} cannot be reached: {why}")]
    Unreachable {
        /// The endpoints.
        endpoints: String,
        /// Why.
        why: String,
    },
    /// An etcd request failed or timed out.
    #[error("etcd {what} failed: {why}")]
    Etcd {
        /// The request.
        what: String,
        /// Why.
        why: String,
    },
    /// Another process holds this node's name.
    #[error(
        "node {0} is registered by another process (or by this node before a restart, and its lease has not expired)"
    )]
    NameTaken(String),
    /// The request cannot be placed as asked.
    #[error(transparent)]
    Request(#[from] RequestError),
    /// No node can take the request.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// This node is not registered now (its lease was lost and it has not registered again yet).
    #[error("this node is not registered in the fleet now (its lease was lost)")]
    NotRegistered,
    /// A reservation was released before this node confirmed it (its placer gave up).
    #[error("the reservation of sandbox {0} is gone (its placer gave up)")]
    ReservationLost(String),
    /// This node already took that id once (a second forward of one placement).
    #[error("sandbox {0} was already created on this node")]
    AlreadyTaken(String),
    /// The fleet's keys kept changing under a transaction.
    #[error("the fleet's state kept changing; gave up after {0} attempts")]
    Contended(usize),
}

/// Transactions retried on a failed compare before [`FleetError::Contended`].
const ATTEMPTS: usize = 16;

/// What a node offers the fleet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    /// CPUs sandboxes are packed onto.
    pub cpus: u32,
    /// vCPU slots per CPU (0: CPUs not admitted against).
    pub slots: u32,
    /// Bytes of memory limits admitted in all.
    pub memory: u64,
}

/// This node's membership of a fleet.
pub struct Fleet {
    config: FleetConfig,
    protocol: Protocol,
    /// The etcd connection, made again when the node's certificate is reloaded ([`Fleet::refresh_store`]).
    store: std::sync::RwLock<Store>,
    /// The node's TLS (`None`: a loopback fleet in plain HTTP), and the generation the store was made with.
    tls: Option<Arc<Tls>>,
    /// Idle connections to other nodes ([`proxy::Pool`]).
    pool: Arc<proxy::Pool>,
    store_generation: AtomicU64,
    capacity: Capacity,
    /// The current registration: its incarnation and lease (0 while not registered).
    incarnation: AtomicU64,
    lease: AtomicI64,
    draining: AtomicBool,
    /// The last time etcd renewed the lease.
    renewed: Mutex<Instant>,
    /// The runtime the node runs on, for work started off it (a sandbox's kill hook runs on a blocking thread).
    runtime: Option<tokio::runtime::Handle>,
    /// Placements through this node, one at a time: concurrent ones would only fail each other's fencing compare
    /// in etcd and read again.
    placing: tokio::sync::Mutex<()>,
    /// Owners looked up lately ([`Fleet::lookup`]): a sandbox never moves between nodes, so an owner found stays
    /// right until that node goes; an entry is used for [`OWNER_CACHE_TTL`] and dropped when forwarding to it fails.
    owners: Mutex<std::collections::HashMap<String, (String, Instant)>>,
    /// The ids this incarnation took (confirmed) whose catalog entry is not yet deleted: a node creates an id at
    /// most once, so a second forward of one is refused rather than confirmed from an earlier `Active` entry.
    /// Once an entry is deleted a second confirmation fails on its own, so the id is forgotten then.
    taken: Mutex<std::collections::HashSet<String>>,
    /// Counters for `/metrics` ([`Fleet::render_metrics`]).
    pub counters: Counters,
}

/// What a node counts of its part in the fleet.
#[derive(Debug, Default)]
pub struct Counters {
    /// Requests for sandboxes of other nodes, forwarded to them.
    pub forwarded: AtomicU64,
    /// Requests answered `410 sandbox_lost`.
    pub lost: AtomicU64,
    /// Creates placed on this node (reserved and confirmed here).
    pub placed_here: AtomicU64,
    /// Creates placed on another node and forwarded there.
    pub placed_elsewhere: AtomicU64,
    /// Forwarded creates another node refused (then tried on the next).
    pub refused: AtomicU64,
    /// Times the lease was lost (the node killed what it held and registered again).
    pub leases_lost: AtomicU64,
}

/// [`FleetConfig::reservation_sweep`] by default.
const RESERVATION_SWEEP: Duration = Duration::from_secs(15);

/// The pause before renewing again after a renewal failed.
const RENEW_RETRY: Duration = Duration::from_millis(200);

/// How long an owner looked up is used without asking etcd again.
const OWNER_CACHE_TTL: Duration = Duration::from_secs(2);

/// Owners remembered at most (the oldest are dropped first past this).
const OWNER_CACHE_MAX: usize = 4096;

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet").field("node", &self.config.node).field("store", &self.store()).finish_non_exhaustive()
    }
}

impl Fleet {
    /// Connects to etcd, registers this node (waiting up to the lease's TTL for the lease of an earlier start
    /// of it to expire) and cleans up what an earlier incarnation left. Nothing runs on this node yet, so its alloc
    /// becomes empty.
    pub async fn join(
        config: FleetConfig,
        capacity: Capacity,
        tls: Option<Arc<Tls>>,
    ) -> Result<Arc<Fleet>, FleetError> {
        config.validate(tls.as_deref())?;
        if tls.is_none() {
            tracing::warn!(
                node = %config.node,
                "the fleet runs without TLS: its nodes and etcd are all on loopback; any other address needs mutual TLS"
            );
        }
        let generation = tls.as_ref().map_or(0, |tls| tls.generation());
        let store = Store::connect(&config.endpoints, config.etcd_timeout, etcd_tls(&config, tls.as_deref())?).await?;
        let fleet = Arc::new(Fleet {
            protocol: Protocol::new(&config.prefix),
            store: std::sync::RwLock::new(store),
            tls,
            pool: Arc::default(),
            store_generation: AtomicU64::new(generation),
            capacity,
            incarnation: AtomicU64::new(0),
            lease: AtomicI64::new(0),
            draining: AtomicBool::new(false),
            renewed: Mutex::new(Instant::now()),
            runtime: tokio::runtime::Handle::try_current().ok(),
            placing: tokio::sync::Mutex::new(()),
            owners: Mutex::new(std::collections::HashMap::new()),
            taken: Mutex::new(std::collections::HashSet::new()),
            counters: Counters::default(),
            config,
        });
        fleet.register(&[]).await?;
        Ok(fleet)
    }

    /// This node's name.
    pub fn node(&self) -> &str {
        &self.config.node
    }

    /// The fleet's configuration.
    pub fn config(&self) -> &FleetConfig {
        &self.config
    }

    /// The protocol (its keys).
    pub fn protocol(&self) -> &Protocol {
        &self.protocol
    }

    /// The etcd connection.
    pub fn store(&self) -> Store {
        self.store.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// Whether the fleet's traffic is mutual TLS (else a loopback fleet in plain HTTP).
    pub fn mutual_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// Connects to etcd again when the node's certificate was reloaded since the store was made, so that new
    /// etcd connections present the new certificate; on failure the old store stays and the next call tries again.
    async fn refresh_store(&self) {
        let Some(tls) = &self.tls else { return };
        let generation = tls.generation();
        if generation == self.store_generation.load(Ordering::SeqCst) {
            return;
        }
        let connected = match etcd_tls(&self.config, Some(tls)) {
            Ok(options) => Store::connect(&self.config.endpoints, self.config.etcd_timeout, options).await,
            Err(err) => Err(err),
        };
        match connected {
            Ok(store) => {
                *self.store.write().unwrap_or_else(std::sync::PoisonError::into_inner) = store;
                self.store_generation.store(generation, Ordering::SeqCst);
                tracing::info!(node = %self.config.node, generation, "etcd reconnected with the reloaded certificate");
            }
            Err(err) => tracing::warn!(error = %err, "cannot reconnect to etcd with the reloaded certificate"),
        }
    }

    /// Sends `request` to the node at `advertise` ([`proxy::forward`]) over this node's TLS, if any.
    pub async fn forward(
        &self,
        advertise: &str,
        request: axum::extract::Request,
    ) -> Result<axum::response::Response, crate::ApiError> {
        let connector = self.tls.as_ref().and_then(|tls| tls.connector());
        proxy::forward(&self.config.node, advertise, connector.as_ref(), Some(&self.pool), request).await
    }

    /// The current incarnation and lease; [`FleetError::NotRegistered`] while the node is out.
    fn registration(&self) -> Result<(u64, i64), FleetError> {
        let lease = self.lease.load(Ordering::SeqCst);
        if lease == 0 {
            return Err(FleetError::NotRegistered);
        }
        Ok((self.incarnation.load(Ordering::SeqCst), lease))
    }

    /// Whether this node is registered now.
    pub fn registered(&self) -> bool {
        self.lease.load(Ordering::SeqCst) != 0
    }

    fn record(&self, incarnation: u64) -> NodeRecord {
        NodeRecord {
            name: self.config.node.clone(),
            advertise: self.config.advertise.clone(),
            incarnation,
            cpus: self.capacity.cpus,
            slots: self.capacity.slots,
            memory: self.capacity.memory,
            draining: self.draining.load(Ordering::SeqCst),
        }
    }

    /// Registers as a new incarnation with a new lease, then makes the alloc `running` and removes stale
    /// catalog entries.
    async fn register(&self, running: &[AllocEntry]) -> Result<(), FleetError> {
        self.lease.store(0, Ordering::SeqCst);
        let incarnation = new_incarnation();
        let deadline = Instant::now() + self.config.lease_ttl + Duration::from_secs(2);
        let lease = loop {
            let lease = self.store().grant(self.config.lease_ttl).await?;
            let txn = self.protocol.register(&self.record(incarnation), lease)?;
            if self.store().txn(&txn).await? {
                break lease;
            }
            let _ = self.store().revoke(lease).await;
            if Instant::now() >= deadline {
                return Err(FleetError::NameTaken(self.config.node.clone()));
            }
            tracing::info!(node = %self.config.node, "the node's name is still registered (an earlier start?); waiting for its lease to expire");
            tokio::time::sleep(Duration::from_millis(500)).await;
        };
        *self.renewed.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Instant::now();
        for attempt in 0.. {
            if attempt == ATTEMPTS {
                return Err(FleetError::Contended(ATTEMPTS));
            }
            let mut kvs = self.store().range(&self.protocol.node_key(&self.config.node)).await?;
            kvs.extend(self.store().range(&self.protocol.alloc_key(&self.config.node)).await?);
            kvs.extend(self.store().range(&self.protocol.sandboxes_prefix()).await?);
            let view = self.protocol.view(&kvs);
            let cleanup = self.protocol.cleanup(&view, &self.config.node, incarnation, lease, running)?;
            if cleanup.is_done() {
                break;
            }
            if let Some(alloc) = &cleanup.alloc {
                self.store().txn(alloc).await?;
                continue;
            }
            for txn in &cleanup.catalog {
                self.store().txn(txn).await?;
            }
        }
        // The snapshots of an earlier incarnation went with its state directory.
        let snapshots = self.store().range(&self.protocol.snapshots_prefix()).await?;
        for txn in self.protocol.stale_snapshots(&self.protocol.view(&snapshots), &self.config.node, incarnation) {
            self.store().txn(&txn).await?;
        }
        self.taken.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clear();
        self.incarnation.store(incarnation, Ordering::SeqCst);
        self.lease.store(lease, Ordering::SeqCst);
        tracing::info!(node = %self.config.node, incarnation, lease, "registered in the fleet");
        Ok(())
    }

    /// Marks the node as draining (no new placements) or not, in its record.
    pub async fn set_draining(&self, draining: bool) -> Result<(), FleetError> {
        self.draining.store(draining, Ordering::SeqCst);
        let (incarnation, lease) = self.registration()?;
        let txn = self.protocol.update(&self.record(incarnation), lease)?;
        if !self.store().txn(&txn).await? {
            return Err(FleetError::NotRegistered);
        }
        Ok(())
    }

    /// Whether this node is draining.
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// The node records and allocs (what placement reads).
    async fn placement_view(&self) -> Result<View, FleetError> {
        let mut kvs = self.store().range(&self.protocol.nodes_prefix()).await?;
        kvs.extend(self.store().range(&self.protocol.allocs_prefix()).await?);
        Ok(self.protocol.view(&kvs))
    }

    /// Every node, as etcd has it now.
    pub async fn nodes(&self) -> Result<View, FleetError> {
        self.placement_view().await
    }

    /// Reserves room for `request` (placed whole on one node) on the first node that has it, skipping `exclude`:
    /// the plan (node, its URL, the entries reserved) once its transaction went through.
    pub async fn place(
        &self,
        request: &[SandboxRequest],
        exclude: &BTreeSet<String>,
    ) -> Result<strata_fleet::Plan, FleetError> {
        self.registration()?;
        let _one_at_a_time = self.placing.lock().await;
        for _ in 0..ATTEMPTS {
            let view = self.placement_view().await?;
            let plan = self.protocol.plan(&view, request, exclude)?;
            if self.store().txn(&plan.txn).await? {
                return Ok(plan);
            }
        }
        Err(FleetError::Contended(ATTEMPTS))
    }

    /// Reserves and confirms room for sandbox `id` of `vcpus` and `memory` on this node (a sandbox made here for
    /// a reason of its own: a fork of a snapshot this node holds, a resume, a create outside a create route).
    pub async fn place_here(&self, id: &str, vcpus: u32, memory: u64) -> Result<(), FleetError> {
        let view = self.placement_view().await?;
        let others: BTreeSet<String> = view.nodes.keys().filter(|name| *name != self.node()).cloned().collect();
        self.place(&[SandboxRequest { id: id.to_owned(), vcpus, memory }], &others).await?;
        self.confirm(&[id.to_owned()]).await
    }

    /// Confirms the reservations `ids` on this node before it creates them ([`Protocol::confirm`]). The answer
    /// is read from the catalog, not from the transaction's reply: when it fails or gets no answer, an earlier
    /// try held up on its way to etcd may have been applied since, so the entries are read back — `Active` on
    /// this incarnation is confirmed, still `Reserved` is tried again, anything else is lost.
    pub async fn confirm(&self, ids: &[String]) -> Result<(), FleetError> {
        let (incarnation, lease) = self.registration()?;
        {
            let mut taken = self.taken.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some(id) = ids.iter().find(|id| taken.contains(*id)) {
                return Err(FleetError::AlreadyTaken(id.clone()));
            }
            taken.extend(ids.iter().cloned());
        }
        let txn = self.protocol.confirm(&self.config.node, incarnation, lease, ids)?;
        let mut last = None;
        for _ in 0..ATTEMPTS {
            match self.store().txn(&txn).await {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(err) => last = Some(err),
            }
            let mut kvs = Vec::new();
            for id in ids {
                match self.store().get(&self.protocol.sandbox_key(id)).await {
                    Ok(kv) => kvs.extend(kv),
                    Err(err) => return Err(last.unwrap_or(err)),
                }
            }
            let view = self.protocol.view(&kvs);
            let ours = |state: strata_fleet::SandboxState| {
                ids.iter().all(|id| {
                    view.catalog.get(id).is_some_and(|entry| {
                        entry.value.node == self.config.node
                            && entry.value.incarnation == incarnation
                            && entry.value.state == state
                    })
                })
            };
            if ours(strata_fleet::SandboxState::Active) {
                return Ok(());
            }
            if !ours(strata_fleet::SandboxState::Reserved) {
                return Err(FleetError::ReservationLost(ids.join(", ")));
            }
        }
        Err(last.unwrap_or(FleetError::Contended(ATTEMPTS)))
    }

    /// Gives up the reservation of `ids` on `node` as `incarnation`: whether it was released (`false`: the node
    /// confirmed it meanwhile, so it took the sandboxes).
    pub async fn release_reservation(&self, node: &str, incarnation: u64, ids: &[String]) -> Result<bool, FleetError> {
        for _ in 0..ATTEMPTS {
            let mut kvs = self.store().range(&self.protocol.alloc_key(node)).await?;
            for id in ids {
                kvs.extend(self.store().get(&self.protocol.sandbox_key(id)).await?);
            }
            let view = self.protocol.view(&kvs);
            match self.protocol.release_reservation(&view, node, incarnation, ids)? {
                Release::Taken => return Ok(false),
                Release::Gone => return Ok(true),
                Release::Txn(txn) => {
                    if self.store().txn(&txn).await? {
                        return Ok(true);
                    }
                }
            }
        }
        Err(FleetError::Contended(ATTEMPTS))
    }

    /// Frees sandbox `id`, which ended on this node: out of the alloc and the catalog.
    pub async fn release_sandbox(&self, id: &str) -> Result<(), FleetError> {
        let incarnation = self.incarnation.load(Ordering::SeqCst);
        for _ in 0..ATTEMPTS {
            let mut kvs = self.store().range(&self.protocol.alloc_key(&self.config.node)).await?;
            kvs.extend(self.store().get(&self.protocol.sandbox_key(id)).await?);
            let view = self.protocol.view(&kvs);
            let released = match self.protocol.release_sandbox(&view, &self.config.node, incarnation, id) {
                None => true,
                Some(txn) => self.store().txn(&txn).await?,
            };
            if released {
                // Its catalog entry is gone, so a late second forward of it can no longer be confirmed: the id
                // need not be remembered (what bounds `taken` by the sandboxes alive).
                self.taken.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(id);
                return Ok(());
            }
        }
        Err(FleetError::Contended(ATTEMPTS))
    }

    /// Who holds sandbox `id`: a remote owner seen in the last 2 s without asking etcd.
    pub async fn lookup(&self, id: &str) -> Result<Owner, FleetError> {
        if !valid_name(id) {
            return Ok(Owner::Unknown);
        }
        if let Some((advertise, seen)) = self.owners().get(id)
            && seen.elapsed() < OWNER_CACHE_TTL
        {
            return Ok(Owner::Remote { advertise: advertise.clone() });
        }
        // A malformed entry is nobody's: the request is answered here (not found).
        let view = self.entry_and_node(&self.protocol.sandbox_key(id)).await?;
        let owner = self.protocol.lookup(&view, &self.config.node, id).unwrap_or(Owner::Unknown);
        if let Owner::Remote { advertise } = &owner {
            let mut owners = self.owners();
            if owners.len() >= OWNER_CACHE_MAX {
                owners.retain(|_, (_, seen)| seen.elapsed() < OWNER_CACHE_TTL);
            }
            if owners.len() < OWNER_CACHE_MAX {
                owners.insert(id.to_owned(), (advertise.clone(), Instant::now()));
            }
        }
        Ok(owner)
    }

    /// Records in etcd that this node holds snapshot `id`, so that every node finds it.
    pub async fn hold_snapshot(&self, id: &str) -> Result<(), FleetError> {
        let (incarnation, lease) = self.registration()?;
        let txn = self.protocol.hold_snapshot(&self.config.node, incarnation, lease, id)?;
        if self.store().txn(&txn).await? { Ok(()) } else { Err(FleetError::NotRegistered) }
    }

    /// Deletes the entry of snapshot `id` this node held (deleted, or the node leaves); an entry that names
    /// another incarnation or node is left alone.
    pub async fn drop_snapshot(&self, id: &str) -> Result<(), FleetError> {
        let kv = self.store().get(&self.protocol.snapshot_key(id)).await?;
        let view = self.protocol.view(&kv.into_iter().collect::<Vec<_>>());
        let Some(entry) = view.snapshots.get(id).filter(|e| e.value.node == self.config.node) else { return Ok(()) };
        let txn = self.protocol.drop_snapshot(&self.config.node, entry.value.incarnation, id)?;
        self.store().txn(&txn).await?;
        Ok(())
    }

    /// Which node holds snapshot `id` (its entry and that node's record, read from etcd).
    pub async fn lookup_snapshot(&self, id: &str) -> Result<Owner, FleetError> {
        if !valid_name(id) {
            return Ok(Owner::Unknown);
        }
        let view = self.entry_and_node(&self.protocol.snapshot_key(id)).await?;
        Ok(self.protocol.lookup_snapshot(&view, &self.config.node, id).unwrap_or(Owner::Unknown))
    }

    /// The catalog entry at `key` (a sandbox's or a snapshot's) and the record of the node it names, as a view.
    async fn entry_and_node(&self, key: &str) -> Result<View, FleetError> {
        let mut kvs: Vec<strata_fleet::KeyValue> = self.store().get(key).await?.into_iter().collect();
        let view = self.protocol.view(&kvs);
        let node = view.catalog.values().chain(view.snapshots.values()).next().map(|e| e.value.node.clone());
        if let Some(node) = node {
            kvs.extend(self.store().get(&self.protocol.node_key(&node)).await?);
        }
        Ok(self.protocol.view(&kvs))
    }

    /// Forgets the owner of `id` (forwarding to it failed: look it up again).
    pub fn forget_owner(&self, id: &str) {
        self.owners().remove(id);
    }

    fn owners(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, (String, Instant)>> {
        self.owners.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Renews the lease once; on its loss, takes this node out (see [`spawn`]).
    async fn renew(&self) -> Result<bool, FleetError> {
        let (_, lease) = self.registration()?;
        let ttl = self.store().keep_alive(lease).await?;
        if ttl > 0 {
            *self.renewed.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Instant::now();
            return Ok(true);
        }
        Ok(false)
    }

    /// Releases the reservations on this node that were already reserved at the previous sweep (`seen`) and
    /// still are: their placer is gone (or its forward lost), since a placer forwards at once and this node
    /// confirms before it creates. Returns what is reserved now, for the next sweep.
    async fn sweep_reservations(&self, seen: &BTreeSet<String>) -> Result<BTreeSet<String>, FleetError> {
        let incarnation = self.incarnation.load(Ordering::SeqCst);
        let mut kvs = self.store().range(&self.protocol.alloc_key(&self.config.node)).await?;
        let view = self.protocol.view(&kvs);
        if let Some(alloc) = view.allocs.get(&self.config.node) {
            for entry in &alloc.value.entries {
                kvs.extend(self.store().get(&self.protocol.sandbox_key(&entry.id)).await?);
            }
        }
        let view = self.protocol.view(&kvs);
        let reserved: BTreeSet<String> =
            self.protocol.reservations(&view, &self.config.node, incarnation).into_iter().collect();
        for id in reserved.intersection(seen) {
            tracing::info!(sandbox = %id, "releasing a reservation nobody confirmed (its placer is gone)");
            self.release_reservation(&self.config.node, incarnation, std::slice::from_ref(id)).await?;
        }
        Ok(reserved.difference(seen).cloned().collect())
    }

    /// Appends the node's fleet figures to a Prometheus text exposition.
    pub fn render_metrics(&self, out: &mut String) {
        use std::fmt::Write;
        let c = &self.counters;
        let node = &self.config.node;
        let _ = writeln!(out, "# HELP strata_fleet_registered Whether this node is registered in its fleet now.");
        let _ = writeln!(out, "# TYPE strata_fleet_registered gauge");
        let _ = writeln!(out, "strata_fleet_registered{{node=\"{node}\"}} {}", u8::from(self.registered()));
        let _ = writeln!(out, "# HELP strata_fleet_draining Whether this node takes no new placements.");
        let _ = writeln!(out, "# TYPE strata_fleet_draining gauge");
        let _ = writeln!(out, "strata_fleet_draining{{node=\"{node}\"}} {}", u8::from(self.draining()));
        let counters = [
            ("strata_fleet_forwarded_total", "Requests for other nodes' sandboxes, forwarded to them.", &c.forwarded),
            ("strata_fleet_lost_total", "Requests answered sandbox_lost (the owner left the fleet).", &c.lost),
            ("strata_fleet_leases_lost_total", "Times this node lost its lease and registered again.", &c.leases_lost),
        ];
        for (name, help, value) in counters {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            let _ = writeln!(out, "{name}{{node=\"{node}\"}} {}", value.load(Ordering::Relaxed));
        }
        let name = "strata_fleet_placements_total";
        let _ =
            writeln!(out, "# HELP {name} Creates placed through this node, by where they went.\n# TYPE {name} counter");
        for (result, value) in [("here", &c.placed_here), ("elsewhere", &c.placed_elsewhere), ("refused", &c.refused)] {
            let _ = writeln!(out, "{name}{{node=\"{node}\",result=\"{result}\"}} {}", value.load(Ordering::Relaxed));
        }
    }

    /// Leaves the fleet (a shutdown, after every sandbox was closed): frees the catalog entries this node still
    /// holds, then revokes the lease, so its record goes at once.
    pub async fn leave(&self) {
        if let Ok(kvs) = self.store().range(&self.protocol.sandboxes_prefix()).await {
            let view = self.protocol.view(&kvs);
            for (id, entry) in &view.catalog {
                if entry.value.node == self.config.node {
                    let _ = self.release_sandbox(id).await;
                }
            }
        }
        // Its snapshots went with its state directory.
        if let Ok(kvs) = self.store().range(&self.protocol.snapshots_prefix()).await {
            let view = self.protocol.view(&kvs);
            for (id, entry) in &view.snapshots {
                if entry.value.node == self.config.node {
                    let _ = self.drop_snapshot(id).await;
                }
            }
        }
        let lease = self.lease.swap(0, Ordering::SeqCst);
        if lease != 0 {
            let _ = self.store().revoke(lease).await;
        }
    }
}

/// Frees sandbox `id` in etcd on the runtime, from anywhere (a blocking kill hook included); a failure is logged
/// (the next cleanup of this node removes what is left).
pub fn release_later(fleet: &Arc<Fleet>, id: &str) {
    let Ok(runtime) = tokio::runtime::Handle::try_current().or_else(|_| fleet.runtime.clone().ok_or(())) else {
        return;
    };
    let (fleet, id) = (fleet.clone(), id.to_owned());
    runtime.spawn(async move {
        if let Err(err) = fleet.release_sandbox(&id).await {
            tracing::warn!(sandbox = %id, error = %err, "cannot free the sandbox in the fleet");
        }
    });
}

/// A new incarnation: the time in microseconds, which only grows from one start of a node to the next.
fn new_incarnation() -> u64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    u64::try_from(now.as_micros()).unwrap_or(u64::MAX)
}

/// Keeps this node's lease alive while the server runs. When etcd says the lease expired (the node was out of
/// touch longer than its TTL while etcd was up), the node is out: it stops placing, kills every sandbox it holds
/// (the fleet reported them lost) and registers again as a new incarnation. While etcd cannot be reached at all
/// the node keeps serving what it holds (placements fail on their own).
pub fn spawn(state: &Arc<AppState>) {
    let Some(fleet) = state.fleet.clone() else { return };
    let weak: Weak<AppState> = Arc::downgrade(state);
    tokio::spawn(async move {
        let every = fleet.config.lease_ttl / 3;
        let mut reserved = BTreeSet::new();
        let mut swept = Instant::now();
        let mut pause = every;
        loop {
            tokio::time::sleep(pause).await;
            pause = every;
            let Some(state) = weak.upgrade() else { return };
            if state.draining() {
                return;
            }
            fleet.refresh_store().await;
            if fleet.registered() && swept.elapsed() >= fleet.config.reservation_sweep {
                swept = Instant::now();
                match fleet.sweep_reservations(&reserved).await {
                    Ok(now) => reserved = now,
                    Err(err) => tracing::warn!(error = %err, "cannot sweep this node's reservations"),
                }
            }
            let alive = match fleet.renew().await {
                Ok(alive) => alive,
                Err(FleetError::NotRegistered) => false,
                // etcd cannot be reached: the node keeps what it holds. Only etcd says a lease expired (and it
                // expires none while it has no quorum: a new leader extends them), so the node learns it on
                // reconnecting, if it did.
                Err(err) => {
                    let since = fleet.renewed.lock().unwrap_or_else(std::sync::PoisonError::into_inner).elapsed();
                    tracing::warn!(error = %err, since_ms = since.as_millis() as u64, "cannot renew the fleet lease");
                    // Sooner than the period: when etcd comes back, the lease is renewed before it can expire.
                    pause = RENEW_RETRY.min(every);
                    true
                }
            };
            if alive {
                continue;
            }
            if fleet.registered() {
                fleet.counters.leases_lost.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(node = %fleet.node(), "the fleet lease is lost: killing this node's sandboxes and registering again");
                fleet.lease.store(0, Ordering::SeqCst);
                let lost = state.registry.take_all();
                let _ = tokio::task::spawn_blocking(move || {
                    for entry in lost {
                        entry.kill();
                    }
                })
                .await;
            }
            if let Err(err) = fleet.register(&[]).await {
                tracing::warn!(error = %err, "cannot register in the fleet again yet");
            }
        }
    });
}

/// etcd's TLS options for this node: its certificate as client identity, the etcd CA (else the fleet CA) to verify
/// the members; `None` without TLS.
fn etcd_tls(config: &FleetConfig, tls: Option<&Tls>) -> Result<Option<etcd_client::TlsOptions>, FleetError> {
    let Some(tls) = tls else { return Ok(None) };
    let pem = tls.pem();
    let ca = match &config.etcd_ca {
        Some(path) => std::fs::read(path).map_err(|e| FleetError::Config(format!("{}: {e}", path.display())))?,
        None => pem.ca.clone().ok_or_else(|| FleetError::Config("no fleet CA".into()))?,
    };
    Ok(Some(
        etcd_client::TlsOptions::new()
            .ca_certificate(etcd_client::Certificate::from_pem(ca))
            .identity(etcd_client::Identity::from_pem(pem.cert, pem.key)),
    ))
}

#[cfg(test)]
mod tests {
    use super::FleetConfig;

    #[test]
    fn a_fleet_without_tls_stays_on_loopback_and_names_no_https_url() {
        let config = |etcd: &str, advertise: &str| FleetConfig::new(vec![etcd.into()], "n1", advertise);
        config("http://127.0.0.1:2379", "http://localhost:3000").validate(None).expect("loopback");
        for (etcd, advertise) in [
            ("http://10.0.0.2:2379", "http://127.0.0.1:3000"),
            ("http://127.0.0.1:2379", "http://192.168.1.4:3000"),
            ("https://127.0.0.1:2379", "http://127.0.0.1:3000"),
        ] {
            let err = config(etcd, advertise).validate(None).expect_err("refused").to_string();
            assert!(err.contains("TLS"), "{etcd} {advertise}: {err}");
        }
    }
}
