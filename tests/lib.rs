//! Strata's integration tests live in `all/` (one test binary, as wasmtime's `tests/all`); this library is
//! empty so the package has a target besides them.
#![forbid(unsafe_code)]
