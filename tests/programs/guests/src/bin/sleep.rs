//! Sleeps for the given number of milliseconds (a blocking host call), then prints "woke".
fn main() {
    let ms: u64 = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(10_000);
    std::thread::sleep(std::time::Duration::from_millis(ms));
    println!("woke");
}
