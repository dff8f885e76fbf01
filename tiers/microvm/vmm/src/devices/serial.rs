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
    /// A saved state holds more received bytes than the UART's FIFO.
    #[error("serial state holds {len} received bytes, the FIFO holds {max}")]
    FifoOverflow {
        /// Bytes in the saved FIFO.
        len: usize,
        /// The FIFO's capacity.
        max: usize,
    },
    /// The restored UART could not raise its pending interrupt.
    #[error("cannot raise the restored serial interrupt")]
    Restore(#[source] vm_superio::serial::Error<io::Error>),
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

/// The UART's registers and receive FIFO, as a snapshot saves them ([`SerialDevice::save_state`]).
#[allow(missing_docs)]
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SerialDeviceState {
    pub baud_divisor_low: u8,
    pub baud_divisor_high: u8,
    pub interrupt_enable: u8,
    pub interrupt_identification: u8,
    pub line_control: u8,
    pub line_status: u8,
    pub modem_control: u8,
    pub modem_status: u8,
    pub scratch: u8,
    /// Received bytes the guest has not read (at most [`SERIAL_FIFO_SIZE`]).
    pub in_buffer: Vec<u8>,
}

/// The UART's receive FIFO size (vm-superio's).
pub const SERIAL_FIFO_SIZE: usize = 64;

impl SerialDevice {
    /// The registers and receive FIFO.
    pub fn save_state(&self) -> SerialDeviceState {
        let s = self.serial.state();
        SerialDeviceState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer,
        }
    }

    /// A UART continuing from `state`, logging into `log`, interrupting through a fresh eventfd (signalled at once
    /// when the state has an enabled interrupt pending).
    pub fn from_state(state: &SerialDeviceState, log: SerialLog) -> Result<SerialDevice, SerialError> {
        if state.in_buffer.len() > SERIAL_FIFO_SIZE {
            return Err(SerialError::FifoOverflow { len: state.in_buffer.len(), max: SERIAL_FIFO_SIZE });
        }
        let registers = vm_superio::serial::SerialState {
            baud_divisor_low: state.baud_divisor_low,
            baud_divisor_high: state.baud_divisor_high,
            interrupt_enable: state.interrupt_enable,
            interrupt_identification: state.interrupt_identification,
            line_control: state.line_control,
            line_status: state.line_status,
            modem_control: state.modem_control,
            modem_status: state.modem_status,
            scratch: state.scratch,
            in_buffer: state.in_buffer.clone(),
        };
        let event = EventFd::new(libc::EFD_NONBLOCK).map_err(SerialError::EventFd)?;
        let serial = Serial::from_state(&registers, EventFdTrigger(event), NoEvents, LogWriter(log.clone()))
            .map_err(SerialError::Restore)?;
        Ok(SerialDevice { serial, log })
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
    fn state_round_trips_and_an_overfull_fifo_is_refused() {
        let mut serial = SerialDevice::new(16).expect("serial");
        serial.write(7, &[0x5a]); // scratch
        serial.write(3, &[0x83]); // LCR with DLAB
        serial.write(0, &[0x0c]); // divisor low
        let state = serial.save_state();
        assert_eq!((state.scratch, state.line_control, state.baud_divisor_low), (0x5a, 0x83, 0x0c));
        let restored = SerialDevice::from_state(&state, SerialLog::new(16)).expect("restore");
        assert_eq!(restored.save_state(), state);
        let json = serde_json::to_string(&state).expect("serialize");
        assert_eq!(serde_json::from_str::<SerialDeviceState>(&json).expect("deserialize"), state);
        let full = SerialDeviceState { in_buffer: vec![0; SERIAL_FIFO_SIZE + 1], ..state };
        assert!(matches!(
            SerialDevice::from_state(&full, SerialLog::new(16)),
            Err(SerialError::FifoOverflow { len: 65, max: 64 })
        ));
    }

    #[test]
    fn enabling_the_thr_interrupt_signals_the_eventfd() {
        let mut serial = SerialDevice::new(16).expect("serial");
        serial.write(1, &[0x02]); // IER: transmitter holding register empty interrupt
        serial.write(0, b"x");
        assert!(serial.interrupt_evt().read().expect("interrupt") >= 1);
    }
}
