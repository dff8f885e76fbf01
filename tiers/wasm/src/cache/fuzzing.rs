//! The module cache's entry loader, for the fuzz targets (`fuzz/`): the `.sum` parser and the check an entry
//! passes before wasmtime maps it. Not an API.

use super::*;

/// The fields of a `.sum` file that parses: its digest (hex), length and whether it records a stamp.
pub fn parse_sum(text: &str) -> Option<(String, u64, bool)> {
    Sum::parse(text).map(|sum| (sum.hash, sum.len, sum.stamp.is_some()))
}

/// A `.sum` file that parses, rendered and parsed again: equal fields.
pub fn sum_round_trips(text: &str) -> Option<bool> {
    let sum = Sum::parse(text)?;
    let again = Sum::parse(&sum.render())?;
    Some(again.hash == sum.hash && again.len == sum.len && again.stamp == sum.stamp)
}

/// Stores `module` as the entry for `key` in `cache`, as a compile does.
pub fn store(cache: &ModuleCache, key: &Digest, module: &Module) -> io::Result<()> {
    cache.store(key, module)
}

/// Loads the entry for `key` as `load_or_compile` does before it decides to compile: `Ok` when the entry would
/// be used, `Err` with the reason it is missing or unusable.
pub fn load(cache: &ModuleCache, engine: &Engine, key: &Digest) -> Result<Module, String> {
    cache.load::<Module>(engine, key).map_err(|invalid| format!("{invalid:?}"))
}
