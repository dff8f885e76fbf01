//! Sealed in-memory copies of files that the host maps: what a snapshot's memory image becomes before any
//! sandbox maps it.
//!
//! A file mapped into the host (a fork's guest memory is a `MAP_PRIVATE` mapping of its snapshot's memory image)
//! stays tied to that file: if anyone truncates it, the next touch of a page past the new end raises `SIGBUS` in
//! the host process, and if anyone rewrites it, pages the fork has not read yet show bytes nobody verified. A
//! snapshot directory is untrusted data (a job may be able to write where snapshots live), so what is mapped is
//! never the file: [`SealedFile::copy_from`] copies it once into a memfd, handing every byte to the caller's
//! check on the way, and seals the memfd against shrinking, growing and writing (`F_SEAL_SHRINK | F_SEAL_GROW |
//! F_SEAL_WRITE`, then `F_SEAL_SEAL`). The kernel then refuses every change to it, from this process or any other
//! that gets the descriptor; `MAP_PRIVATE` mappings of it stay writable (copy on write). Pages that are all zero
//! are not written: they stay holes of the memfd, cost no memory, and read as zero.

use std::ffi::CStr;
use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::FileExt;

use nix::fcntl::{FcntlArg, SealFlag, fcntl};
use nix::sys::memfd::{MFdFlags, memfd_create};

/// The unit in which zero pages are skipped.
const PAGE: usize = 4096;
/// How much is read at a time.
const CHUNK: usize = 1 << 20;

/// A file's bytes in a sealed memfd: fixed in size and content for as long as it exists. Share it with
/// `Arc`; each mapping of it keeps the memory alive on its own.
#[derive(Debug)]
pub struct SealedFile {
    file: File,
    len: u64,
}

impl SealedFile {
    /// Copies exactly `len` bytes of `source` into a new memfd named `name` (for `/proc/PID/maps`), giving
    /// every chunk to `inspect` in order (to hash it), and seals it. Fewer bytes than `len` is an
    /// [`io::ErrorKind::UnexpectedEof`] error, more an [`io::ErrorKind::InvalidData`] one: the copy is the file
    /// as it was meant to be, or nothing.
    pub fn copy_from(
        name: &CStr,
        source: impl Read,
        len: u64,
        mut inspect: impl FnMut(&[u8]),
    ) -> io::Result<SealedFile> {
        let fd = memfd_create(name, MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING)?;
        let file = File::from(fd);
        file.set_len(len)?;
        let mut input = source.take(len.saturating_add(1));
        let mut buf = vec![0u8; CHUNK];
        let mut offset = 0u64;
        loop {
            let n = match input.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
                Err(err) => return Err(err),
            };
            if offset + n as u64 > len {
                return Err(io::Error::new(io::ErrorKind::InvalidData, format!("more than the {len} bytes expected")));
            }
            let chunk = &buf[..n];
            inspect(chunk);
            write_nonzero(&file, chunk, offset)?;
            offset += n as u64;
        }
        if offset != len {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("{offset} bytes where {len} were expected"),
            ));
        }
        let seals = SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_WRITE | SealFlag::F_SEAL_SEAL;
        fcntl(&file, FcntlArg::F_ADD_SEALS(seals))?;
        Ok(SealedFile { file, len })
    }

    /// The memfd, to map (`MAP_PRIVATE`) or read; every write to it is refused.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Its size in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Writes the pages of `chunk` that are not all zero at `offset`, leaving the others holes.
fn write_nonzero(file: &File, chunk: &[u8], offset: u64) -> io::Result<()> {
    let mut at = 0;
    while at < chunk.len() {
        // A run of pages with data, written with one call.
        let start = at;
        while at < chunk.len() && !is_zero(&chunk[at..(at + PAGE).min(chunk.len())]) {
            at = (at + PAGE).min(chunk.len());
        }
        if at > start {
            file.write_all_at(&chunk[start..at], offset + start as u64)?;
        }
        while at < chunk.len() && is_zero(&chunk[at..(at + PAGE).min(chunk.len())]) {
            at = (at + PAGE).min(chunk.len());
        }
    }
    Ok(())
}

fn is_zero(bytes: &[u8]) -> bool {
    // Eight bytes at a time: a page of zeros is checked in a few hundred instructions.
    let (words, rest) = bytes.as_chunks::<8>();
    words.iter().all(|w| u64::from_ne_bytes(*w) == 0) && rest.iter().all(|&b| b == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sealed(bytes: &[u8]) -> SealedFile {
        SealedFile::copy_from(c"test", bytes, bytes.len() as u64, |_| {}).expect("copy")
    }

    #[test]
    fn the_copy_has_the_bytes_and_refuses_every_change() {
        let mut bytes = vec![0u8; 3 * PAGE + 100];
        bytes[5] = 1;
        bytes[2 * PAGE + 7] = 2;
        bytes[3 * PAGE + 99] = 3;
        let copy = sealed(&bytes);
        assert_eq!(copy.len(), bytes.len() as u64);
        let mut read = vec![0u8; bytes.len()];
        copy.file().read_exact_at(&mut read, 0).expect("read");
        assert_eq!(read, bytes);
        copy.file().set_len(0).expect_err("shrinking is refused");
        copy.file().set_len(1 << 20).expect_err("growing is refused");
        copy.file().write_all_at(b"x", 0).expect_err("writing is refused");
        let seals = fcntl(copy.file(), FcntlArg::F_GET_SEALS).expect("seals");
        assert!(SealFlag::from_bits_truncate(seals).contains(SealFlag::F_SEAL_SEAL));
    }

    #[test]
    fn zero_pages_stay_holes() {
        let mut bytes = vec![0u8; 256 * PAGE];
        bytes[0] = 1;
        let copy = sealed(&bytes);
        let blocks = nix::sys::stat::fstat(copy.file()).expect("stat").st_blocks as u64 * 512;
        assert!(blocks < 16 * PAGE as u64, "{blocks} bytes allocated for one page of data");
    }

    #[test]
    fn a_short_or_long_source_is_an_error() {
        let err = SealedFile::copy_from(c"test", &b"abc"[..], 4, |_| {}).expect_err("short");
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
        let err = SealedFile::copy_from(c"test", &b"abcde"[..], 4, |_| {}).expect_err("long");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }

    #[test]
    fn every_byte_is_inspected_in_order() {
        let bytes: Vec<u8> = (0..3 * CHUNK + 17).map(|i| (i % 251) as u8).collect();
        let mut seen = Vec::new();
        SealedFile::copy_from(c"test", &bytes[..], bytes.len() as u64, |chunk| seen.extend_from_slice(chunk))
            .expect("copy");
        assert_eq!(seen, bytes);
    }
}
