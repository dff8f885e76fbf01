//! What a seed is, for [`crate::seeds`] and the modules that write the seeds of one family of targets.

/// A seed: its file name in the target's corpus folder, and its bytes.
pub type Seed = (String, Vec<u8>);

/// Seeds named `seed-<name>`, as the corpus folder keeps them.
pub(crate) fn named(items: Vec<(&str, Vec<u8>)>) -> Vec<Seed> {
    items.into_iter().map(|(name, bytes)| (format!("seed-{name}"), bytes)).collect()
}
