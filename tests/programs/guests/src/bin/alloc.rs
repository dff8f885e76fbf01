//! Allocates and touches the given number of MiB, 1 MiB at a time, then prints the total.
fn main() {
    let mib: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(16);
    let mut blocks = Vec::new();
    for i in 0..mib {
        let mut block = vec![0u8; 1 << 20];
        block[i % (1 << 20)] = 1;
        blocks.push(block);
    }
    println!("allocated {} MiB", blocks.len());
}
