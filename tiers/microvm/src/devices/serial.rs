//! The serial console: an 8250 UART (vm-superio) at COM1, whose output goes to a bounded log.
//!
//! The guest's console is for diagnostics (kernel messages, a panic); job output travels over vsock. The log keeps
//! the last [`DEFAULT_LOG_CAPACITY`] bytes and counts what it dropped, so a guest printing forever costs the host a
//! fixed amount of memory. Input is not wired: the receive FIFO stays empty.

use std::collections::VecDeque;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard};

use vm_superio::serial::NoEvents;
use vm_superio::{Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

use crate::devices::bus::BusDevice;

/// COM1's first port.
pub const SERIAL_PORT_BASE: u64 = 0x3f8;
/// COM1's eight registers.
pub const SERIAL_PORT_LEN: u64 = 8;
/// COM1's ISA interrupt (GSI 4 on the in-kernel irqchip).
pub const SERIAL_GSI: u32 = 4;
/// How much console output the log keeps by default.
pub const DEFAULT_LOG_CAPACITY: usize = 64 * 1024;

/// Why the serial device could not be created.
#[derive(Debug, thiserror::Error)]
pub enum SerialError {
    /// The interrupt eventfd could not be created.
    #[error("cannot create the serial interrupt eventfd")]
    EventFd(#[source] io::Error),
}

#[derive(Debug)]
struct LogInner {
    bytes: VecDeque<u8>,
    capacity: usize,
    dropped: u64,
}

/// A handle on the console log: the newest bytes the guest wrote, up to a capacity. Clones share the log.
#[derive(Debug, Clone)]
pub struct SerialLog {
    inner: Arc<Mutex<LogInner>>,
}

impl SerialLog {
    /// An empty log keeping at most `capacity` bytes.
    pub fn new(capacity: usize) -> SerialLog {
        let inner = LogInner { bytes: VecDeque::with_capacity(capacity.min(4096)), capacity, dropped: 0 };
        SerialLog { inner: Arc::new(Mutex::new(inner)) }
    }

    fn lock(&self) -> MutexGuard<'_, LogInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The bytes kept, oldest first.
    pub fn contents(&self) -> Vec<u8> {
        self.lock().bytes.iter().copied().collect()
    }

    /// How many bytes were dropped from the front to respect the capacity.
    pub fn dropped(&self) -> u64 {
        self.lock().dropped
    }

    /// Appends `data`, dropping the oldest bytes beyond the capacity.
    pub fn append(&self, data: &[u8]) {
        let mut log = self.lock();
        let capacity = log.capacity;
        let keep = &data[data.len().saturating_sub(capacity)..];
        let skipped = (data.len() - keep.len()) as u64;
        let overflow = (log.bytes.len() + keep.len()).saturating_sub(capacity);
        log.bytes.drain(..overflow);
        log.bytes.extend(keep);
        log.dropped += skipped + overflow as u64;
    }
}

/// The serial device's output sink.
#[derive(Debug)]
struct LogWriter(SerialLog);

impl io::Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.append(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// An eventfd as the UART's interrupt line.
#[derive(Debug)]
pub struct EventFdTrigger(EventFd);

impl Trigger for EventFdTrigger {
    type E = io::Error;

    fn trigger(&self) -> io::Result<()> {
        self.0.write(1)
    }
}

/// The 8250 UART on the port bus.
pub struct SerialDevice {
    serial: Serial<EventFdTrigger, NoEvents, LogWriter>,
    log: SerialLog,
}

impl std::fmt::Debug for SerialDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SerialDevice").field("log", &self.log).finish_non_exhaustive()
    }
}

impl SerialDevice {
    /// A UART logging into a new log of `capacity` bytes, interrupting through a fresh eventfd.
    pub fn new(capacity: usize) -> Result<SerialDevice, SerialError> {
        let event = EventFd::new(libc::EFD_NONBLOCK).map_err(SerialError::EventFd)?;
        let log = SerialLog::new(capacity);
        let serial = Serial::new(EventFdTrigger(event), LogWriter(log.clone()));
        Ok(SerialDevice { serial, log })
    }

    /// The console log.
    pub fn log(&self) -> SerialLog {
        self.log.clone()
    }

    /// The interrupt eventfd: register it as an irqfd on [`SERIAL_GSI`].
    pub fn interrupt_evt(&self) -> &EventFd {
        &self.serial.interrupt_evt().0
    }
}

impl BusDevice for SerialDevice {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        match (u8::try_from(offset), data) {
            (Ok(offset), [byte]) if u64::from(offset) < SERIAL_PORT_LEN => *byte = self.serial.read(offset),
            (_, data) => data.fill(0),
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if let (Ok(offset), [byte]) = (u8::try_from(offset), data)
            && u64::from(offset) < SERIAL_PORT_LEN
            && let Err(e) = self.serial.write(offset, *byte)
        {
            log::warn!("serial: cannot deliver a byte or an interrupt: {e:?}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_keeps_the_newest_bytes_and_counts_the_rest() {
        let log = SerialLog::new(8);
        log.append(b"hello ");
        log.append(b"world");
        assert_eq!(log.contents(), b"lo world");
        assert_eq!(log.dropped(), 3);
        log.append(b"0123456789");
        assert_eq!(log.contents(), b"23456789");
        assert_eq!(log.dropped(), 3 + 8 + 2);
    }

    #[test]
    fn bytes_written_to_thr_reach_the_log() {
        let mut serial = SerialDevice::new(DEFAULT_LOG_CAPACITY).expect("serial");
        for b in b"hi\n" {
            serial.write(0, &[*b]);
        }
        assert_eq!(serial.log().contents(), b"hi\n");
        let mut lsr = [0u8];
        serial.read(5, &mut lsr);
        assert_ne!(lsr[0] & 0x20, 0, "transmit holding register empty");
    }

    #[test]
    fn odd_offsets_and_widths_are_ignored() {
        let mut serial = SerialDevice::new(16).expect("serial");
        serial.write(0, b"ab");
        serial.write(9, b"a");
        serial.write(u64::MAX, b"a");
        let mut wide = [0xffu8; 4];
        serial.read(0, &mut wide);
        assert_eq!(wide, [0; 4]);
        serial.read(u64::MAX, &mut wide[..1]);
        assert!(serial.log().contents().is_empty());
    }

    #[test]
    fn enabling_the_thr_interrupt_signals_the_eventfd() {
        let mut serial = SerialDevice::new(16).expect("serial");
        serial.write(1, &[0x02]); // IER: transmitter holding register empty interrupt
        serial.write(0, b"x");
        assert!(serial.interrupt_evt().read().expect("interrupt") >= 1);
    }
}
