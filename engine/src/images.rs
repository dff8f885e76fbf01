//! The guest images an engine's tiers run from, under its home ([`Engine::images`](crate::Engine::images)): the
//! pinned Python runtime for wasm, the Debian tree (the process tier's root filesystem and the microVM disk), the
//! microVM kernel and initramfs. Each is built or fetched into `$STRATA_HOME` once, keyed by its inputs; these
//! handles find, check and build them.

use std::path::Path;

use strata_kernel_image::KernelImage;
use strata_python_image::PythonImage;
use strata_rootfs_image::DebianImage;
use strata_rootfs_image::initramfs::{self, InstalledInitramfs};

use crate::EngineError;

/// The images under one engine's home.
#[derive(Debug, Clone, Copy)]
pub struct Images<'e> {
    home: Option<&'e Path>,
}

impl<'e> Images<'e> {
    pub(crate) fn new(home: Option<&'e Path>) -> Images<'e> {
        Images { home }
    }

    fn home(&self, what: &'static str) -> Result<&'e Path, EngineError> {
        self.home.ok_or(EngineError::NoHome(what))
    }

    /// The pinned Python runtime for the wasm tier.
    pub fn python(&self) -> Result<PythonImage, EngineError> {
        PythonImage::new(self.home("the Python runtime")?).map_err(image_error)
    }

    /// The Debian image (the process tier's root filesystem, the microVM's disk).
    pub fn debian(&self) -> Result<DebianImage, EngineError> {
        DebianImage::new(self.home("the Debian image")?).map_err(image_error)
    }

    /// The microVM guest kernel.
    pub fn kernel(&self) -> Result<KernelImage, EngineError> {
        KernelImage::new(self.home("the guest kernel")?).map_err(image_error)
    }

    /// The microVM initramfs (the embedded guest agent as `/init` and Debian's static busybox), built when missing
    /// or changed.
    pub fn initramfs(&self) -> Result<InstalledInitramfs, EngineError> {
        let home = self.home("the initramfs")?;
        let agent = strata_tier_microvm::guest::agent_binary().map_err(image_error)?;
        initramfs::ensure_initramfs(home, agent, Path::new(initramfs::BUSYBOX_STATIC)).map_err(image_error)
    }

    /// The microVM initramfs when it is built for this agent and busybox; builds nothing.
    pub fn installed_initramfs(&self) -> Result<Option<InstalledInitramfs>, EngineError> {
        let home = self.home("the initramfs")?;
        let agent = strata_tier_microvm::guest::agent_binary().map_err(image_error)?;
        initramfs::installed_initramfs(home, agent, Path::new(initramfs::BUSYBOX_STATIC)).map_err(image_error)
    }
}

fn image_error(err: impl std::fmt::Display) -> EngineError {
    EngineError::Image(err.to_string())
}
