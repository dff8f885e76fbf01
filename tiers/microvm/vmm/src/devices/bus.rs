//! The port-I/O and MMIO buses: address ranges mapped to devices, looked up on every vCPU exit.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// A device on a bus. `offset` is relative to the start of the range the device was inserted at; `data` is the
/// access (1, 2, 4 or 8 bytes, as the guest made it). Both come from the guest: a device must treat any offset and
/// length as possible and never panic on them.
pub trait BusDevice: Send {
    /// A guest read; fill `data`.
    fn read(&mut self, offset: u64, data: &mut [u8]);
    /// A guest write.
    fn write(&mut self, offset: u64, data: &[u8]);
}

/// Why a device could not be inserted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BusError {
    /// The range is empty or wraps around.
    #[error("invalid bus range {base:#x}+{len:#x}")]
    InvalidRange {
        /// Start.
        base: u64,
        /// Length.
        len: u64,
    },
    /// The range overlaps a device already on the bus.
    #[error("bus range {base:#x}+{len:#x} overlaps another device")]
    Overlap {
        /// Start.
        base: u64,
        /// Length.
        len: u64,
    },
}

/// A shared device, as the bus holds it.
pub type SharedDevice = Arc<Mutex<dyn BusDevice>>;

/// Address ranges → devices.
#[derive(Clone, Default)]
pub struct Bus {
    devices: BTreeMap<u64, (u64, SharedDevice)>,
}

impl std::fmt::Debug for Bus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ranges: Vec<(u64, u64)> = self.devices.iter().map(|(base, (len, _))| (*base, *len)).collect();
        f.debug_struct("Bus").field("ranges", &ranges).finish()
    }
}

impl Bus {
    /// An empty bus.
    pub fn new() -> Bus {
        Bus::default()
    }

    /// Maps `device` at `base..base + len`.
    pub fn insert(&mut self, device: SharedDevice, base: u64, len: u64) -> Result<(), BusError> {
        let end = base.checked_add(len).filter(|_| len > 0).ok_or(BusError::InvalidRange { base, len })?;
        let before = self.devices.range(..end).next_back();
        if before.is_some_and(|(b, (l, _))| b + l > base) {
            return Err(BusError::Overlap { base, len });
        }
        self.devices.insert(base, (len, device));
        Ok(())
    }

    /// The device covering `addr` and the offset into it.
    pub fn resolve(&self, addr: u64) -> Option<(SharedDevice, u64)> {
        let (base, (len, device)) = self.devices.range(..=addr).next_back()?;
        let offset = addr - base;
        (offset < *len).then(|| (device.clone(), offset))
    }

    /// Dispatches a read; returns false (and leaves `data` as it was, all ones for the guest) when nothing is
    /// mapped there.
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.resolve(addr) {
            Some((device, offset)) => {
                device.lock().unwrap_or_else(|p| p.into_inner()).read(offset, data);
                true
            }
            None => {
                data.fill(0xff);
                false
            }
        }
    }

    /// Dispatches a write; returns false when nothing is mapped there.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.resolve(addr) {
            Some((device, offset)) => {
                device.lock().unwrap_or_else(|p| p.into_inner()).write(offset, data);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Echo(Vec<u8>);
    impl BusDevice for Echo {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data.fill(offset as u8);
        }
        fn write(&mut self, _offset: u64, data: &[u8]) {
            self.0.extend_from_slice(data);
        }
    }

    #[test]
    fn ranges_resolve_and_never_overlap() {
        let mut bus = Bus::new();
        bus.insert(Arc::new(Mutex::new(Echo(Vec::new()))), 0x100, 0x10).expect("insert");
        assert_eq!(
            bus.insert(Arc::new(Mutex::new(Echo(Vec::new()))), 0x108, 0x10),
            Err(BusError::Overlap { base: 0x108, len: 0x10 })
        );
        assert_eq!(
            bus.insert(Arc::new(Mutex::new(Echo(Vec::new()))), 0xf8, 0x10),
            Err(BusError::Overlap { base: 0xf8, len: 0x10 })
        );
        assert!(bus.insert(Arc::new(Mutex::new(Echo(Vec::new()))), u64::MAX, 2).is_err());
        let mut data = [0u8; 2];
        assert!(bus.read(0x105, &mut data));
        assert_eq!(data, [5, 5]);
        assert!(!bus.read(0x110, &mut data));
        assert_eq!(data, [0xff, 0xff]);
    }
}
