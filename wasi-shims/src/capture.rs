//! The wasm tier's stdout/stderr: a core [`OutputCapture`] behind WASI's output-stream traits.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use strata_core::capture::OutputCapture;
use tokio::io::AsyncWrite;
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamError};

/// The most a guest may write in one `check_write` permit. WASI hosts keep this small because
/// `write_zeroes` allocates that much; 64 KiB matches wasmtime's own streams.
const WRITE_PERMIT: usize = 64 * 1024;

/// A capture as a WASI stdout or stderr (`WasiCtxBuilder::stdout(WasiOutput(capture))`). Clones share the
/// capture, as the WASI stream handles of one stdout must.
#[derive(Clone, Debug)]
pub struct WasiOutput(pub OutputCapture);

impl IsTerminal for WasiOutput {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for WasiOutput {
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }

    fn async_stream(&self) -> Box<dyn AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

#[wasmtime_wasi::async_trait]
impl Pollable for WasiOutput {
    async fn ready(&mut self) {}
}

impl OutputStream for WasiOutput {
    fn write(&mut self, bytes: Bytes) -> Result<(), StreamError> {
        self.0.write(&bytes);
        Ok(())
    }

    fn flush(&mut self) -> Result<(), StreamError> {
        Ok(())
    }

    fn check_write(&mut self) -> Result<usize, StreamError> {
        Ok(WRITE_PERMIT)
    }
}

impl AsyncWrite for WasiOutput {
    fn poll_write(self: Pin<&mut Self>, _cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.0.write(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use strata_core::Stream;

    use super::*;

    #[test]
    fn guest_writes_through_every_wasi_stream_reach_the_one_capture() {
        let capture = OutputCapture::new(Stream::Stdout, 64, Vec::new(), None);
        let output = WasiOutput(capture.clone());
        let mut p2 = output.p2_stream();
        assert_eq!(p2.check_write().expect("permit"), WRITE_PERMIT);
        p2.write(Bytes::from_static(b"p2 ")).expect("write");
        let mut clone = output.clone();
        OutputStream::write(&mut clone, Bytes::from_static(b"clone")).expect("write");
        assert!(!output.is_terminal());
        assert_eq!(capture.finish().bytes, b"p2 clone");
    }
}
