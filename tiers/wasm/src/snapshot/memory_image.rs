//! Linear memories mapped copy-on-write from a memory image file: how snapshot-ready instances
//! ([`super::ready_module`]) get their memory.
//!
//! The engine that runs snapshot-ready modules allocates instances on demand with [`MappedMemoryCreator`] as
//! its memory creator. Before instantiating, the caller names the image the instance's memory starts from
//! ([`with_image`]); the creator reserves the memory's whole address range (reservation plus guard, as the
//! compiled code expects), maps the image over its start `MAP_PRIVATE` and makes the rest of the initial size
//! zero pages. An image is never a file others can reach: a mapped file that someone truncates kills the host
//! with `SIGBUS` at the next touch of a page past its end. A snapshot's memory is its [`PrivateCopy`] (an
//! unnamed file or a sealed memfd, which no other process can shrink or write); the runtime's base image is the
//! module cache's entry, which only the host writes, by rename. Pages the guest only reads stay the copy's,
//! shared by every instance mapped from the same image; a write copies that one page into the instance. A memory
//! created with no image named (the GC heap that exception handling needs) is plain zeroed memory.
//!
//! All of this tier's `mmap` lives in this module.

use std::cell::RefCell;
use std::ffi::c_void;
use std::fs::File;
use std::num::NonZeroUsize;
use std::ptr::NonNull;
use std::sync::Arc;

use nix::sys::mman::{MapFlags, ProtFlags, mmap, mmap_anonymous, mprotect, munmap};
use strata_core::PrivateCopy;
use wasmtime::{LinearMemory, MemoryCreator, MemoryType};

/// A memory image: a file whose bytes are a linear memory's first `len` bytes.
#[derive(Debug)]
pub(crate) struct MemoryImage {
    file: ImageFile,
    len: usize,
}

#[derive(Debug)]
enum ImageFile {
    /// A private copy: a snapshot's memory, or an image made in this process.
    Copy(Arc<PrivateCopy>),
    /// An entry of the module cache, which only the host writes, and only by rename (as the compiled code that
    /// wasmtime maps from the same directory): the runtime's base image.
    Cache(File),
}

impl MemoryImage {
    /// An image of the whole of `copy`.
    pub(crate) fn new(copy: Arc<PrivateCopy>) -> std::io::Result<MemoryImage> {
        let len = copy.len();
        MemoryImage::of(ImageFile::Copy(copy), len)
    }

    /// An image of the whole of a module cache entry, of `len` bytes.
    pub(crate) fn cached(file: File, len: u64) -> std::io::Result<MemoryImage> {
        MemoryImage::of(ImageFile::Cache(file), len)
    }

    fn of(file: ImageFile, len: u64) -> std::io::Result<MemoryImage> {
        if !len.is_multiple_of(super::ready_module::WASM_PAGE) {
            return Err(std::io::Error::other(format!("a memory image of {len} bytes is not whole wasm pages")));
        }
        let len = usize::try_from(len).map_err(std::io::Error::other)?;
        Ok(MemoryImage { file, len })
    }

    fn file(&self) -> &File {
        match &self.file {
            ImageFile::Copy(copy) => copy.file(),
            ImageFile::Cache(file) => file,
        }
    }

    /// Its size in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

struct Pending {
    image: Arc<MemoryImage>,
    /// The minimum size, in wasm pages, of the memory this image is for.
    minimum_pages: u64,
}

thread_local! {
    /// The image the next linear memory created on this thread starts from. Instantiation creates memories on
    /// the thread that instantiates, so this reaches exactly the instance [`with_image`] wraps.
    static PENDING: RefCell<Option<Pending>> = const { RefCell::new(None) };
}

/// Runs `instantiate` with `image` as the initial contents of the memory (of `minimum_pages` wasm pages
/// minimum) it creates. The image is forgotten afterwards, whether or not it was used.
pub(crate) fn with_image<R>(image: Arc<MemoryImage>, minimum_pages: u64, instantiate: impl FnOnce() -> R) -> R {
    struct Clear;
    impl Drop for Clear {
        fn drop(&mut self) {
            PENDING.with(|p| p.borrow_mut().take());
        }
    }
    PENDING.with(|p| *p.borrow_mut() = Some(Pending { image, minimum_pages }));
    let _clear = Clear;
    instantiate()
}

/// Creates linear memories from the image named by [`with_image`], or zeroed.
#[derive(Debug, Default)]
pub(crate) struct MappedMemoryCreator;

/// The address range reserved when wasmtime names no reservation: all a 32-bit memory can address.
const DEFAULT_RESERVATION: usize = 4 << 30;

// SAFETY: every memory returned reserves `reserved_size_in_bytes` (or 4 GiB) plus `guard_size_in_bytes` of
// address space at a page-aligned base, of which exactly the first `byte_size()` bytes are readable and
// writable and the rest is inaccessible (PROT_NONE) until `grow_to`; the base never moves; the mapping is the
// memory's alone and is unmapped only when the memory is dropped.
unsafe impl MemoryCreator for MappedMemoryCreator {
    fn new_memory(
        &self,
        ty: MemoryType,
        minimum: usize,
        maximum: Option<usize>,
        reserved_size_in_bytes: Option<usize>,
        guard_size_in_bytes: usize,
    ) -> Result<Box<dyn LinearMemory>, String> {
        let image = PENDING.with(|p| {
            let mut pending = p.borrow_mut();
            let wanted =
                pending.as_ref().is_some_and(|p| !ty.is_64() && !ty.is_shared() && ty.minimum() == p.minimum_pages);
            if wanted { pending.take().map(|p| p.image) } else { None }
        });
        let initial = minimum.max(image.as_ref().map_or(0, |i| i.len));
        // Growth past `maximum` is refused by wasmtime before it reaches `grow_to`.
        let _ = maximum;
        let capacity = reserved_size_in_bytes.unwrap_or(DEFAULT_RESERVATION);
        if initial > capacity {
            return Err(format!("a memory of {initial} bytes does not fit its reservation of {capacity} bytes"));
        }
        let total = capacity
            .checked_add(guard_size_in_bytes)
            .and_then(NonZeroUsize::new)
            .ok_or_else(|| "a memory reservation overflows".to_owned())?;
        // SAFETY: a fresh anonymous mapping at an address the kernel chooses touches no existing memory.
        let base = unsafe {
            mmap_anonymous(None, total, ProtFlags::PROT_NONE, MapFlags::MAP_PRIVATE | MapFlags::MAP_NORESERVE)
        }
        .map_err(|e| format!("cannot reserve {total} bytes for a linear memory: {e}"))?;
        let memory = MappedMemory { base, total: total.get(), size: 0, capacity };
        let mapped = match (&image, NonZeroUsize::new(image.as_ref().map_or(0, |i| i.len))) {
            (Some(image), Some(len)) => {
                // SAFETY: the range [base, base + len) lies inside the reservation made above, which belongs to
                // this memory alone; MAP_FIXED replaces those reserved pages with a private mapping of the image,
                // which no one else can shrink under the mapping (see `ImageFile`).
                unsafe {
                    mmap(
                        NonZeroUsize::new(base.as_ptr() as usize),
                        len,
                        ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                        MapFlags::MAP_PRIVATE | MapFlags::MAP_FIXED,
                        image.file(),
                        0,
                    )
                }
                .map_err(|e| format!("cannot map a memory image of {len} bytes: {e}"))?;
                len.get()
            }
            _ => 0,
        };
        let mut memory = memory;
        memory.size = mapped;
        memory.grow_to(initial).map_err(|e| e.to_string())?;
        Ok(Box::new(memory))
    }
}

/// A linear memory in its own reservation; see [`MappedMemoryCreator`].
struct MappedMemory {
    base: NonNull<c_void>,
    /// The reservation, guard included.
    total: usize,
    /// Accessible bytes.
    size: usize,
    /// Bytes it may grow to without moving.
    capacity: usize,
}

// SAFETY: the memory is plain bytes owned by this value; wasmtime serialises access to it through its store.
unsafe impl Send for MappedMemory {}
// SAFETY: as above; `&MappedMemory` only reads the sizes.
unsafe impl Sync for MappedMemory {}

// SAFETY: see the `MemoryCreator` implementation: the base is page-aligned and fixed, `byte_size` bytes are
// accessible, and the reservation beyond them (the guard included) is inaccessible.
unsafe impl LinearMemory for MappedMemory {
    fn byte_size(&self) -> usize {
        self.size
    }

    fn byte_capacity(&self) -> usize {
        self.capacity
    }

    fn grow_to(&mut self, new_size: usize) -> wasmtime::Result<()> {
        if new_size <= self.size {
            return Ok(());
        }
        if new_size > self.capacity {
            wasmtime::bail!("a linear memory cannot grow past its reservation of {} bytes", self.capacity);
        }
        let start = self.base.as_ptr() as usize + self.size;
        let Some(start) = NonNull::new(start as *mut c_void) else {
            wasmtime::bail!("a linear memory's address overflows");
        };
        // SAFETY: [start, start + (new_size - size)) lies inside this memory's reservation, past its accessible
        // bytes; making it readable and writable exposes zero pages of the anonymous reservation.
        unsafe { mprotect(start, new_size - self.size, ProtFlags::PROT_READ | ProtFlags::PROT_WRITE) }
            .map_err(|e| wasmtime::Error::msg(format!("cannot grow a linear memory to {new_size} bytes: {e}")))?;
        self.size = new_size;
        Ok(())
    }

    fn as_ptr(&self) -> *mut u8 {
        self.base.as_ptr().cast()
    }
}

impl Drop for MappedMemory {
    fn drop(&mut self) {
        // SAFETY: the whole reservation was mapped by `new_memory` for this memory alone, and wasmtime drops the
        // memory only once no instance uses it.
        let _ = unsafe { munmap(self.base, self.total) };
    }
}
