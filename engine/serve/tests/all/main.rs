//! Integration tests of `strata serve`: a real server on 127.0.0.1:0, driven with reqwest and tokio-tungstenite.

mod api;
mod cache;
mod console;
mod e2b;
mod e2b_files;
mod e2b_secrets;
mod fleet;
mod images;
mod interpreter;
mod lifecycle;
mod limits;
mod load;
mod ports;
mod pty;
mod util;
mod ws;
