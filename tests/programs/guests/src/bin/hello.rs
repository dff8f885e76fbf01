//! The demo job: greets its first argument.
fn main() {
    let name = std::env::args().nth(1).unwrap_or_else(|| "world".to_owned());
    println!("Hello, {name}! This line was printed by a WebAssembly guest inside Strata.");
}
