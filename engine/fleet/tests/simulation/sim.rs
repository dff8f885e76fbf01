//! One schedule: a small fleet on the etcd model, driven by a seeded sequence of events, checked after every step.
//!
//! **Actors.** 3 to 5 nodes of random capacity, each a process with tasks: its life (grant a lease, register,
//! clean up), placers (one per create request it receives: read, plan, reserve, forward, release), confirmations
//! (a forwarded create: confirm, then start), releases of ended sandboxes, a reservation sweep and lookups. etcd
//! is [`Etcd`]; a node reaches it over a link with random delay and loss, and other nodes over a network with
//! random delay, loss and duplication (losses stop with the main phase). A request to etcd times out after twice
//! the link's longest delay: it was applied (its answer lost), or never will be, or, now and then, it is applied
//! later still, after the node read back and decided without it.
//!
//! **Events.** Create requests (single sandboxes and forks) at random nodes, sandboxes ending, lookups, node
//! crashes (all its sandboxes and tasks die; it restarts later as a new incarnation), partitions (the node's
//! link to etcd, and sometimes to the other nodes, drops everything for a while; when it outlasts the lease TTL
//! the lease expires, and the node, told so by its next keepalive, kills its sandboxes and registers anew), and
//! lease expiry by time. Then a quiet phase: partitions heal, crashed nodes restart, every sandbox ends.
//!
//! **Checks.** After every step: (a) the sandboxes each node runs fit its CPUs by [`Bins`] and its memory;
//! (b) no sandbox runs on two nodes, nor starts twice, and a running sandbox's catalog entry names its node and
//! incarnation, active; and the node's alloc, of that incarnation, lists it. When a client is told a create
//! succeeded, no other node ran its sandboxes; a lookup never names another node than the one the client was
//! told. (c) At the end, each success was started on the node the client was told, or that node's incarnation
//! died. And at the end, after the quiet phase: every node is registered and clean, no task is stuck, and the
//! catalog and the allocs are empty (nothing leaked).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::rc::Rc;

use strata_fleet::model::{Etcd, ModelError};
use strata_fleet::{
    Alloc, AllocEntry, Bins, CatalogEntry, Compare, KeyValue, MAX_REQUEST, NodeRecord, Op, Owner, Plan, Protocol,
    Release, SandboxRequest, SandboxState, Txn,
};

use crate::rng::Rng;

const UNIT: u64 = 256 << 20;
const KEEPALIVE_MS: u64 = 150;
const TTL_MS: u64 = 450;
/// Requests, crashes and partitions happen before this.
const MAIN_MS: u64 = 1000;
/// From then on, every sandbox running ends, every [`END_ALL_EVERY_MS`]; the schedule ends as soon as all is clean.
const END_ALL_MS: u64 = MAIN_MS + 600;
const END_ALL_EVERY_MS: u64 = 200;
/// The final checks, if all was not clean before.
const FINAL_MS: u64 = MAIN_MS + 3000;
const MAX_ATTEMPTS: u32 = 6;
const RETRY_MS: u64 = 20;
const SWEEP_MS: u64 = 200;
/// A reservation seen this long unconfirmed is released by its node: longer than a placer waits for a forward.
const STALE_MS: u64 = 300;

/// What to run.
#[derive(Debug, Clone, Copy, Default)]
pub struct Config {
    /// A broken placer: its reservation does not compare the alloc's mod revision.
    pub skip_fencing: bool,
    /// A broken node: it confirms a reservation of whatever incarnation the forward names, not only its own.
    pub confirm_any_incarnation: bool,
    /// A broken placer: after a forward, it places the request again under the same ids.
    pub reuse_forwarded_ids: bool,
    /// Check only the properties (a), (b) and (c), not that each running sandbox is in its node's alloc.
    pub properties_only: bool,
    /// Keep a trace of every step.
    pub trace: bool,
}

/// Counts over schedules.
#[derive(Debug, Clone, Copy, Default)]
pub struct Stats {
    /// Schedules run.
    pub schedules: u64,
    /// Steps (events handled).
    pub steps: u64,
    /// Create requests.
    pub requests: u64,
    /// Requests answered with success.
    pub successes: u64,
    /// Requests answered with failure.
    pub failures: u64,
    /// ... of which after the release found the node had confirmed.
    pub taken: u64,
    /// Failures because no node had room.
    pub no_room: u64,
    /// Sandboxes started.
    pub started: u64,
    /// Node crashes.
    pub crashes: u64,
    /// Partitions.
    pub partitions: u64,
    /// Leases a node learned it lost.
    pub leases_lost: u64,
    /// Reservations released by their node's sweep.
    pub swept: u64,
    /// Lookups answered.
    pub lookups: u64,
}

impl Stats {
    /// Adds another's counts.
    pub fn add(&mut self, o: &Stats) {
        self.schedules += o.schedules;
        self.steps += o.steps;
        self.requests += o.requests;
        self.successes += o.successes;
        self.failures += o.failures;
        self.taken += o.taken;
        self.no_room += o.no_room;
        self.started += o.started;
        self.crashes += o.crashes;
        self.partitions += o.partitions;
        self.leases_lost += o.leases_lost;
        self.swept += o.swept;
        self.lookups += o.lookups;
    }
}

/// A failed check.
#[derive(Debug)]
pub struct Failure {
    /// When, in simulated milliseconds.
    pub at_ms: u64,
    /// What was wrong.
    pub message: String,
    /// Every step until then, when traced.
    pub trace: Vec<String>,
}

/// The random conditions of one schedule.
#[derive(Debug)]
struct Params {
    etcd_delay: u64,
    etcd_loss: u64,
    /// Per mille of requests to etcd applied only after their deadline: the node timed out on them, read back,
    /// and may have decided (and sent more) before they apply.
    etcd_late: u64,
    etcd_timeout: u64,
    net_delay: u64,
    net_loss: u64,
    net_dup: u64,
    forward_timeout: u64,
}

#[derive(Debug, Clone)]
enum EtcdReq {
    Txn(Txn),
    Read { prefixes: Vec<String>, keys: Vec<String> },
    Grant,
    Keepalive(i64),
}

#[derive(Debug, Clone)]
enum EtcdResp {
    Txn(bool),
    /// A transaction put a key with a lease that is gone: etcd's error, not a failed compare.
    LeaseGone,
    Read(Vec<KeyValue>),
    Grant(i64),
    Keepalive {
        lease: i64,
        alive: bool,
    },
}

#[derive(Debug, Clone)]
struct Forward {
    to: usize,
    from: usize,
    process: u64,
    task: u64,
    token: u64,
    incarnation: u64,
    entries: Vec<AllocEntry>,
}

#[derive(Debug)]
enum Event {
    Start {
        node: usize,
    },
    Crash {
        node: usize,
    },
    Cut {
        node: usize,
        until: u64,
        full: bool,
    },
    Client {
        node: usize,
        client: u64,
        request: Vec<SandboxRequest>,
    },
    End {
        node: usize,
        pick: u64,
    },
    EndAll,
    Lookup {
        node: usize,
        pick: u64,
    },
    Keepalive {
        node: usize,
        process: u64,
    },
    Sweep {
        node: usize,
        process: u64,
    },
    /// A request to etcd; when it or its answer is lost, the node times out at `deadline`.
    ToEtcd {
        node: usize,
        process: u64,
        req: u64,
        deadline: u64,
        body: EtcdReq,
    },
    FromEtcd {
        node: usize,
        process: u64,
        req: u64,
        deadline: u64,
        body: EtcdResp,
    },
    EtcdTimeout {
        node: usize,
        process: u64,
        req: u64,
    },
    Forward(Forward),
    Reply {
        to: usize,
        process: u64,
        task: u64,
        token: u64,
        created: bool,
    },
    ForwardTimeout {
        node: usize,
        process: u64,
        task: u64,
        token: u64,
    },
    Wake {
        node: usize,
        process: u64,
        task: u64,
    },
}

struct Scheduled {
    at: u64,
    seq: u64,
    event: Event,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Scheduled) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Scheduled) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Scheduled {
    fn cmp(&self, other: &Scheduled) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

/// What a task is woken with.
#[derive(Debug)]
enum Input {
    /// etcd's answer; `None`: the request timed out.
    Etcd(Option<EtcdResp>),
    /// The forwarded node's answer.
    Reply { token: u64, created: bool },
    /// The forwarded node did not answer in time.
    ForwardTimeout { token: u64 },
    /// A retry delay passed.
    Wake,
}

#[derive(Debug)]
enum LifeState {
    Granting,
    Registering(i64),
    CheckingRegistration(i64),
    Cleaning,
    CleaningTxn,
}

#[derive(Debug)]
enum PlacerState {
    Reading,
    Placing(Plan),
    Checking(Plan),
    Forwarding(Plan, u64),
    Releasing(Plan),
    ReleasingTxn(Plan),
}

#[derive(Debug)]
struct Placer {
    client: u64,
    request: Vec<SandboxRequest>,
    exclude: BTreeSet<String>,
    attempts: u32,
    /// The request's ids were forwarded to a node: they may have been created there (and ended), so they are not
    /// placed again.
    burnt: bool,
    state: PlacerState,
}

#[derive(Debug)]
enum ConfirmState {
    Confirming,
    Checking,
}

#[derive(Debug)]
struct Confirm {
    forward: Forward,
    ids: Vec<String>,
    /// The incarnation it confirms for: the node's.
    incarnation: u64,
    state: ConfirmState,
}

#[derive(Debug)]
enum EndState {
    Reading,
    Releasing,
}

#[derive(Debug)]
struct End {
    id: String,
    incarnation: u64,
    state: EndState,
}

#[derive(Debug)]
enum Task {
    Life(LifeState),
    Placer(Placer),
    Confirm(Confirm),
    End(End),
    /// Waiting for the read of its reservations, then for the release.
    Sweep {
        releasing: bool,
    },
    Lookup {
        id: String,
    },
}

#[derive(Debug)]
struct Node {
    name: String,
    cpus: u32,
    slots: u32,
    memory: u64,
    up: bool,
    /// The process: a crash makes a new one, and messages to the old one are dropped.
    process: u64,
    incarnation: u64,
    lease: Option<i64>,
    registered: bool,
    ready: bool,
    running: BTreeMap<String, AllocEntry>,
    /// Every sandbox this incarnation started, running or ended: a node creates an id at most once.
    taken: BTreeSet<String>,
    tasks: BTreeMap<u64, Task>,
    next_task: u64,
    /// etcd requests in flight, by request id: the task waiting.
    pending: BTreeMap<u64, u64>,
    /// Sandboxes with a confirmation in flight.
    confirming: BTreeSet<String>,
    /// Reservations on this node seen unconfirmed, since when.
    reserved_since: BTreeMap<String, u64>,
    sweeping: bool,
    /// The link to etcd drops everything until then.
    cut_until: u64,
    /// The links to other nodes drop everything until then.
    isolated_until: u64,
}

impl Node {
    fn record(&self) -> NodeRecord {
        NodeRecord {
            name: self.name.clone(),
            advertise: format!("http://{}:8080", self.name),
            incarnation: self.incarnation,
            cpus: self.cpus,
            slots: self.slots,
            memory: self.memory,
            draining: false,
        }
    }
}

/// The checker's memory.
#[derive(Debug, Default)]
struct Checker {
    /// Sandbox → the node and incarnation it started on.
    started: BTreeMap<String, (usize, u64)>,
    /// Successes told to clients: ids, node, incarnation.
    successes: Vec<(Vec<String>, usize, u64)>,
    /// Incarnations that died: crashed, or whose node learned its lease was lost.
    dead: BTreeSet<(usize, u64)>,
    answered: BTreeSet<u64>,
    checked_revision: i64,
    dirty: bool,
}

struct World {
    cfg: Config,
    params: Params,
    rng: Rng,
    now: u64,
    seq: u64,
    queue: BinaryHeap<Reverse<Scheduled>>,
    etcd: Etcd,
    p: Rc<Protocol>,
    nodes: Vec<Node>,
    next_incarnation: u64,
    next_req: u64,
    next_token: u64,
    check: Checker,
    stats: Stats,
    trace: Vec<String>,
}

type Step<T> = Result<Option<T>, String>;

/// Runs the schedule of `seed`.
pub fn run(seed: u64, cfg: Config) -> Result<Stats, Failure> {
    let mut w = World::new(seed, cfg);
    let result = w.run();
    result.map(|()| w.stats).map_err(|message| Failure { at_ms: w.now, message, trace: std::mem::take(&mut w.trace) })
}

fn short(key: &str) -> &str {
    key.strip_prefix(strata_fleet::DEFAULT_PREFIX).unwrap_or(key)
}

fn show_txn(txn: &Txn) -> String {
    let compares: Vec<String> = txn
        .compares
        .iter()
        .map(|c| match c {
            Compare::Exists { key } => format!("exists {}", short(key)),
            Compare::Missing { key } => format!("missing {}", short(key)),
            Compare::ModRevision { key, rev } => format!("rev {}={rev}", short(key)),
            Compare::Lease { key, lease } => format!("lease {}={lease}", short(key)),
            Compare::Value { key, value } => format!("{}=={}", short(key), String::from_utf8_lossy(value)),
        })
        .collect();
    let ops: Vec<String> = txn
        .success
        .iter()
        .map(|o| match o {
            Op::Put { key, value, .. } => format!("put {}={}", short(key), String::from_utf8_lossy(value)),
            Op::Delete { key } => format!("delete {}", short(key)),
        })
        .collect();
    format!("if [{}] then [{}]", compares.join(", "), ops.join(", "))
}

fn show_resp(resp: &EtcdResp) -> String {
    match resp {
        EtcdResp::Read(kvs) => {
            let each: Vec<String> = kvs
                .iter()
                .map(|kv| format!("{}@{}={}", short(&kv.key), kv.mod_revision, String::from_utf8_lossy(&kv.value)))
                .collect();
            format!("read [{}]", each.join(", "))
        }
        other => format!("{other:?}"),
    }
}

impl World {
    fn new(seed: u64, cfg: Config) -> World {
        let mut rng = Rng::new(seed);
        let etcd_delay = rng.range(1, 10);
        let params = Params {
            etcd_delay,
            etcd_loss: rng.pick(&[0, 0, 5, 20, 50]),
            etcd_late: rng.pick(&[0, 0, 5, 20]),
            etcd_timeout: 2 * etcd_delay + 1,
            net_delay: rng.range(1, 30),
            net_loss: rng.pick(&[0, 10, 50, 100]),
            net_dup: rng.pick(&[0, 20, 100]),
            forward_timeout: rng.range(10, 120),
        };
        let count = rng.range(3, 5) as usize;
        let nodes = (0..count)
            .map(|i| Node {
                name: format!("n{i}"),
                cpus: rng.range(1, 4) as u32,
                slots: if rng.chance(150) { 0 } else { rng.range(1, 3) as u32 },
                memory: rng.range(2, 8) * UNIT,
                up: false,
                process: 0,
                incarnation: 0,
                lease: None,
                registered: false,
                ready: false,
                running: BTreeMap::new(),
                taken: BTreeSet::new(),
                tasks: BTreeMap::new(),
                next_task: 0,
                pending: BTreeMap::new(),
                confirming: BTreeSet::new(),
                reserved_since: BTreeMap::new(),
                sweeping: false,
                cut_until: 0,
                isolated_until: 0,
            })
            .collect();
        let mut w = World {
            cfg,
            params,
            rng,
            now: 0,
            seq: 0,
            queue: BinaryHeap::new(),
            etcd: Etcd::new(),
            p: Rc::new(Protocol::default()),
            nodes,
            next_incarnation: 1,
            next_req: 0,
            next_token: 0,
            check: Checker::default(),
            stats: Stats { schedules: 1, ..Stats::default() },
            trace: Vec::new(),
        };
        w.scenario();
        w
    }

    /// Schedules the random events of the main phase, and the quiet phase.
    fn scenario(&mut self) {
        let n = self.nodes.len() as u64;
        for node in 0..self.nodes.len() {
            let at = self.rng.below(20);
            self.at(at, Event::Start { node });
        }
        for client in 0..self.rng.range(4, 20) {
            let at = self.rng.below(MAIN_MS);
            let node = self.rng.below(n) as usize;
            let count = if self.rng.chance(300) { self.rng.range(2, 4) } else { 1 };
            let vcpus = self.rng.range(1, 3) as u32;
            let memory = self.rng.range(1, 3) * UNIT;
            let request = (0..count).map(|k| SandboxRequest { id: format!("r{client}-{k}"), vcpus, memory }).collect();
            self.at(at, Event::Client { node, client, request });
        }
        for _ in 0..self.rng.range(0, 15) {
            let (at, node, pick) = (self.rng.below(MAIN_MS), self.rng.below(n) as usize, self.rng.next_u64());
            self.at(at, Event::End { node, pick });
        }
        for _ in 0..self.rng.range(0, 8) {
            let (at, node, pick) = (self.rng.below(MAIN_MS + 400), self.rng.below(n) as usize, self.rng.next_u64());
            self.at(at, Event::Lookup { node, pick });
        }
        for _ in 0..self.rng.pick(&[0, 0, 1, 2]) {
            let (at, node) = (self.rng.range(20, MAIN_MS), self.rng.below(n) as usize);
            self.at(at, Event::Crash { node });
        }
        for _ in 0..self.rng.pick(&[0, 0, 1, 2]) {
            let (at, node) = (self.rng.range(20, MAIN_MS), self.rng.below(n) as usize);
            let until = (at + self.rng.range(50, 1500)).min(MAIN_MS);
            let full = self.rng.chance(500);
            self.at(at, Event::Cut { node, until, full });
        }
        for at in (END_ALL_MS..FINAL_MS).step_by(END_ALL_EVERY_MS as usize) {
            self.at(at, Event::EndAll);
        }
    }

    fn at(&mut self, at: u64, event: Event) {
        self.seq += 1;
        self.queue.push(Reverse(Scheduled { at, seq: self.seq, event }));
    }

    fn after(&mut self, delay: u64, event: Event) {
        self.at(self.now + delay, event);
    }

    fn log(&mut self, line: impl FnOnce() -> String) {
        if self.cfg.trace {
            let line = format!("{:>5} {}", self.now, line());
            self.trace.push(line);
        }
    }

    fn run(&mut self) -> Result<(), String> {
        if self.cfg.trace {
            let params = format!("{:?}", self.params);
            let nodes: Vec<String> = self
                .nodes
                .iter()
                .map(|n| format!("{}: {} CPUs × {} slots, {} units", n.name, n.cpus, n.slots, n.memory / UNIT))
                .collect();
            self.log(|| format!("{params}; {}", nodes.join("; ")));
        }
        while let Some(Reverse(next)) = self.queue.pop() {
            if next.at > FINAL_MS || (self.now >= END_ALL_MS && self.settled()) {
                break;
            }
            self.now = next.at;
            let expired = self.etcd.advance_to(self.now);
            if !expired.is_empty() {
                self.log(|| format!("etcd: leases {expired:?} expired"));
            }
            self.stats.steps += 1;
            self.handle(next.event)?;
            self.check_step()?;
        }
        self.check_end()
    }

    // ---- links ----

    /// Whether a message is lost: with this probability (per mille) in the main phase, never in the quiet one.
    fn lost(&mut self, per_mille: u64) -> bool {
        self.now < MAIN_MS && self.rng.chance(per_mille)
    }

    fn etcd_reachable(&self, node: usize) -> bool {
        self.now >= self.nodes[node].cut_until
    }

    fn net_reachable(&self, node: usize) -> bool {
        self.now >= self.nodes[node].isolated_until
    }

    /// Sends a request to etcd for task `task` of node `n`; its answer or its timeout wakes the task. (The timeout
    /// is only scheduled when the request or its answer is lost: an answer always comes before it.)
    fn call(&mut self, n: usize, task: u64, body: EtcdReq) {
        self.next_req += 1;
        let req = self.next_req;
        self.nodes[n].pending.insert(req, task);
        let deadline = self.now + self.params.etcd_timeout;
        self.send_etcd(n, req, deadline, body);
    }

    /// A request or its answer is lost: the node times out at `deadline` (0: nobody waits, as for keepalives).
    fn lose(&mut self, node: usize, process: u64, req: u64, deadline: u64) {
        if deadline > 0 {
            self.at(deadline, Event::EtcdTimeout { node, process, req });
        }
    }

    fn send_etcd(&mut self, n: usize, req: u64, deadline: u64, body: EtcdReq) {
        let process = self.nodes[n].process;
        if !self.etcd_reachable(n) || self.lost(self.params.etcd_loss) {
            self.lose(n, process, req, deadline);
            return;
        }
        let timeout = self.params.etcd_timeout;
        let delay = if self.lost(self.params.etcd_late) {
            // Held up (in a queue, a retransmission): applied long after the node gave up waiting.
            self.lose(n, process, req, deadline);
            timeout + self.rng.range(1, 3 * timeout)
        } else {
            self.rng.range(1, self.params.etcd_delay)
        };
        self.after(delay, Event::ToEtcd { node: n, process, req, deadline, body });
    }

    fn send_node(&mut self, from: usize, to: usize, event: impl Fn() -> Event) {
        if !self.net_reachable(from) || !self.net_reachable(to) || self.lost(self.params.net_loss) {
            return;
        }
        let copies = if self.rng.chance(self.params.net_dup) { 2 } else { 1 };
        for _ in 0..copies {
            let delay = self.rng.range(1, self.params.net_delay);
            self.after(delay, event());
        }
    }

    fn wake_later(&mut self, n: usize, task: u64) {
        let process = self.nodes[n].process;
        self.after(RETRY_MS, Event::Wake { node: n, process, task });
    }

    fn spawn(&mut self, n: usize, task: Task) -> u64 {
        let node = &mut self.nodes[n];
        node.next_task += 1;
        node.tasks.insert(node.next_task, task);
        node.next_task
    }

    // ---- events ----

    fn handle(&mut self, event: Event) -> Result<(), String> {
        match event {
            Event::Start { node } => self.start(node),
            Event::Crash { node } => self.crash(node),
            Event::Cut { node, until, full } => {
                self.stats.partitions += 1;
                let n = &mut self.nodes[node];
                n.cut_until = n.cut_until.max(until);
                if full {
                    n.isolated_until = n.isolated_until.max(until);
                }
                let name = n.name.clone();
                self.log(|| format!("{name}: cut from etcd{} until {until}", if full { " and the nodes" } else { "" }));
                Ok(())
            }
            Event::Client { node, client, request } => {
                self.stats.requests += 1;
                if !self.nodes[node].up {
                    self.log(|| format!("client {client}: n{node} is down"));
                    return Ok(());
                }
                let ids: Vec<&str> = request.iter().map(|s| s.id.as_str()).collect();
                let line = format!("client {client} → n{node}: {ids:?} × {} vCPUs", request[0].vcpus);
                self.log(|| line);
                let keys = self.sandbox_keys(&request);
                let placer = Placer {
                    client,
                    request,
                    exclude: BTreeSet::new(),
                    attempts: 0,
                    burnt: false,
                    state: PlacerState::Reading,
                };
                let task = self.spawn(node, Task::Placer(placer));
                self.placer_read(node, task, keys);
                Ok(())
            }
            Event::End { node, pick } => {
                let n = &self.nodes[node];
                if !n.up || n.running.is_empty() {
                    return Ok(());
                }
                let id = n.running.keys().nth((pick % n.running.len() as u64) as usize).cloned().unwrap_or_default();
                self.end(node, &id);
                Ok(())
            }
            Event::EndAll => {
                for node in 0..self.nodes.len() {
                    let ids: Vec<String> = self.nodes[node].running.keys().cloned().collect();
                    for id in ids {
                        self.end(node, &id);
                    }
                }
                Ok(())
            }
            Event::Lookup { node, pick } => {
                if !self.nodes[node].up || self.check.successes.is_empty() {
                    return Ok(());
                }
                let (ids, _, _) = &self.check.successes[(pick % self.check.successes.len() as u64) as usize];
                let id = ids[0].clone();
                let body = EtcdReq::Read { prefixes: vec![self.p.nodes_prefix()], keys: vec![self.p.sandbox_key(&id)] };
                let task = self.spawn(node, Task::Lookup { id });
                self.call(node, task, body);
                Ok(())
            }
            Event::Keepalive { node, process } => {
                if self.nodes[node].process != process || !self.nodes[node].up {
                    return Ok(());
                }
                if let Some(lease) = self.nodes[node].lease {
                    self.next_req += 1;
                    let req = self.next_req;
                    self.send_etcd(node, req, 0, EtcdReq::Keepalive(lease));
                }
                self.after(KEEPALIVE_MS, Event::Keepalive { node, process });
                Ok(())
            }
            Event::Sweep { node, process } => {
                if self.nodes[node].process != process || !self.nodes[node].up {
                    return Ok(());
                }
                self.after(SWEEP_MS, Event::Sweep { node, process });
                if self.nodes[node].ready && !self.nodes[node].sweeping {
                    self.nodes[node].sweeping = true;
                    let body = EtcdReq::Read {
                        prefixes: vec![self.p.sandboxes_prefix()],
                        keys: vec![self.p.alloc_key(&self.nodes[node].name)],
                    };
                    let task = self.spawn(node, Task::Sweep { releasing: false });
                    self.call(node, task, body);
                }
                Ok(())
            }
            Event::ToEtcd { node, process, req, deadline, body } => {
                if !self.etcd_reachable(node) {
                    self.lose(node, process, req, deadline);
                    return Ok(());
                }
                let resp = self.at_etcd(node, &body)?;
                if matches!(resp, EtcdResp::Keepalive { alive: true, .. }) {
                    // Nothing to tell the node.
                } else if self.etcd_reachable(node) && !self.lost(self.params.etcd_loss) {
                    let delay = self.rng.range(1, self.params.etcd_delay);
                    self.after(delay, Event::FromEtcd { node, process, req, deadline, body: resp });
                } else {
                    self.lose(node, process, req, deadline);
                }
                Ok(())
            }
            Event::FromEtcd { node, process, req, deadline, body } => {
                let n = &mut self.nodes[node];
                if n.process != process || !n.up {
                    return Ok(());
                }
                if self.now < n.cut_until {
                    self.lose(node, process, req, deadline);
                    return Ok(());
                }
                if let EtcdResp::Keepalive { lease, alive } = body {
                    if !alive && n.lease == Some(lease) {
                        return self.lease_lost(node);
                    }
                    return Ok(());
                }
                match n.pending.remove(&req) {
                    Some(task) => self.step(node, task, Input::Etcd(Some(body))),
                    None => Ok(()),
                }
            }
            Event::EtcdTimeout { node, process, req } => {
                let n = &mut self.nodes[node];
                if n.process != process {
                    return Ok(());
                }
                match n.pending.remove(&req) {
                    Some(task) => self.step(node, task, Input::Etcd(None)),
                    None => Ok(()),
                }
            }
            Event::Forward(forward) => {
                if !self.nodes[forward.to].up || !self.net_reachable(forward.to) {
                    return Ok(());
                }
                self.forwarded(forward)
            }
            Event::Reply { to, process, task, token, created } => {
                if self.nodes[to].process != process || !self.nodes[to].up || !self.net_reachable(to) {
                    return Ok(());
                }
                self.step(to, task, Input::Reply { token, created })
            }
            Event::ForwardTimeout { node, process, task, token } => {
                if self.nodes[node].process != process {
                    return Ok(());
                }
                self.step(node, task, Input::ForwardTimeout { token })
            }
            Event::Wake { node, process, task } => {
                if self.nodes[node].process != process {
                    return Ok(());
                }
                self.step(node, task, Input::Wake)
            }
        }
    }

    fn at_etcd(&mut self, node: usize, body: &EtcdReq) -> Result<EtcdResp, String> {
        let name = self.nodes[node].name.clone();
        let resp = match body {
            EtcdReq::Txn(txn) => match self.etcd.txn(txn) {
                Ok(ok) => EtcdResp::Txn(ok),
                Err(ModelError::LeaseNotFound(_)) => EtcdResp::LeaseGone,
                Err(e) => return Err(format!("etcd refused {}: {e}", show_txn(txn))),
            },
            EtcdReq::Read { prefixes, keys } => {
                let mut kvs: Vec<KeyValue> = prefixes.iter().flat_map(|p| self.etcd.range(p)).collect();
                kvs.extend(keys.iter().filter_map(|k| self.etcd.get(k)));
                EtcdResp::Read(kvs)
            }
            EtcdReq::Grant => EtcdResp::Grant(self.etcd.grant(TTL_MS)),
            EtcdReq::Keepalive(lease) => {
                EtcdResp::Keepalive { lease: *lease, alive: self.etcd.keepalive(*lease).is_ok() }
            }
        };
        if self.cfg.trace && !matches!(body, EtcdReq::Keepalive(_))
            || matches!(resp, EtcdResp::Keepalive { alive: false, .. })
        {
            let req = match body {
                EtcdReq::Txn(txn) => show_txn(txn),
                other => format!("{other:?}").replace(strata_fleet::DEFAULT_PREFIX, ""),
            };
            let revision = self.etcd.revision();
            self.log(|| format!("etcd ← {name}: {req} ⇒ {} (rev {revision})", show_resp(&resp)));
        }
        Ok(resp)
    }

    /// Hands an input to a task, which may finish.
    fn step(&mut self, n: usize, id: u64, input: Input) -> Result<(), String> {
        let Some(task) = self.nodes[n].tasks.remove(&id) else { return Ok(()) };
        let next = match task {
            Task::Life(state) => self.life(n, id, state, input)?.map(Task::Life),
            Task::Placer(placer) => self.placer(n, id, placer, input)?.map(Task::Placer),
            Task::Confirm(confirm) => self.confirm(n, id, confirm, input)?.map(Task::Confirm),
            Task::End(end) => self.release_ended(n, id, end, input)?.map(Task::End),
            Task::Sweep { releasing } => self.sweep(n, id, releasing, input)?,
            Task::Lookup { id: sandbox } => {
                self.lookup(n, &sandbox, input)?;
                None
            }
        };
        if let Some(task) = next {
            self.nodes[n].tasks.insert(id, task);
        }
        Ok(())
    }

    // ---- a node's life ----

    fn start(&mut self, n: usize) -> Result<(), String> {
        let node = &mut self.nodes[n];
        node.up = true;
        let process = node.process;
        self.after(KEEPALIVE_MS, Event::Keepalive { node: n, process });
        self.after(SWEEP_MS, Event::Sweep { node: n, process });
        self.begin_incarnation(n);
        Ok(())
    }

    /// A new incarnation: a new lease, registration, cleanup.
    fn begin_incarnation(&mut self, n: usize) {
        let incarnation = self.next_incarnation;
        self.next_incarnation += 1;
        let node = &mut self.nodes[n];
        node.incarnation = incarnation;
        node.lease = None;
        node.registered = false;
        node.ready = false;
        let name = node.name.clone();
        self.log(|| format!("{name}: starts incarnation {incarnation}"));
        let task = self.spawn(n, Task::Life(LifeState::Granting));
        self.call(n, task, EtcdReq::Grant);
    }

    /// Kills everything the node runs, as its incarnation dies.
    fn kill_all(&mut self, n: usize) {
        let node = &mut self.nodes[n];
        self.check.dead.insert((n, node.incarnation));
        if !node.running.is_empty() {
            self.check.dirty = true;
        }
        node.running.clear();
        node.taken.clear();
        node.confirming.clear();
        node.reserved_since.clear();
        node.sweeping = false;
    }

    fn crash(&mut self, n: usize) -> Result<(), String> {
        if !self.nodes[n].up {
            return Ok(());
        }
        self.stats.crashes += 1;
        self.kill_all(n);
        let node = &mut self.nodes[n];
        node.up = false;
        node.process += 1;
        node.tasks.clear();
        node.pending.clear();
        node.lease = None;
        node.registered = false;
        node.ready = false;
        let name = node.name.clone();
        let delay = self.rng.range(20, 600);
        self.log(|| format!("{name}: crashes, restarts in {delay} ms"));
        self.after(delay, Event::Start { node: n });
        Ok(())
    }

    /// The node's keepalive was answered "no such lease": its record is gone, and its sandboxes may have been
    /// reported lost. It kills them all, and registers anew. Its placers go on.
    fn lease_lost(&mut self, n: usize) -> Result<(), String> {
        self.stats.leases_lost += 1;
        let name = self.nodes[n].name.clone();
        let running = self.nodes[n].running.len();
        self.log(|| format!("{name}: its lease is gone; kills its {running} sandboxes"));
        self.kill_all(n);
        self.nodes[n].tasks.retain(|_, t| matches!(t, Task::Placer(_)));
        self.begin_incarnation(n);
        Ok(())
    }

    fn cleanup_read(&self, n: usize) -> EtcdReq {
        let name = &self.nodes[n].name;
        EtcdReq::Read {
            prefixes: vec![self.p.sandboxes_prefix()],
            keys: vec![self.p.node_key(name), self.p.alloc_key(name)],
        }
    }

    fn life(&mut self, n: usize, id: u64, state: LifeState, input: Input) -> Step<LifeState> {
        let p = Rc::clone(&self.p);
        let record = self.nodes[n].record();
        let register = |lease| p.register(&record, lease).map_err(|e| e.to_string());
        Ok(Some(match (state, input) {
            (LifeState::Granting, Input::Etcd(Some(EtcdResp::Grant(lease)))) => {
                self.nodes[n].lease = Some(lease);
                self.call(n, id, EtcdReq::Txn(register(lease)?));
                LifeState::Registering(lease)
            }
            (LifeState::Granting, Input::Etcd(None)) => {
                self.wake_later(n, id);
                LifeState::Granting
            }
            (LifeState::Granting, Input::Wake) => {
                self.call(n, id, EtcdReq::Grant);
                LifeState::Granting
            }
            (_, Input::Etcd(Some(EtcdResp::LeaseGone))) => {
                // The lease granted expired before the node could register with it (it was cut from etcd).
                self.lease_lost(n)?;
                return Ok(None);
            }
            (LifeState::Registering(lease), Input::Etcd(Some(EtcdResp::Txn(true)))) => {
                self.registered(n, id);
                let _ = lease;
                LifeState::Cleaning
            }
            (LifeState::Registering(lease), Input::Etcd(_)) => {
                // Refused (the previous incarnation's record still stands), or unknown: read.
                let key = p.node_key(&record.name);
                self.call(n, id, EtcdReq::Read { prefixes: vec![], keys: vec![key] });
                LifeState::CheckingRegistration(lease)
            }
            (LifeState::CheckingRegistration(lease), Input::Etcd(Some(EtcdResp::Read(kvs)))) => {
                if p.is_registered(&p.view(&kvs), &record.name, lease) {
                    self.registered(n, id);
                    LifeState::Cleaning
                } else {
                    self.wake_later(n, id);
                    LifeState::Registering(lease)
                }
            }
            (LifeState::CheckingRegistration(lease), Input::Etcd(None)) => {
                self.wake_later(n, id);
                LifeState::CheckingRegistration(lease)
            }
            (LifeState::CheckingRegistration(lease), Input::Wake) => {
                self.call(n, id, EtcdReq::Read { prefixes: vec![], keys: vec![p.node_key(&record.name)] });
                LifeState::CheckingRegistration(lease)
            }
            (LifeState::Registering(lease), Input::Wake) => {
                self.call(n, id, EtcdReq::Txn(register(lease)?));
                LifeState::Registering(lease)
            }
            (LifeState::Cleaning, Input::Etcd(Some(EtcdResp::Read(kvs)))) => {
                let node = &self.nodes[n];
                let lease = node.lease.ok_or("a registered node without a lease")?;
                let running: Vec<AllocEntry> = node.running.values().cloned().collect();
                let cleanup = p
                    .cleanup(&p.view(&kvs), &node.name, node.incarnation, lease, &running)
                    .map_err(|e| format!("cleanup: {e}"))?;
                if let Some(txn) = cleanup.alloc.or_else(|| cleanup.catalog.into_iter().next()) {
                    self.call(n, id, EtcdReq::Txn(txn));
                    LifeState::CleaningTxn
                } else {
                    self.nodes[n].ready = true;
                    let name = record.name.clone();
                    self.log(|| format!("{name}: clean, takes placements"));
                    return Ok(None);
                }
            }
            (LifeState::Cleaning | LifeState::CleaningTxn, Input::Etcd(None)) => {
                self.wake_later(n, id);
                LifeState::Cleaning
            }
            (LifeState::CleaningTxn, Input::Etcd(Some(_))) | (LifeState::Cleaning, Input::Wake) => {
                self.call(n, id, self.cleanup_read(n));
                LifeState::Cleaning
            }
            (state, input) => return Err(format!("life task in {state:?} got {input:?}")),
        }))
    }

    fn registered(&mut self, n: usize, id: u64) {
        self.nodes[n].registered = true;
        let (name, incarnation) = (self.nodes[n].name.clone(), self.nodes[n].incarnation);
        self.log(|| format!("{name}: registered as incarnation {incarnation}"));
        self.call(n, id, self.cleanup_read(n));
    }

    // ---- placers ----

    fn sandbox_keys(&self, request: &[SandboxRequest]) -> Vec<String> {
        request.iter().map(|s| self.p.sandbox_key(&s.id)).collect()
    }

    /// Reads what a plan needs: every node record and alloc, and the request's catalog entries.
    fn placer_read(&mut self, n: usize, id: u64, keys: Vec<String>) {
        let body = EtcdReq::Read { prefixes: vec![self.p.nodes_prefix(), self.p.allocs_prefix()], keys };
        self.call(n, id, body);
    }

    fn answer(&mut self, n: usize, client: u64, result: Result<&Plan, String>) -> Result<(), String> {
        if !self.check.answered.insert(client) {
            return Err(format!("client {client} answered twice"));
        }
        let name = self.nodes[n].name.clone();
        match result {
            Ok(plan) => {
                self.stats.successes += 1;
                let to = self.index(&plan.node);
                let ids = plan.ids();
                for id in &ids {
                    if let Some(&(m, _)) = self.check.started.get(id)
                        && m != to
                    {
                        return Err(format!("client {client} told {id} is on {} but it started on n{m}", plan.node));
                    }
                }
                let line =
                    format!("{name}: client {client} told {ids:?} created on {} #{}", plan.node, plan.incarnation);
                self.log(|| line);
                self.check.successes.push((ids, to, plan.incarnation));
            }
            Err(why) => {
                self.stats.failures += 1;
                if why.starts_with("no node") {
                    self.stats.no_room += 1;
                }
                self.log(|| format!("{name}: client {client} told it failed: {why}"));
            }
        }
        Ok(())
    }

    fn index(&self, name: &str) -> usize {
        self.nodes.iter().position(|n| n.name == name).unwrap_or(usize::MAX)
    }

    /// Another attempt from the start, or the end of trying.
    fn retry(&mut self, n: usize, id: u64, mut placer: Placer, why: &str) -> Step<Placer> {
        placer.attempts += 1;
        if placer.attempts > MAX_ATTEMPTS {
            self.answer(n, placer.client, Err(format!("gave up: {why}")))?;
            return Ok(None);
        }
        placer.state = PlacerState::Reading;
        if std::mem::take(&mut placer.burnt) && !self.cfg.reuse_forwarded_ids {
            let attempt = placer.attempts;
            for s in &mut placer.request {
                let base = s.id.split('.').next().unwrap_or_default().to_owned();
                s.id = format!("{base}.{attempt}");
            }
        }
        let keys = self.sandbox_keys(&placer.request);
        self.placer_read(n, id, keys);
        Ok(Some(placer))
    }

    fn forward(&mut self, n: usize, id: u64, mut placer: Placer, plan: Plan) -> Step<Placer> {
        self.next_token += 1;
        let token = self.next_token;
        let to = self.index(&plan.node);
        let forward = Forward {
            to,
            from: n,
            process: self.nodes[n].process,
            task: id,
            token,
            incarnation: plan.incarnation,
            entries: plan.entries.clone(),
        };
        self.send_node(n, to, || Event::Forward(forward.clone()));
        let (process, timeout) = (self.nodes[n].process, self.params.forward_timeout);
        self.after(timeout, Event::ForwardTimeout { node: n, process, task: id, token });
        placer.burnt = true;
        placer.state = PlacerState::Forwarding(plan, token);
        Ok(Some(placer))
    }

    fn release_read(&mut self, n: usize, id: u64, plan: &Plan) {
        let mut keys = vec![self.p.alloc_key(&plan.node)];
        keys.extend(plan.entries.iter().map(|e| self.p.sandbox_key(&e.id)));
        self.call(n, id, EtcdReq::Read { prefixes: vec![], keys });
    }

    fn placer(&mut self, n: usize, id: u64, mut placer: Placer, input: Input) -> Step<Placer> {
        let p = Rc::clone(&self.p);
        let state = std::mem::replace(&mut placer.state, PlacerState::Reading);
        match (state, input) {
            (PlacerState::Reading, Input::Etcd(Some(EtcdResp::Read(kvs)))) => {
                match p.plan(&p.view(&kvs), &placer.request, &placer.exclude) {
                    Ok(mut plan) => {
                        if self.cfg.skip_fencing {
                            plan.txn.compares.retain(|c| !matches!(c, Compare::ModRevision { .. }));
                        }
                        self.call(n, id, EtcdReq::Txn(plan.txn.clone()));
                        placer.state = PlacerState::Placing(plan);
                        Ok(Some(placer))
                    }
                    Err(e) => {
                        self.answer(n, placer.client, Err(e.to_string()))?;
                        Ok(None)
                    }
                }
            }
            (PlacerState::Reading, Input::Etcd(None)) => self.retry(n, id, placer, "etcd did not answer"),
            (PlacerState::Placing(plan), Input::Etcd(Some(EtcdResp::Txn(true)))) => self.forward(n, id, placer, plan),
            (PlacerState::Placing(_), Input::Etcd(Some(EtcdResp::Txn(false)))) => {
                self.retry(n, id, placer, "the reservation lost a race")
            }
            (PlacerState::Placing(plan) | PlacerState::Checking(plan), Input::Etcd(None)) => {
                // Whether the reservation was made is unknown: read the catalog.
                placer.attempts += 1;
                if placer.attempts > MAX_ATTEMPTS {
                    self.answer(n, placer.client, Err("etcd did not answer".into()))?;
                    return Ok(None);
                }
                let keys = plan.entries.iter().map(|e| p.sandbox_key(&e.id)).collect();
                self.call(n, id, EtcdReq::Read { prefixes: vec![], keys });
                placer.state = PlacerState::Checking(plan);
                Ok(Some(placer))
            }
            (PlacerState::Checking(plan), Input::Etcd(Some(EtcdResp::Read(kvs)))) => {
                if p.view(&kvs).all_in(&plan.ids(), &plan.node, plan.incarnation, SandboxState::Reserved) {
                    self.forward(n, id, placer, plan)
                } else {
                    self.retry(n, id, placer, "the reservation was not made")
                }
            }
            (PlacerState::Forwarding(plan, token), Input::Reply { token: t, created }) if t == token => {
                if created {
                    self.answer(n, placer.client, Ok(&plan))?;
                    return Ok(None);
                }
                self.release_read(n, id, &plan);
                placer.state = PlacerState::Releasing(plan);
                Ok(Some(placer))
            }
            (PlacerState::Forwarding(plan, token), Input::ForwardTimeout { token: t }) if t == token => {
                self.release_read(n, id, &plan);
                placer.state = PlacerState::Releasing(plan);
                Ok(Some(placer))
            }
            (state, Input::Reply { .. } | Input::ForwardTimeout { .. }) => {
                // A duplicate answer, or one after the placer gave up waiting: the catalog decides.
                placer.state = state;
                Ok(Some(placer))
            }
            (PlacerState::Releasing(plan), Input::Etcd(Some(EtcdResp::Read(kvs)))) => {
                let release = p
                    .release_reservation(&p.view(&kvs), &plan.node, plan.incarnation, &plan.ids())
                    .map_err(|e| format!("release: {e}"))?;
                match release {
                    Release::Taken => {
                        self.stats.taken += 1;
                        self.answer(n, placer.client, Ok(&plan))?;
                        Ok(None)
                    }
                    Release::Gone => {
                        placer.exclude.insert(plan.node.clone());
                        self.retry(n, id, placer, "the reservation is gone")
                    }
                    Release::Txn(txn) => {
                        self.call(n, id, EtcdReq::Txn(txn));
                        placer.state = PlacerState::ReleasingTxn(plan);
                        Ok(Some(placer))
                    }
                }
            }
            (PlacerState::ReleasingTxn(plan), Input::Etcd(Some(EtcdResp::Txn(true)))) => {
                placer.exclude.insert(plan.node.clone());
                self.retry(n, id, placer, "the node did not take it")
            }
            (PlacerState::Releasing(plan) | PlacerState::ReleasingTxn(plan), Input::Etcd(_)) => {
                placer.attempts += 1;
                if placer.attempts > MAX_ATTEMPTS {
                    // The reservation stays until its node sweeps it.
                    self.answer(n, placer.client, Err("could not release".into()))?;
                    return Ok(None);
                }
                self.release_read(n, id, &plan);
                placer.state = PlacerState::Releasing(plan);
                Ok(Some(placer))
            }
            (state, input) => Err(format!("placer in {state:?} got {input:?}")),
        }
    }

    // ---- the node a create is forwarded to ----

    fn reply(&mut self, forward: &Forward, created: bool) {
        let (to, process, task, token) = (forward.from, forward.process, forward.task, forward.token);
        self.send_node(forward.to, forward.from, || Event::Reply { to, process, task, token, created });
    }

    fn forwarded(&mut self, forward: Forward) -> Result<(), String> {
        let c = forward.to;
        let node = &self.nodes[c];
        let ids: Vec<String> = forward.entries.iter().map(|e| e.id.clone()).collect();
        let other = !node.registered || (node.incarnation != forward.incarnation && !self.cfg.confirm_any_incarnation);
        let incarnation = if self.cfg.confirm_any_incarnation { forward.incarnation } else { node.incarnation };
        let taken = ids.iter().all(|id| node.taken.contains(id));
        let confirming = ids.iter().any(|id| node.confirming.contains(id));
        if other {
            self.reply(&forward, false);
        } else if taken {
            // A duplicate of a forward taken before (the sandboxes may have ended since): created.
            self.reply(&forward, true);
        } else if confirming {
            // A duplicate of a forward being confirmed.
        } else {
            let node = &self.nodes[c];
            let lease = node.lease.ok_or("a registered node without a lease")?;
            let txn = self.p.confirm(&node.name, incarnation, lease, &ids).map_err(|e| format!("confirm: {e}"))?;
            self.nodes[c].confirming.extend(ids.iter().cloned());
            let confirm = Confirm { forward, ids, incarnation, state: ConfirmState::Confirming };
            let task = self.spawn(c, Task::Confirm(confirm));
            self.call(c, task, EtcdReq::Txn(txn));
        }
        Ok(())
    }

    fn confirm(&mut self, c: usize, id: u64, mut confirm: Confirm, input: Input) -> Step<Confirm> {
        let p = Rc::clone(&self.p);
        let (name, incarnation) = (self.nodes[c].name.clone(), confirm.incarnation);
        let created = match (&confirm.state, input) {
            (ConfirmState::Confirming, Input::Etcd(Some(EtcdResp::Txn(true)))) => true,
            (ConfirmState::Confirming, Input::Etcd(Some(EtcdResp::Txn(false)))) => {
                // Refused now, but an earlier confirmation held up on the way may have been applied: read back.
                let keys = confirm.ids.iter().map(|i| p.sandbox_key(i)).collect();
                self.call(c, id, EtcdReq::Read { prefixes: vec![], keys });
                confirm.state = ConfirmState::Checking;
                return Ok(Some(confirm));
            }
            (ConfirmState::Confirming | ConfirmState::Checking, Input::Etcd(None)) => {
                self.wake_later(c, id);
                confirm.state = ConfirmState::Checking;
                return Ok(Some(confirm));
            }
            (ConfirmState::Checking, Input::Wake) => {
                let keys = confirm.ids.iter().map(|i| p.sandbox_key(i)).collect();
                self.call(c, id, EtcdReq::Read { prefixes: vec![], keys });
                return Ok(Some(confirm));
            }
            (ConfirmState::Checking, Input::Etcd(Some(EtcdResp::Read(kvs)))) => {
                let view = p.view(&kvs);
                if view.all_in(&confirm.ids, &name, incarnation, SandboxState::Active) {
                    // This confirmation was applied: no other could have been, as forwards being confirmed
                    // or already taken are not confirmed again.
                    true
                } else if view.all_in(&confirm.ids, &name, incarnation, SandboxState::Reserved) {
                    let lease = self.nodes[c].lease.ok_or("a registered node without a lease")?;
                    let txn = p.confirm(&name, incarnation, lease, &confirm.ids).map_err(|e| e.to_string())?;
                    self.call(c, id, EtcdReq::Txn(txn));
                    confirm.state = ConfirmState::Confirming;
                    return Ok(Some(confirm));
                } else {
                    false
                }
            }
            (state, input) => return Err(format!("confirmation in {state:?} got {input:?}")),
        };
        for i in &confirm.ids {
            self.nodes[c].confirming.remove(i);
        }
        if created {
            for entry in &confirm.forward.entries {
                self.nodes[c].taken.insert(entry.id.clone());
                self.nodes[c].running.insert(entry.id.clone(), entry.clone());
                if let Some((m, i)) = self.check.started.insert(entry.id.clone(), (c, incarnation)) {
                    return Err(format!("{} starts again on {name}, after it started on n{m} #{i}", entry.id));
                }
                self.stats.started += 1;
            }
            self.check.dirty = true;
            let ids = confirm.ids.clone();
            self.log(|| format!("{name}: confirmed and started {ids:?}"));
        } else {
            let ids = confirm.ids.clone();
            self.log(|| format!("{name}: refuses {ids:?}"));
        }
        self.reply(&confirm.forward, created);
        Ok(None)
    }

    // ---- ended sandboxes ----

    fn end(&mut self, n: usize, id: &str) {
        let Some(_entry) = self.nodes[n].running.remove(id) else { return };
        self.check.dirty = true;
        let (name, incarnation) = (self.nodes[n].name.clone(), self.nodes[n].incarnation);
        self.log(|| format!("{name}: {id} ended"));
        let task = self.spawn(n, Task::End(End { id: id.to_owned(), incarnation, state: EndState::Reading }));
        self.end_read(n, task, id);
    }

    fn end_read(&mut self, n: usize, task: u64, id: &str) {
        let keys = vec![self.p.alloc_key(&self.nodes[n].name), self.p.sandbox_key(id)];
        self.call(n, task, EtcdReq::Read { prefixes: vec![], keys });
    }

    fn release_ended(&mut self, n: usize, id: u64, mut end: End, input: Input) -> Step<End> {
        let p = Rc::clone(&self.p);
        match (&end.state, input) {
            (EndState::Reading, Input::Etcd(Some(EtcdResp::Read(kvs)))) => {
                match p.release_sandbox(&p.view(&kvs), &self.nodes[n].name, end.incarnation, &end.id) {
                    None => Ok(None),
                    Some(txn) => {
                        self.call(n, id, EtcdReq::Txn(txn));
                        end.state = EndState::Releasing;
                        Ok(Some(end))
                    }
                }
            }
            (EndState::Releasing, Input::Etcd(Some(EtcdResp::Txn(true)))) => Ok(None),
            (_, Input::Etcd(None)) => {
                self.wake_later(n, id);
                Ok(Some(end))
            }
            (_, Input::Wake | Input::Etcd(Some(EtcdResp::Txn(false)))) => {
                end.state = EndState::Reading;
                self.end_read(n, id, &end.id.clone());
                Ok(Some(end))
            }
            (state, input) => Err(format!("release of {} in {state:?} got {input:?}", end.id)),
        }
    }

    // ---- the sweep of reservations nobody forwarded ----

    fn sweep(&mut self, n: usize, id: u64, releasing: bool, input: Input) -> Result<Option<Task>, String> {
        let p = Rc::clone(&self.p);
        match (releasing, input) {
            (false, Input::Etcd(Some(EtcdResp::Read(kvs)))) => {
                let now = self.now;
                let node = &mut self.nodes[n];
                let view = p.view(&kvs);
                let reserved: Vec<String> = p
                    .reservations(&view, &node.name, node.incarnation)
                    .into_iter()
                    .filter(|i| !node.confirming.contains(i))
                    .collect();
                node.reserved_since.retain(|i, _| reserved.contains(i));
                let mut stale = Vec::new();
                for i in reserved {
                    let since = *node.reserved_since.entry(i.clone()).or_insert(now);
                    if now - since >= STALE_MS && stale.len() < MAX_REQUEST {
                        stale.push(i);
                    }
                }
                if stale.is_empty() {
                    node.sweeping = false;
                    return Ok(None);
                }
                let (name, incarnation) = (node.name.clone(), node.incarnation);
                match p.release_reservation(&view, &name, incarnation, &stale).map_err(|e| e.to_string())? {
                    Release::Txn(txn) => {
                        self.log(|| format!("{name}: sweeps stale reservations {stale:?}"));
                        self.stats.swept += stale.len() as u64;
                        self.call(n, id, EtcdReq::Txn(txn));
                        Ok(Some(Task::Sweep { releasing: true }))
                    }
                    Release::Taken | Release::Gone => {
                        self.nodes[n].sweeping = false;
                        Ok(None)
                    }
                }
            }
            (_, Input::Etcd(_)) => {
                self.nodes[n].sweeping = false;
                Ok(None)
            }
            (_, input) => Err(format!("sweep got {input:?}")),
        }
    }

    // ---- lookups ----

    fn lookup(&mut self, n: usize, id: &str, input: Input) -> Result<(), String> {
        let Input::Etcd(Some(EtcdResp::Read(kvs))) = input else { return Ok(()) };
        self.stats.lookups += 1;
        let p = Rc::clone(&self.p);
        let name = self.nodes[n].name.clone();
        let owner = p.lookup(&p.view(&kvs), &name, id).map_err(|e| format!("lookup: {e}"))?;
        let line = format!("{name}: lookup {id} ⇒ {owner:?}");
        self.log(|| line);
        let Some((_, told, _)) = self.check.successes.iter().find(|(ids, _, _)| ids.iter().any(|i| i == id)) else {
            return Err(format!("looked up {id}, which no client was told of"));
        };
        let told = &self.nodes[*told].name;
        let named = match &owner {
            Owner::Local => Some(name.clone()),
            Owner::Remote { advertise } => {
                Some(advertise.trim_start_matches("http://").trim_end_matches(":8080").to_owned())
            }
            Owner::Lost { node } => Some(node.clone()),
            Owner::Unknown => None,
        };
        if let Some(named) = named
            && named != *told
        {
            return Err(format!("lookup of {id} says {owner:?}, but the client was told {told}"));
        }
        Ok(())
    }

    // ---- checks ----

    /// (a) and (b), whenever etcd or what a node runs changed.
    fn check_step(&mut self) -> Result<(), String> {
        let revision = self.etcd.revision();
        if revision == self.check.checked_revision && !self.check.dirty {
            return Ok(());
        }
        self.check.checked_revision = revision;
        self.check.dirty = false;
        let mut owner: BTreeMap<&str, usize> = BTreeMap::new();
        for (i, node) in self.nodes.iter().enumerate() {
            if node.running.is_empty() {
                continue;
            }
            let entries: Vec<AllocEntry> = node.running.values().cloned().collect();
            Bins::with_entries(node.cpus, node.slots, &entries)
                .map_err(|e| format!("{} is over-committed on CPUs: {e}", node.name))?;
            let memory: u64 = entries.iter().map(|e| e.memory).sum();
            if memory > node.memory {
                return Err(format!("{} is over-committed on memory: {memory} > {}", node.name, node.memory));
            }
            let alloc_key = self.p.alloc_key(&node.name);
            let alloc = match self.etcd.value(&alloc_key).map(|v| Alloc::parse(&alloc_key, v)) {
                _ if self.cfg.properties_only => None,
                Some(Ok(alloc)) if alloc.incarnation == node.incarnation => Some(alloc),
                other => {
                    return Err(format!(
                        "{} runs {:?} as incarnation {}, but its alloc is {other:?}",
                        node.name,
                        node.running.keys().collect::<Vec<_>>(),
                        node.incarnation
                    ));
                }
            };
            for (id, entry) in &node.running {
                if let Some(other) = owner.insert(id.as_str(), i) {
                    return Err(format!("{id} runs on both {} and {}", self.nodes[other].name, node.name));
                }
                let key = self.p.sandbox_key(id);
                let catalog = self.etcd.value(&key).map(|v| CatalogEntry::parse(&key, v));
                if !matches!(&catalog, Some(Ok(e)) if e.is(&node.name, node.incarnation, SandboxState::Active)) {
                    return Err(format!(
                        "{id} runs on {} #{}, but the catalog says {catalog:?}",
                        node.name, node.incarnation
                    ));
                }
                if let Some(alloc) = &alloc
                    && alloc.entry(id) != Some(entry)
                {
                    return Err(format!(
                        "{id} runs on {} as {entry:?}, but its alloc has {:?}",
                        node.name,
                        alloc.entry(id)
                    ));
                }
            }
        }
        Ok(())
    }

    /// Whether all is quiet and clean: every node up and clean, running nothing, with no task but sweeps and
    /// lookups, and the catalog and the allocs empty.
    fn settled(&self) -> bool {
        let quiet = self.nodes.iter().all(|n| {
            n.up && n.ready
                && n.running.is_empty()
                && n.tasks.values().all(|t| matches!(t, Task::Sweep { .. } | Task::Lookup { .. }))
        });
        quiet
            && self.etcd.range(&self.p.sandboxes_prefix()).is_empty()
            && self.nodes.iter().all(|n| {
                let key = self.p.alloc_key(&n.name);
                self.etcd
                    .value(&key)
                    .and_then(|v| Alloc::parse(&key, v).ok())
                    .is_some_and(|a| a.incarnation == n.incarnation && a.entries.is_empty())
            })
    }

    /// (c), and that nothing leaked once all is quiet.
    fn check_end(&mut self) -> Result<(), String> {
        for (ids, node, incarnation) in &self.check.successes {
            for id in ids {
                let started = self.check.started.get(id) == Some(&(*node, *incarnation));
                if !started && !self.check.dead.contains(&(*node, *incarnation)) {
                    return Err(format!(
                        "a client was told {id} was created on n{node} #{incarnation}, which is alive, but it never \
                         started"
                    ));
                }
            }
        }
        for node in &self.nodes {
            if !node.up || !node.ready {
                return Err(format!("{} is not back and clean at the end (up: {})", node.name, node.up));
            }
            if let Some(task) = node.tasks.values().find(|t| !matches!(t, Task::Sweep { .. } | Task::Lookup { .. })) {
                return Err(format!("{} still has a task at the end: {task:?}", node.name));
            }
            if !node.running.is_empty() {
                return Err(format!("{} still runs {:?} at the end", node.name, node.running.keys()));
            }
            let key = self.p.alloc_key(&node.name);
            match self.etcd.value(&key).map(|v| Alloc::parse(&key, v)) {
                Some(Ok(alloc)) if alloc.incarnation == node.incarnation && alloc.entries.is_empty() => {}
                other => return Err(format!("{}'s alloc at the end: {other:?}", node.name)),
            }
        }
        let catalog = self.etcd.range(&self.p.sandboxes_prefix());
        if !catalog.is_empty() {
            let keys: Vec<&str> = catalog.iter().map(|kv| short(&kv.key)).collect();
            return Err(format!("the catalog still holds {keys:?} at the end"));
        }
        Ok(())
    }
}
