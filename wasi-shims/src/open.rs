//! Opening only files whose `open(2)` cannot wait: a guest may open regular files and directories, nothing else.
//!
//! Strata lets file I/O run inline on the job's thread (wasmtime-wasi's `allow_blocking_current_thread`: a thread
//! hop per call would cost Python's imports about a tenth of their time). An `open(2)` of a FIFO with no writer, or
//! of a terminal or another device, then waits on that thread where neither the job's wall limit nor a cancel can
//! end it, and so would every read of it. A grant may hold such a file: the host's own, or one made by a job of a
//! native tier sharing the directory (a FIFO is an ordinary thing to make there). So before wasmtime-wasi opens a
//! path, [`add_to_linker`] (preview1's `path_open`) and [`add_to_component_linker`] (WASI 0.2's
//! `descriptor.open-at`) look at what it names, as the open would (same directory, same symlink rule), and refuse
//! anything but a regular file, a directory or a symbolic link (which an open that does not follow links refuses
//! itself) with `EACCES` (`access`): the guest sees "permission denied", as for any other file it may not open. A
//! path that does not exist is left to the open (which may create a regular file).
//!
//! What this does not cover: a file replaced by a FIFO between the look and the open, by someone writing the host
//! directory at that moment; and a granted directory on a file system that stops answering (a hung network mount),
//! whose calls wait inline too. Both need a host that is already writing or serving the grant against its jobs.

use wasmtime::component::{Linker as ComponentLinker, Resource};
use wasmtime::{AsContextMut, Caller, Extern, Linker};
use wasmtime_wasi::WasiView;
use wasmtime_wasi::filesystem::WasiFilesystemView;
use wasmtime_wasi::p1::wasi_snapshot_preview1::{self, WasiSnapshotPreview1};
use wasmtime_wasi::p1::{WasiP1Ctx, types};
use wasmtime_wasi::p2::bindings::filesystem::types::{
    Descriptor, DescriptorFlags, DescriptorType, ErrorCode, HostDescriptor, OpenFlags, PathFlags,
};
use wiggle::{GuestMemory, GuestPtr};

/// The `wasi:filesystem/types` instance of wasmtime-wasi 48's component linker (a unit test checks the name, so
/// that [`add_to_component_linker`] shadows its `open-at` rather than defining a second instance).
pub const FILESYSTEM_INSTANCE: &str = "wasi:filesystem/types@0.2.12";

/// Shadows `wasi_snapshot_preview1::path_open` in a linker that already holds wasmtime-wasi's preview1; `get`
/// projects the store's data to its preview1 context.
pub fn add_to_linker<T: Send + 'static>(
    linker: &mut Linker<T>,
    get: fn(&mut T) -> &mut WasiP1Ctx,
) -> wasmtime::Result<()> {
    linker.allow_shadowing(true);
    let linked = linker
        .func_wrap_async(
            "wasi_snapshot_preview1",
            "path_open",
            move |mut caller: Caller<'_, T>, args: (i32, i32, i32, i32, i32, i64, i64, i32, i32)| {
                Box::new(async move { path_open(&mut caller, get, args).await })
            },
        )
        .map(|_| ());
    linker.allow_shadowing(false);
    linked
}

/// `path_open(fd, dirflags, path, path_len, oflags, rights_base, rights_inheriting, fdflags, fd_out) -> errno`.
async fn path_open<T>(
    caller: &mut Caller<'_, T>,
    get: fn(&mut T) -> &mut WasiP1Ctx,
    (dirfd, dirflags, path, path_len, oflags, base, inheriting, fdflags, opened): (
        i32,
        i32,
        i32,
        i32,
        i32,
        i64,
        i64,
        i32,
        i32,
    ),
) -> wasmtime::Result<i32> {
    let fuel = caller.as_context_mut().hostcall_fuel();
    let export = caller.get_export("memory");
    let (mut memory, ctx) = match &export {
        Some(Extern::Memory(m)) => {
            let (memory, data) = m.data_and_store_mut(&mut *caller);
            (GuestMemory::Unshared(memory), get(data))
        }
        Some(Extern::SharedMemory(m)) => (GuestMemory::Shared(m.data()), get(caller.data_mut())),
        _ => wasmtime::bail!("missing required memory export"),
    };
    ctx.set_hostcall_fuel(fuel);
    // Malformed arguments are left to wasmtime-wasi, which reports them as it does.
    if let Ok(lookup) = types::Lookupflags::try_from(dirflags) {
        let name = GuestPtr::<str>::new((path as u32, path_len as u32));
        if let Ok(stat) = ctx.path_filestat_get(&mut memory, types::Fd::from(dirfd), lookup, name).await
            && !matches!(
                stat.filetype,
                types::Filetype::RegularFile | types::Filetype::Directory | types::Filetype::SymbolicLink
            )
        {
            return Ok(types::Errno::Acces as i32);
        }
    }
    wasi_snapshot_preview1::path_open(
        ctx,
        &mut memory,
        dirfd,
        dirflags,
        path,
        path_len,
        oflags,
        base,
        inheriting,
        fdflags,
        opened,
    )
    .await
}

/// Shadows `[method]descriptor.open-at` in a component linker that already holds wasmtime-wasi's WASI 0.2.
pub fn add_to_component_linker<T: WasiView + 'static>(linker: &mut ComponentLinker<T>) -> wasmtime::Result<()> {
    linker.allow_shadowing(true);
    let linked = linker.instance(FILESYSTEM_INSTANCE).and_then(|mut types| {
        types.func_wrap_async(
            "[method]descriptor.open-at",
            |mut store,
             (dir, path_flags, path, open_flags, flags): (
                Resource<Descriptor>,
                PathFlags,
                String,
                OpenFlags,
                DescriptorFlags,
            )| {
                Box::new(async move {
                    let mut fs = store.data_mut().filesystem();
                    let borrowed = Resource::new_borrow(dir.rep());
                    if let Ok(stat) = HostDescriptor::stat_at(&mut fs, borrowed, path_flags, path.clone()).await
                        && !matches!(
                            stat.type_,
                            DescriptorType::RegularFile | DescriptorType::Directory | DescriptorType::SymbolicLink
                        )
                    {
                        return Ok((Err(ErrorCode::Access),));
                    }
                    match HostDescriptor::open_at(&mut fs, dir, path_flags, path, open_flags, flags).await {
                        Ok(opened) => Ok((Ok(opened),)),
                        Err(err) => Ok((Err(err.downcast()?),)),
                    }
                })
            },
        )
    });
    linker.allow_shadowing(false);
    linked
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_open_functions_strata_shadows_are_wasmtime_wasis() {
        struct State(wasmtime_wasi::WasiCtx, wasmtime::component::ResourceTable);
        impl WasiView for State {
            fn ctx(&mut self) -> wasmtime_wasi::WasiCtxView<'_> {
                wasmtime_wasi::WasiCtxView { ctx: &mut self.0, table: &mut self.1 }
            }
        }
        let engine = wasmtime::Engine::default();
        let mut linker = ComponentLinker::<State>::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker).expect("wasi");
        // Without shadowing, defining a function wasmtime-wasi defined fails: the instance's name is its.
        let err = linker
            .instance(FILESYSTEM_INSTANCE)
            .expect("instance")
            .func_wrap("[method]descriptor.open-at", |_, (): ()| Ok(()))
            .expect_err("wasmtime-wasi defines open-at under this name");
        assert!(err.to_string().contains("defined twice"), "{err}");
        add_to_component_linker(&mut linker).expect("shadowed");

        let mut linker = Linker::<WasiP1Ctx>::new(&engine);
        wasmtime_wasi::p1::add_to_linker_async(&mut linker, |ctx| ctx).expect("wasi");
        add_to_linker(&mut linker, |ctx| ctx).expect("shadowed");
    }
}
