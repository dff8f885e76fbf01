//! Prints its arguments, its environment (sorted) and its stdin.
use std::io::Read;

fn main() {
    for (i, arg) in std::env::args().enumerate() {
        println!("arg[{i}]={arg}");
    }
    let mut env: Vec<(String, String)> = std::env::vars().collect();
    env.sort();
    for (k, v) in env {
        println!("env {k}={v}");
    }
    let mut stdin = String::new();
    std::io::stdin().read_to_string(&mut stdin).expect("stdin");
    println!("stdin={stdin}");
}
