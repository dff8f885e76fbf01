//! Writes N bytes of 'x' to stdout and N bytes of 'y' to stderr, in 8 KiB writes.
use std::io::Write;

fn main() {
    let total: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(1 << 20);
    let mut out = std::io::stdout().lock();
    let mut err = std::io::stderr().lock();
    let (xs, ys) = ([b'x'; 8192], [b'y'; 8192]);
    let mut left = total;
    while left > 0 {
        let n = left.min(xs.len());
        out.write_all(&xs[..n]).expect("stdout");
        err.write_all(&ys[..n]).expect("stderr");
        left -= n;
    }
}
