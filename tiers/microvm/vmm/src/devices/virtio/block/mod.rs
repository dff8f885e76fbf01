//! virtio-blk over a read-only host file (the guest's root image).

mod device;
pub mod persist;

pub use device::{BLOCK_QUEUE_SIZE, BlockConfig, BlockDevice, BlockError, DISK_ID_LEN, SECTOR_SIZE, SEG_MAX, SIZE_MAX};
