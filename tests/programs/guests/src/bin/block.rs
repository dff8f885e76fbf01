//! Blocks in one host call, chosen by the first argument, and prints `woke` if that call ever returns:
//!
//! - `sleep MS`: one relative clock subscription (`std::thread::sleep`);
//! - `sleep-abs MS`: one absolute monotonic clock subscription, MS from now;
//! - `naps MS`: sleeps of 1 ms, one after another, for MS in all;
//! - `poll-stdin MS`: a relative clock of MS and a read subscription on stdin, in one `poll_oneoff`;
//! - `read-stdin`: one `fd_read` of stdin;
//! - `lines`: prints `got LINE` for each line of stdin as it arrives, then `eof`;
//! - `tool NAME`: calls the host tool NAME (`host.call`) with no arguments, then prints its answer;
//! - `open PATH`: opens PATH for reading and reads it (a FIFO with no writer, in a grant).
use std::io::{BufRead, Write};

fn subscribe(clock_ns: u64, flags: wasi::Subclockflags, stdin: bool) {
    let mut subs = vec![wasi::Subscription {
        userdata: 1,
        u: wasi::SubscriptionU {
            tag: wasi::EVENTTYPE_CLOCK.raw(),
            u: wasi::SubscriptionUU {
                clock: wasi::SubscriptionClock { id: wasi::CLOCKID_MONOTONIC, timeout: clock_ns, precision: 0, flags },
            },
        },
    }];
    if stdin {
        subs.push(wasi::Subscription {
            userdata: 2,
            u: wasi::SubscriptionU {
                tag: wasi::EVENTTYPE_FD_READ.raw(),
                u: wasi::SubscriptionUU { fd_read: wasi::SubscriptionFdReadwrite { file_descriptor: 0 } },
            },
        });
    }
    let mut events = vec![
        wasi::Event {
            userdata: 0,
            error: wasi::ERRNO_SUCCESS,
            type_: wasi::EVENTTYPE_CLOCK,
            fd_readwrite: wasi::EventFdReadwrite { nbytes: 0, flags: 0 },
        };
        subs.len()
    ];
    // SAFETY: both buffers hold `subs.len()` elements of the types the call reads and writes.
    let n = unsafe { wasi::poll_oneoff(subs.as_ptr(), events.as_mut_ptr(), subs.len()) }.expect("poll_oneoff");
    for event in &events[..n] {
        println!("event {}", event.userdata);
    }
}

#[link(wasm_import_module = "host")]
unsafe extern "C" {
    #[link_name = "call"]
    fn host_call(req: *const u8, req_len: usize, out_ptr: *mut *mut u8, out_len: *mut usize) -> i32;
}

/// Where the host puts its answers (`host.call`'s allocator).
#[unsafe(no_mangle)]
pub extern "C" fn host_alloc(len: usize) -> *mut u8 {
    Box::leak(vec![0u8; len].into_boxed_slice()).as_mut_ptr()
}

fn call_tool(name: &str) {
    let frame = format!(r#"{{"v":1,"id":1,"op":"call","tool":"{name}","args":{{}}}}"#);
    let (mut ptr, mut len) = (std::ptr::null_mut(), 0usize);
    // SAFETY: the frame outlives the call; the host writes the answer's address and length to the two pointers.
    let status = unsafe { host_call(frame.as_ptr(), frame.len(), &mut ptr, &mut len) };
    if status != 0 {
        println!("host.call returned {status}");
        return;
    }
    // SAFETY: the host allocated `len` bytes at `ptr` with `host_alloc` and filled them.
    let answer = unsafe { std::slice::from_raw_parts(ptr, len) };
    println!("answer {}", String::from_utf8_lossy(answer));
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize| args.get(i).cloned().unwrap_or_default();
    let ms = || arg(2).parse::<u64>().unwrap_or(3_600_000);
    match arg(1).as_str() {
        "sleep" => std::thread::sleep(std::time::Duration::from_millis(ms())),
        "sleep-abs" => {
            // SAFETY: a plain clock read.
            let now = unsafe { wasi::clock_time_get(wasi::CLOCKID_MONOTONIC, 1) }.expect("clock");
            subscribe(
                now.saturating_add(ms().saturating_mul(1_000_000)),
                wasi::SUBCLOCKFLAGS_SUBSCRIPTION_CLOCK_ABSTIME,
                false,
            );
        }
        "naps" => {
            let end = std::time::Instant::now() + std::time::Duration::from_millis(ms());
            while std::time::Instant::now() < end {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        "poll-stdin" => subscribe(ms().saturating_mul(1_000_000), 0, true),
        "read-stdin" => {
            let mut buf = [0u8; 64];
            // SAFETY: one iovec over `buf`.
            let read = unsafe { wasi::fd_read(0, &[wasi::Iovec { buf: buf.as_mut_ptr(), buf_len: buf.len() }]) };
            println!("read {read:?}");
        }
        "lines" => {
            for line in std::io::stdin().lock().lines() {
                let line = line.expect("stdin");
                println!("got {line}");
                std::io::stdout().flush().expect("stdout");
            }
            println!("eof");
        }
        "tool" => call_tool(&arg(2)),
        "open" => match std::fs::read(arg(2)) {
            Ok(bytes) => println!("read {} bytes", bytes.len()),
            Err(err) => println!("open: {err}"),
        },
        other => {
            eprintln!("unknown mode {other:?}");
            std::process::exit(2);
        }
    }
    println!("woke");
}
