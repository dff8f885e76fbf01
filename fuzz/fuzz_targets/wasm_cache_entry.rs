#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| (strata_fuzzing::targets::wasm_cache_entry::run)(data));
