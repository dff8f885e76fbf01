//! A WASI 0.2 command component with one behaviour per first argument:
//!
//! - `hello NAME`: prints `Hello, NAME! (component)` and a line to stderr;
//! - `exit CODE`: exits with CODE;
//! - `echo`: prints its args, its environment (sorted) and stdin;
//! - `cat PATH`: prints the file;
//! - `write PATH TEXT`: writes TEXT to PATH, prints `wrote` or `refused: ERROR`;
//! - `alloc MIB`: allocates and touches MIB MiB, then prints the total;
//! - `spin`: loops forever; `sleep MS`: sleeps (a blocking host call), then prints `woke`.
use std::io::{Read, Write};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize| args.get(i).cloned().unwrap_or_default();
    match arg(1).as_str() {
        "hello" => {
            println!("Hello, {}! (component)", arg(2));
            eprintln!("to stderr");
        }
        "exit" => std::process::exit(arg(2).parse().unwrap_or(1)),
        "echo" => {
            for (i, a) in args.iter().enumerate() {
                println!("arg[{i}]={a}");
            }
            let mut env: Vec<(String, String)> = std::env::vars().collect();
            env.sort();
            for (k, v) in env {
                println!("env {k}={v}");
            }
            let mut input = String::new();
            let _ = std::io::stdin().read_to_string(&mut input);
            println!("stdin={input}");
        }
        "cat" => match std::fs::read(arg(2)) {
            Ok(bytes) => std::io::stdout().write_all(&bytes).expect("stdout"),
            Err(err) => {
                println!("refused: {err}");
                std::process::exit(1);
            }
        },
        "write" => match std::fs::write(arg(2), arg(3)) {
            Ok(()) => println!("wrote"),
            Err(err) => println!("refused: {err}"),
        },
        "alloc" => {
            let mib: usize = arg(2).parse().unwrap_or(16);
            let mut blocks = Vec::new();
            for i in 0..mib {
                let mut block = vec![0u8; 1 << 20];
                block[i % (1 << 20)] = 1;
                blocks.push(block);
            }
            println!("allocated {} MiB", blocks.len());
        }
        "spin" => {
            let mut x: u64 = 0;
            loop {
                x = std::hint::black_box(x.wrapping_add(1));
            }
        }
        "sleep" => {
            std::thread::sleep(std::time::Duration::from_millis(arg(2).parse().unwrap_or(10_000)));
            println!("woke");
        }
        other => {
            eprintln!("unknown mode {other:?}");
            std::process::exit(2);
        }
    }
}
