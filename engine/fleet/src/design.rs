//! The fleet protocol's design record: how many `strata serve` nodes run as one fleet through etcd, what each
//! transaction compares and why, and what a crash or a partition loses.
//!
//! # Keys
//!
//! Under a prefix `p` (default `/strata/`, [`crate::DEFAULT_PREFIX`]):
//!
//! - `{p}nodes/{node}`: the [`NodeRecord`] (name, advertise URL, incarnation, CPUs, slots per CPU, memory,
//!   draining), written by the node with its lease.
//! - `{p}alloc/{node}`: the [`Alloc`] (the incarnation, and every sandbox placed on the node and not released,
//!   with its CPUs), without a lease, written by placers and the node, always fenced by its mod revision.
//! - `{p}sandboxes/{id}`: the [`CatalogEntry`] (owning node, its incarnation, `reserved` or `active`), without a
//!   lease, written by placers and the owning node.
//!
//! The record lives by the node's lease: when the node stops keeping it alive, etcd deletes it, and the node is
//! gone for everyone. The alloc and the catalog have no lease: the alloc keeps a dead node's capacity counted until
//! it comes back and cleans up, and a catalog entry outlives its node so that a request for the sandbox is answered
//! "lost" ([`Owner::Lost`]), not "unknown".
//!
//! An **incarnation** is one registration: a node takes a new one each time it starts, and each time it registers
//! again after losing its lease. A lease belongs to one incarnation, so comparing a record's lease compares its
//! incarnation too.
//!
//! # The one invariant
//!
//! *Every sandbox a node runs is in the node's alloc, under the node's current incarnation, and its catalog entry
//! names that node and incarnation, active.* Admission is computed from the alloc ([`Bins`] rebuilt from its
//! entries' CPUs, memory summed), so a node whose alloc fits it is never over-committed, and an id has one catalog
//! key, so it has one owner. Every transaction below exists to keep that invariant through concurrent placers,
//! lost messages, crashes and partitions. Each compares every fact its decision rests on, so a stale or partial
//! read can only make a transaction fail (then the caller reads again and decides again), never write something
//! wrong.
//!
//! # Transactions
//!
//! **Register** ([`Protocol::register`]): put the record with the node's new lease, if `Missing{nodes/C}`. Two
//! processes given one name never both register. A node restarted before its previous lease expired waits (at
//! most the TTL) until etcd deletes the old record; a lost reply is told from a refusal by reading the record
//! ([`Protocol::is_registered`]). A put naming a lease that expired meanwhile is an etcd *error*, not a failed
//! compare: the node then grants a new lease and starts over.
//!
//! **Clean up** ([`Protocol::cleanup`]), before taking placements: the alloc becomes `{incarnation, running}`
//! (compares: the node's own `Lease`, so a stale process cannot rewrite it, and the alloc's mod revision, or
//! `Missing`); then the catalog entries naming an *earlier* incarnation of the node, for sandboxes it does not run,
//! are deleted, each compared by mod revision, in batches of at most [`MAX_TXN_OPS`]. Entries of the current
//! incarnation are never deleted here: they are reservations placed after the alloc was rewritten. `running` is
//! what the node really runs: nothing after a restart, and nothing after a lost lease, because a node that learns
//! its lease is gone first kills every sandbox (they may all have been reported lost meanwhile).
//!
//! **Place** ([`Protocol::plan`]): nodes in name order, skipping draining ones, excluded ones, and those whose
//! alloc is absent or of another incarnation than their record (not cleaned up yet); the whole request (a fork of
//! `count` copies is one request) goes to the first node where [`Bins::place_all`] and memory admit all of it. The
//! reservation compares:
//! - `Lease{nodes/C, lease read}`: C is alive and still the incarnation read;
//! - `ModRevision{alloc/C, rev read}`, the **fencing revision**: nobody changed C's alloc since it was read, so two
//!   placers reading a free node cannot both add to it (without it, the second put drops the first's entries and
//!   C is over-committed: the simulation's broken placer shows it);
//! - `Missing{sandboxes/id}` for every id: no id gets a second owner;
//!
//! and puts the alloc with the new entries and each catalog entry `reserved`. A node without an alloc is never
//! placed on (so placements always compare a mod revision, never `Missing`): its cleanup, still to come, would
//! rewrite the alloc without the reservation.
//!
//! **Confirm** ([`Protocol::confirm`]): the placer forwards the create to C, which, *before creating anything*,
//! compares its own `Lease` (its record still stands: a node whose lease expired must not start sandboxes that
//! lookups already call lost) and `Value{sandboxes/id, reserved on C at C's current incarnation}` for each id (the
//! reservation stands, and was made for this incarnation: a restarted node must not take its predecessor's
//! reservations, which its cleanup took out of the alloc), and makes them `active`. C creates the sandboxes only
//! if this succeeds, and creates an id at most once per incarnation: it remembers the ids it took, answers a
//! duplicate forward of them "created", and never confirms one request twice at once.
//!
//! **Release a reservation** ([`Protocol::release_reservation`]): a placer whose forward was refused or not
//! answered deletes the catalog entries, compared by the mod revision they were read at (still `reserved`), and
//! takes the entries out of the alloc (fenced). Confirm and release compare the same entry, so exactly one of them
//! wins: when the release finds the entries `active`, C took them and the placement succeeded after all
//! ([`Release::Taken`]). When it finds them gone ([`Release::Gone`]), either someone released them or C took them
//! and they already ended; so a placer that forwarded ids places the request again only under *new* ids.
//!
//! **Release a sandbox** ([`Protocol::release_sandbox`]): once a sandbox ended and its resources are free, C takes
//! it out of its alloc (fenced) and deletes its catalog entry if it still names C (compared by mod revision; its
//! absence is compared too, so a caller that did not read it fails instead of leaking it).
//!
//! **Sweep** ([`Protocol::reservations`]): a reservation nobody forwards (its placer crashed, or gave up without
//! being able to release) would hold capacity forever; its node releases it, with the same transaction, once it
//! has stayed unconfirmed for longer than any placer waits.
//!
//! **Lookup** ([`Protocol::lookup`]): an active catalog entry naming a node whose record has the same incarnation
//! is [`Owner::Local`] or [`Owner::Remote`]; one naming a node whose record is absent or of another incarnation is
//! [`Owner::Lost`]; a reserved or absent entry is [`Owner::Unknown`].
//!
//! **Unknown outcomes.** A transaction whose answer is lost may have been applied or not, and may even be applied
//! later, after the caller stopped waiting (held up in a queue). So a caller decides from what it reads back, and
//! every transaction's compares make a late one harmless: a placer checks whether its ids are reserved on C (a
//! late reservation after it moved on fails on `Missing`, or is swept); C, confirming, reads back after a failure
//! as after a timeout.
//!
//! # Found by the simulation
//!
//! The simulation found four rules the transactions alone do not give; each is now part of the protocol.
//! - **A reservation gone after a forward may have lived.** A placer whose forward timed out found its ids gone
//!   and placed them again on another node; but the first node had confirmed them, and the sandbox had already
//!   ended and been released. One id then lived on two nodes, one after the other. Rule: after a forward, a
//!   placer places again only under new ids ([`Release::Gone`]).
//! - **Reading back an `active` entry does not say whose confirmation applied.** A node's confirmation got no
//!   answer; reading back, it found the ids active and created them, but they were active from an earlier
//!   confirmation of a duplicated forward, and that sandbox had run and ended: it ran twice. Rule: a node creates an
//!   id at most once per incarnation, answering duplicate forwards from what it took, so that the read-back is
//!   unambiguous ([`Protocol::confirm`]).
//! - **A failed confirmation does not mean refused.** A node's confirmation timed out; it read the ids still
//!   reserved and confirmed again, which failed, so it refused. But the first had been held up on its way and was
//!   applied in between: the placer, releasing, found the ids active and told its client "created", for sandboxes
//!   nobody ran. Rule: a node reads back after a failed confirmation as after a lost answer, and only refuses
//!   when the ids are neither reserved nor active on its incarnation.
//! - **Registering with a lease that expired is an error, not a failed compare.** A node cut from etcd while it
//!   waited to register found its new lease gone; etcd refuses a put naming it outright. Rule: on that error, grant
//!   a new lease and register again.
//!
//! # What a crash or a partition loses
//!
//! - **A node crashes**: its sandboxes die. Its record stays until the lease expires (placements there until then
//!   are refused by the new process, which has another incarnation, and released by their placers); then lookups
//!   call its sandboxes lost. It restarts as a new incarnation, registers once the old record is gone, and cleans
//!   up: the alloc is emptied and the lost catalog entries deleted (lookups then say unknown). Placers running on
//!   it die with it: their clients get no answer, and the reservations they made elsewhere are swept. A node that
//!   never comes back leaves its alloc and catalog entries behind for an operator to delete.
//! - **A node is cut from etcd**: it keeps running its sandboxes, but cannot confirm new ones. Once the TTL passes,
//!   etcd expires its lease and deletes its record: placers skip it and lookups call its sandboxes lost, while they
//!   still run until it can reach etcd again. Then its keepalive is refused; it kills everything, and registers and
//!   cleans up as a new incarnation. Its alloc kept their capacity counted all along, so nothing was placed onto
//!   it meanwhile. A partition shorter than the TTL loses nothing.
//! - **A message is lost**: a lost forward or reply costs the placer its timeout, then the release decides; a lost
//!   etcd answer is read back. Nothing is created twice under one id, and nothing is left reserved for good.
//!
//! # Limits
//!
//! A transaction holds at most [`MAX_TXN_OPS`] compares and as many operations (etcd's default), so a request
//! places at most [`MAX_REQUEST`] sandboxes. Cleanup and the sweep read the whole catalog. Records refuse unknown
//! fields: a fleet runs one format at a time. Placement is first-fit by node name, which packs the first nodes
//! full before using the next.
//!
//! # Checked by simulation
//!
//! `tests/simulation` runs 100,000 seeded schedules of this protocol (3 to 5 nodes of random capacity, the etcd
//! model, a network with random delay, loss and duplication, crashes, partitions, lease expiry) and checks after
//! every step that no node runs more than its CPUs and memory admit, that no sandbox runs on two nodes, that each
//! running sandbox is in its node's alloc and catalog entry, and at the end that every success a client was told
//! was created and that nothing leaked.
//!
//! [`NodeRecord`]: crate::NodeRecord
//! [`Alloc`]: crate::Alloc
//! [`CatalogEntry`]: crate::CatalogEntry
//! [`Owner::Lost`]: crate::Owner::Lost
//! [`Owner::Local`]: crate::Owner::Local
//! [`Owner::Remote`]: crate::Owner::Remote
//! [`Owner::Unknown`]: crate::Owner::Unknown
//! [`Bins`]: crate::Bins
//! [`Bins::place_all`]: crate::Bins::place_all
//! [`Protocol::register`]: crate::Protocol::register
//! [`Protocol::is_registered`]: crate::Protocol::is_registered
//! [`Protocol::cleanup`]: crate::Protocol::cleanup
//! [`Protocol::plan`]: crate::Protocol::plan
//! [`Protocol::confirm`]: crate::Protocol::confirm
//! [`Protocol::release_reservation`]: crate::Protocol::release_reservation
//! [`Protocol::release_sandbox`]: crate::Protocol::release_sandbox
//! [`Protocol::reservations`]: crate::Protocol::reservations
//! [`Protocol::lookup`]: crate::Protocol::lookup
//! [`Release::Taken`]: crate::Release::Taken
//! [`Release::Gone`]: crate::Release::Gone
//! [`MAX_TXN_OPS`]: crate::MAX_TXN_OPS
//! [`MAX_REQUEST`]: crate::MAX_REQUEST
