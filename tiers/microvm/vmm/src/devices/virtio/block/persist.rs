//! Snapshot state of the virtio-blk device: what its configuration space told the guest (capacity, disk ID).
//! The queue and the negotiated features are the transport's ([`crate::devices::virtio::persist`]). The backing
//! file is a constructor argument; restore refuses a file whose size changed, because the guest's filesystem was
//! mounted over the old one.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::device::{BlockDevice, BlockError, DISK_ID_LEN, Disk};
use crate::devices::virtio::persist::Persist;

/// The block device's state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlockState {
    /// Disk size in 512-byte sectors.
    pub capacity_sectors: u64,
    /// The disk ID (at most 20 bytes).
    pub disk_id: Vec<u8>,
}

/// The host resources a block device is rebuilt with.
#[derive(Debug)]
pub struct BlockConstructorArgs {
    /// The backing file; it must have the saved size. Only its name in errors when `file` is given.
    pub path: PathBuf,
    /// The backing file already open (read-only), for a process that cannot open `path`.
    pub file: Option<std::fs::File>,
}

impl BlockConstructorArgs {
    /// The disk at `path`, opened when the device is restored.
    pub fn at(path: impl Into<PathBuf>) -> BlockConstructorArgs {
        BlockConstructorArgs { path: path.into(), file: None }
    }
}

/// Why a block state was refused.
#[derive(Debug, thiserror::Error)]
pub enum BlockPersistError {
    /// The backing file could not be opened.
    #[error("cannot reopen the disk")]
    Open(#[source] BlockError),
    /// The backing file's size differs from the saved capacity.
    #[error("disk image {path} has {now} sectors, the snapshot expects {saved}")]
    CapacityChanged {
        /// The file.
        path: PathBuf,
        /// In the state.
        saved: u64,
        /// The file's.
        now: u64,
    },
    /// The disk ID is longer than 20 bytes.
    #[error("snapshot disk ID is {0} bytes long, at most 20 allowed")]
    DiskId(usize),
}

impl Persist for BlockDevice {
    type State = BlockState;
    type ConstructorArgs = BlockConstructorArgs;
    type Error = BlockPersistError;

    fn save(&self) -> BlockState {
        BlockState { capacity_sectors: self.disk.capacity, disk_id: self.disk.id.to_vec() }
    }

    fn restore(args: BlockConstructorArgs, state: &BlockState) -> Result<BlockDevice, BlockPersistError> {
        if state.disk_id.len() > DISK_ID_LEN {
            return Err(BlockPersistError::DiskId(state.disk_id.len()));
        }
        let mut disk = Disk::open(&args.path, args.file).map_err(BlockPersistError::Open)?;
        if disk.capacity != state.capacity_sectors {
            return Err(BlockPersistError::CapacityChanged {
                path: args.path,
                saved: state.capacity_sectors,
                now: disk.capacity,
            });
        }
        disk.id = [0; DISK_ID_LEN];
        for (slot, byte) in disk.id.iter_mut().zip(&state.disk_id) {
            *slot = *byte;
        }
        Ok(BlockDevice::from_disk(disk))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::block::BlockConfig;
    use std::io::Write;

    fn image(sectors: usize) -> tempfile::NamedTempFile {
        let mut file = tempfile::NamedTempFile::new().expect("temp file");
        file.write_all(&vec![7u8; sectors * 512]).expect("write");
        file
    }

    #[test]
    fn save_restore_round_trip() {
        let file = image(8);
        let device = BlockDevice::new(BlockConfig { path: file.path().into(), file: None, id: Some("root".into()) })
            .expect("device");
        let state = device.save();
        assert_eq!(state.capacity_sectors, 8);
        assert_eq!(&state.disk_id[..4], b"root");
        let restored = BlockDevice::restore(BlockConstructorArgs::at(file.path()), &state).expect("restore");
        assert_eq!(restored.save(), state);
        assert_eq!(restored.disk_id(), device.disk_id());
        let json = serde_json::to_string(&state).expect("serialize");
        assert_eq!(serde_json::from_str::<BlockState>(&json).expect("deserialize"), state);
    }

    #[test]
    fn restore_refuses_a_resized_disk_or_a_long_id() {
        let file = image(8);
        let state = BlockState { capacity_sectors: 9, disk_id: b"x".to_vec() };
        let args = BlockConstructorArgs::at(file.path());
        assert!(matches!(
            BlockDevice::restore(BlockConstructorArgs::at(file.path()), &state),
            Err(BlockPersistError::CapacityChanged { saved: 9, now: 8, .. })
        ));
        let state = BlockState { capacity_sectors: 8, disk_id: vec![b'a'; 21] };
        assert!(matches!(BlockDevice::restore(args, &state), Err(BlockPersistError::DiskId(21))));
        let missing = BlockConstructorArgs::at("/nonexistent/strata-disk");
        assert!(matches!(
            BlockDevice::restore(missing, &BlockState { capacity_sectors: 8, disk_id: Vec::new() }),
            Err(BlockPersistError::Open(_))
        ));
    }
}
