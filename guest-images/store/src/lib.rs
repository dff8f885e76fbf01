//! Custom images: root filesystems built from a Dockerfile or imported from an OCI image, kept under
//! `$STRATA_HOME/images/store/` for the process tier (overlayfs lower directories) and the microVM disk builder.
//!
//! The store holds two kinds of things:
//!
//! - **Layers**, `layers/<key>/`: one read-only directory tree each (`tree/`) in overlayfs's own form — a deleted
//!   file is a whiteout (a character device 0/0), a directory that replaces the one below is marked with the
//!   `trusted.overlay.opaque` attribute — and `layer.json` (what made it, its size). A layer's key is a hash of
//!   what made it (a build step's parent and inputs, an imported blob's digest), so a rebuild finds the layers of
//!   the steps it did not change. A layer is made in a temporary directory and renamed into place complete: a
//!   directory under `layers/` with a `layer.json` is a whole layer.
//! - **Images**, `images/<name>.json`: a name, an optional base (the Debian image's install directory, for images
//!   built `FROM` it), the layers bottom to top, and the defaults a job takes from the image ([`ImageConfig`]).
//!
//! Images come from two places: a Dockerfile build, and [`oci::import`], which reads an OCI image layout or a
//! `docker save` archive from local disk, checks every blob against its digest and extracts each layer with
//! [`layer_tar::apply_layer`] — as host root, so that extraction refuses whatever could reach outside the layer's
//! directory or make something dangerous there (`..`, writes through symlinks, hard links out of the layer, device
//! nodes other than whiteouts, forged overlay attributes; see [`layer_tar`]).
//!
//! The store's directory is mode 0700: layers hold what a guest wrote (setuid bits, files owned by any ID), which
//! only root on the host may reach; jails mount them `nosuid`, `nodev`, read-only and idmapped.

// One small module sets extended attributes through libc (`layer_tar::xattr`); nothing else is unsafe.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod disk;
pub mod dockerfile;
pub mod layer_tar;
pub mod oci;
mod store;

pub use store::{
    ImageConfig, ImageRecord, ImageSource, ImageStore, LayerHold, LayerKey, LayerRecord, MAX_LAYERS, PruneReport,
    ResolvedImage, StoreError,
};
