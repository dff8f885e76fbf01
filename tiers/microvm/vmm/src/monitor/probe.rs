//! The probe device: a page on the MMIO bus that, when a guest writes to it, makes the vCPU thread handling the
//! write call `socket(AF_INET, SOCK_STREAM, 0)`, which the vCPU filter refuses. It stands for a device bug a guest
//! exploits; the monitor must die of it. Placed only when [`crate::proto::BootSpec::probe`] asks (tests).

use crate::devices::bus::BusDevice;

pub(super) struct ProbeDevice;

impl BusDevice for ProbeDevice {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    fn write(&mut self, _offset: u64, _data: &[u8]) {
        // SAFETY: socket(2) with integer arguments; under the vCPU filter it never returns (SIGSYS). Without a
        // filter (the probe misused in-process) it returns a descriptor, closed at once.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
        if fd >= 0 {
            // SAFETY: `fd` was just returned by socket(2) and is ours alone.
            unsafe { libc::close(fd) };
        }
    }
}
