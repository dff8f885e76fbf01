//! Random identifiers: snapshot ids and the suffixes of temporary names.

use std::fs::File;
use std::io::Read;

/// `bytes` random bytes from the kernel, hex (identifiers, temp names).
pub(crate) fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    let filled = File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut buf)).is_ok();
    if !filled {
        // Identifiers only need to be unique, not secret: time and pid will do.
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
        let seed = nanos ^ (u128::from(std::process::id()) << 64);
        for (i, b) in buf.iter_mut().enumerate() {
            *b = (seed >> ((i % 16) * 8)) as u8;
        }
    }
    strata_image_util::hex(&buf)
}
