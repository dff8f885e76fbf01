//! File-system probes. Each attempt prints one line, `NAME: allowed` or `NAME: denied (REASON)`, so tests can
//! check exactly which operations the host let through.
//!
//! fs read PATH            print the file's contents
//! fs write PATH TEXT      create/overwrite a file
//! fs mutate DIR           try every kind of change inside DIR (for read-only grants)
//! fs escape DIR           try to reach outside the grant at DIR with raw WASI calls
use std::fs;
use std::io::Write;

fn report<T, E: std::fmt::Display>(name: &str, result: Result<T, E>) {
    match result {
        Ok(_) => println!("{name}: allowed"),
        Err(err) => println!("{name}: denied ({err})"),
    }
}

fn mutate(dir: &str) {
    let existing = format!("{dir}/existing.txt");
    report("create", fs::write(format!("{dir}/new.txt"), b"x"));
    report("overwrite", fs::write(&existing, b"changed"));
    report("append", fs::OpenOptions::new().append(true).open(&existing).and_then(|mut f| f.write_all(b"more")));
    report("truncate", fs::OpenOptions::new().write(true).truncate(true).open(&existing));
    report("set_len", fs::File::open(&existing).and_then(|f| f.set_len(0)));
    report(
        "set_times",
        fs::File::open(&existing)
            .and_then(|f| f.set_times(fs::FileTimes::new().set_modified(std::time::SystemTime::UNIX_EPOCH))),
    );
    report("unlink", fs::remove_file(&existing));
    report("mkdir", fs::create_dir(format!("{dir}/newdir")));
    report("rmdir", fs::remove_dir(format!("{dir}/subdir")));
    report("rename", fs::rename(&existing, format!("{dir}/renamed.txt")));
    match preopen_fd(dir) {
        // SAFETY: plain WASI call with valid &str arguments.
        Some(base) => report("symlink", unsafe { wasi::path_symlink("existing.txt", base, "link") }),
        None => println!("symlink: denied (no preopen named {dir})"),
    }
    report("hardlink", fs::hard_link(&existing, format!("{dir}/hard")));
    report("read", fs::read(&existing));
}

/// Finds the preopened directory fd whose guest name is `dir`.
fn preopen_fd(dir: &str) -> Option<wasi::Fd> {
    for fd in 3..64 {
        // SAFETY: fd_prestat_get only reads the fd table; an unused fd is an error, not UB.
        let Ok(prestat) = (unsafe { wasi::fd_prestat_get(fd) }) else { continue };
        // SAFETY: tag 0 is PREOPENTYPE_DIR, the only kind; the union's `dir` member is the initialised one.
        let len = unsafe { prestat.u.dir.pr_name_len };
        let mut name = vec![0u8; len];
        // SAFETY: `name` has exactly `len` writable bytes.
        if unsafe { wasi::fd_prestat_dir_name(fd, name.as_mut_ptr(), len) }.is_ok() && name == dir.as_bytes() {
            return Some(fd);
        }
    }
    None
}

/// Opens `path` relative to the preopen `base` with a raw `path_open` and reads it.
fn raw_read(base: wasi::Fd, path: &str, follow: bool) -> Result<Vec<u8>, String> {
    let lookup = if follow { wasi::LOOKUPFLAGS_SYMLINK_FOLLOW } else { 0 };
    // SAFETY: plain WASI call; the path is a valid &str for its duration.
    let fd = unsafe { wasi::path_open(base, lookup, path, 0, wasi::RIGHTS_FD_READ, 0, 0) }
        .map_err(|e| e.name().to_owned())?;
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let iov = wasi::Iovec { buf: buf.as_mut_ptr(), buf_len: buf.len() };
        // SAFETY: the iovec points at `buf`, which outlives the call.
        let n = unsafe { wasi::fd_read(fd, &[iov]) }.map_err(|e| e.name().to_owned())?;
        if n == 0 {
            break;
        }
        out.extend_from_slice(&buf[..n]);
    }
    // SAFETY: `fd` was opened above and is closed once.
    let _ = unsafe { wasi::fd_close(fd) };
    Ok(out)
}

fn escape(dir: &str) {
    let Some(base) = preopen_fd(dir) else {
        println!("no preopen named {dir}");
        std::process::exit(3);
    };
    for path in ["../outside.txt", "sub/../../outside.txt", "/etc/passwd", "link-out/outside.txt", "abs-link", "rel-link"] {
        report(&format!("raw {path}"), raw_read(base, path, true));
    }
    // Through the guest's libc as well: absolute paths and `..` resolved against the preopen.
    report("std ../outside.txt", fs::read(format!("{dir}/../outside.txt")));
    report("std /etc/passwd", fs::read("/etc/passwd"));
    // A symlink the guest makes itself, pointing outside, must not be followable.
    // SAFETY: plain WASI call with valid &str arguments.
    let made = unsafe { wasi::path_symlink("/etc/passwd", base, "made-link") };
    match made {
        Ok(()) => report("raw made-link", raw_read(base, "made-link", true)),
        Err(e) => println!("raw made-link: denied (symlink {})", e.name()),
    }
    // SAFETY: as above.
    let made = unsafe { wasi::path_symlink("../outside.txt", base, "made-rel-link") };
    match made {
        Ok(()) => report("raw made-rel-link", raw_read(base, "made-rel-link", true)),
        Err(e) => println!("raw made-rel-link: denied (symlink {})", e.name()),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("read") => match fs::read(&args[2]) {
            Ok(bytes) => std::io::stdout().write_all(&bytes).expect("stdout"),
            Err(err) => {
                eprintln!("read {}: {err}", args[2]);
                std::process::exit(1);
            }
        },
        Some("write") => {
            if let Err(err) = fs::write(&args[2], args[3].as_bytes()) {
                eprintln!("write {}: {err}", args[2]);
                std::process::exit(1);
            }
        }
        Some("mutate") => mutate(&args[2]),
        Some("escape") => escape(&args[2]),
        _ => {
            eprintln!("usage: fs read|write|mutate|escape ...");
            std::process::exit(2);
        }
    }
}
