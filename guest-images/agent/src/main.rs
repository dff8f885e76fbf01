//! `strata-agent`: see the library's documentation.

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(strata_agent::run(&args));
}
