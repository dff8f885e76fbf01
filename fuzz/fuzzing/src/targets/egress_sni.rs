//! The egress proxy's TLS ClientHello reader (`engine/egress/src/sni.rs`): the first bytes of a `CONNECT` tunnel,
//! whose server name must equal the `CONNECT` host.
//!
//! Oracles: [`parse_client_hello`] never panics; a server name it returns is a host name in normal form (what
//! [`Host::parse`] makes of it, never an IP address); a complete ClientHello's verdict does not change when more
//! bytes follow it (they belong to later records), and cutting its last byte off makes it incomplete or an error,
//! never a different name.

use strata_egress::Host;
use strata_egress::sni::{ClientHelloParse, parse_client_hello};

/// Parses `data` as a tunnel's first bytes.
pub fn run(data: &[u8]) {
    let verdict = parse_client_hello(data);
    let Ok(ClientHelloParse::Complete(name)) = &verdict else { return };
    if let Some(name) = name {
        assert_eq!(Host::parse(name), Ok(Host::Name(name.clone())), "server name {name:?} is not in normal form");
    }
    let mut longer = data.to_vec();
    longer.extend_from_slice(&[0x17, 0x03, 0x03, 0x00, 0x01, 0x00]);
    assert_eq!(parse_client_hello(&longer), verdict, "bytes after a complete ClientHello changed the verdict");
    if let Some((_, shorter)) = data.split_last() {
        match parse_client_hello(shorter) {
            Ok(ClientHelloParse::Complete(other)) => {
                // Only possible when the cut byte came after the ClientHello.
                assert_eq!(&other, name, "one byte less named another server");
            }
            Ok(ClientHelloParse::Incomplete) | Err(_) => {}
        }
    }
}
