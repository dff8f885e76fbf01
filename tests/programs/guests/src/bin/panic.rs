//! Panics: a Rust panic on wasm32-wasip1 prints its message and then traps (`unreachable`).
fn main() {
    let what = std::env::args().nth(1).unwrap_or_else(|| "on purpose".to_owned());
    panic!("guest panicked {what}");
}
