#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| (strata_fuzzing::targets::snapshot_upper_tree::run)(data));
