//! `strata-jail`: started by Strata's process tier, never by hand. See the crate documentation.

fn main() {
    std::process::exit(strata_jail::init::main());
}
