//! The `strata-vmm` binary: one microVM's monitor process (see `strata_vmm::monitor`).

fn main() {
    strata_vmm::monitor::main()
}
