//! Attacks on the host, written down so they can never come back: each module is one class of escape, tried on
//! every tier it applies to.

mod blocking;
mod grants;
mod outcomes;
mod snapshots;
