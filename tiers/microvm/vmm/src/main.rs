//! The `strata-vmm` binary: one microVM's monitor process.

fn main() {
    std::process::exit(1);
}
