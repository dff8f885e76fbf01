//! Exits with the code given as the first argument, after printing to both streams.
fn main() {
    let code: i32 = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(0);
    println!("exiting with {code}");
    eprintln!("to stderr");
    std::process::exit(code);
}
