//! The wasm tier's module cache entry loader (`tiers/wasm/src/cache.rs`): the `.sum` file and the `.cwasm` beside
//! it, as they may be found on disk after a crash, a bad disk or a tampering, checked before wasmtime maps them.
//!
//! Input: a mode byte, then: mode 0, a `.sum` text and `.cwasm` bytes of the input's choosing; mode 1, a genuine
//! entry (a small module this engine compiled) whose `.cwasm` gets the input's edits (a byte changed, cut short,
//! grown); mode 2, the genuine `.cwasm` under a `.sum` the input edits.
//!
//! Oracles: the `.sum` parser never panics and what it parses renders back to the same fields; an entry loads
//! only when its `.cwasm` is byte for byte what was stored: a corrupt entry is refused (and then recompiled),
//! never mapped.

use std::path::PathBuf;
use std::sync::OnceLock;

use strata_tier_wasm::cache::ModuleCache;
use strata_tier_wasm::cache::fuzzing::{load, parse_sum, store, sum_round_trips};
use wasmtime::{Engine, Module};

use crate::generate::Cursor;

/// A module with a function, so that its compiled form has code in it.
const WAT: &[u8] =
    b"\0asm\x01\0\0\0\x01\x05\x01\x60\0\x01\x7f\x03\x02\x01\0\x07\x05\x01\x01f\0\0\x0a\x06\x01\x04\0\x41\x2a\x0b";

struct Genuine {
    engine: Engine,
    cwasm: Vec<u8>,
    sum: String,
}

fn genuine() -> &'static Genuine {
    static GENUINE: OnceLock<Genuine> = OnceLock::new();
    GENUINE.get_or_init(|| {
        let engine = Engine::default();
        let module = Module::new(&engine, WAT).expect("the module compiles");
        let dir = scratch();
        let cache = ModuleCache::new(&dir);
        store(&cache, &[0; 32], &module).expect("the entry is stored");
        let (cwasm, sum) = cache.entry_paths(&[0; 32]);
        let cwasm = std::fs::read(cwasm).expect("the .cwasm");
        let sum = std::fs::read_to_string(sum).expect("the .sum");
        // Without its stamp: the loader must hash the file, as it does for any entry it has not checked.
        let sum = sum.lines().next().expect("a digest line").to_owned() + "\n";
        let _ = std::fs::remove_dir_all(&dir);
        Genuine { engine, cwasm, sum }
    })
}

fn scratch() -> PathBuf {
    crate::scratch::fresh("cache")
}

/// Loads the entry `data` describes.
pub fn run(data: &[u8]) {
    let genuine = genuine();
    let mut input = Cursor::new(data);
    let mode = input.u8() % 3;
    let (sum, cwasm) = match mode {
        0 => {
            let sum = String::from_utf8_lossy(input.block()).into_owned();
            (sum, input.rest().to_vec())
        }
        1 => {
            let mut cwasm = genuine.cwasm.clone();
            while !input.is_empty() {
                let at = usize::from(input.u16());
                match input.u8() % 4 {
                    0 => cwasm.truncate(at % (cwasm.len() + 1)),
                    1 => cwasm.push(input.u8()),
                    _ => {
                        if let Some(len) = std::num::NonZeroUsize::new(cwasm.len()) {
                            cwasm[at % len] ^= input.u8() | 1;
                        }
                    }
                }
            }
            (genuine.sum.clone(), cwasm)
        }
        _ => {
            let mut sum = genuine.sum.clone();
            let edit = String::from_utf8_lossy(input.rest()).into_owned();
            match edit.strip_prefix('+') {
                Some(tail) => sum.push_str(tail),
                None => sum = edit + &sum,
            }
            (sum, genuine.cwasm.clone())
        }
    };
    if let Some(same) = sum_round_trips(&sum) {
        assert!(same, "a .sum file changed through render and parse: {sum:?}");
    }
    let parsed = parse_sum(&sum);
    let dir = scratch();
    std::fs::create_dir_all(&dir).expect("a cache directory");
    let cache = ModuleCache::new(&dir);
    let (cwasm_path, sum_path) = cache.entry_paths(&[0; 32]);
    std::fs::write(&cwasm_path, &cwasm).expect("write the .cwasm");
    std::fs::write(&sum_path, &sum).expect("write the .sum");
    let loaded = load(&cache, &genuine.engine, &[0; 32]);
    let _ = std::fs::remove_dir_all(&dir);
    if loaded.is_ok() {
        assert!(cwasm == genuine.cwasm, "a corrupt .cwasm was loaded (mode {mode}, .sum {parsed:?})");
    }
}
