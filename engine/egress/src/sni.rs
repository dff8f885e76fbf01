//! A bounds-checked reader of the server name (SNI) in a TLS ClientHello.
//!
//! Input is whatever a guest sent after `CONNECT`; every length is checked against what remains, nothing is
//! indexed unchecked, and anything that is not a well-formed ClientHello is an error. The ClientHello may span
//! several handshake records (reassembled, up to [`MAX_CLIENT_HELLO`] bytes).

/// The largest ClientHello the proxy reassembles.
pub const MAX_CLIENT_HELLO: usize = 64 * 1024;

/// The TLS record type of a handshake record; a tunnel whose first byte is this is treated as TLS.
pub const HANDSHAKE_RECORD: u8 = 0x16;

/// What the bytes seen so far say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientHelloParse {
    /// More bytes are needed to read the whole ClientHello.
    Incomplete,
    /// A complete ClientHello; its `host_name` server name if it has one (ASCII, lowercase, no trailing dot).
    Complete(Option<String>),
}

/// Why the bytes are not an acceptable ClientHello.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClientHelloError {
    /// Structurally broken: a length overruns, a field is out of range, a record is not a handshake record.
    #[error("malformed TLS ClientHello: {0}")]
    Malformed(&'static str),
    /// The ClientHello is larger than [`MAX_CLIENT_HELLO`].
    #[error("TLS ClientHello larger than {MAX_CLIENT_HELLO} bytes")]
    TooLarge,
    /// The server name is not a valid DNS name.
    #[error("TLS server name is not a valid host name")]
    BadServerName,
}

/// A cursor that only hands out bytes it has.
struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Reader { buf }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], ClientHelloError> {
        if n > self.buf.len() {
            return Err(ClientHelloError::Malformed("length overruns its container"));
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, ClientHelloError> {
        Ok(self.take(1)?.first().copied().unwrap_or_default())
    }

    fn u16(&mut self) -> Result<u16, ClientHelloError> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    fn vec8(&mut self) -> Result<&'a [u8], ClientHelloError> {
        let n = self.u8()?;
        self.take(usize::from(n))
    }

    fn vec16(&mut self) -> Result<&'a [u8], ClientHelloError> {
        let n = self.u16()?;
        self.take(usize::from(n))
    }

    fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
}

/// Reads the handshake bytes out of the TLS records at the start of `data`. Returns `None` when more bytes are
/// needed before `want` handshake bytes (or, while unknown, the 4-byte handshake header) are available.
fn handshake_bytes(data: &[u8]) -> Result<Option<Vec<u8>>, ClientHelloError> {
    let mut hs = Vec::new();
    let mut rest = data;
    loop {
        // Enough already?
        if hs.len() >= 4 {
            let len = u32::from_be_bytes([0, hs[1], hs[2], hs[3]]) as usize;
            if len + 4 > MAX_CLIENT_HELLO {
                return Err(ClientHelloError::TooLarge);
            }
            if hs.len() >= len + 4 {
                hs.truncate(len + 4);
                return Ok(Some(hs));
            }
        }
        if rest.len() < 5 {
            return Ok(None);
        }
        let (header, body) = rest.split_at(5);
        if header[0] != HANDSHAKE_RECORD {
            return Err(ClientHelloError::Malformed("record is not a handshake record"));
        }
        if header[1] != 3 {
            return Err(ClientHelloError::Malformed("record version is not TLS"));
        }
        let len = usize::from(u16::from_be_bytes([header[3], header[4]]));
        if len == 0 || len > (1 << 14) {
            return Err(ClientHelloError::Malformed("record length out of range"));
        }
        if body.len() < len {
            return Ok(None);
        }
        let (fragment, tail) = body.split_at(len);
        if hs.len() + fragment.len() > MAX_CLIENT_HELLO + 4 {
            return Err(ClientHelloError::TooLarge);
        }
        hs.extend_from_slice(fragment);
        rest = tail;
    }
}

/// Parses the start of a TLS stream: `Incomplete` until a whole ClientHello is present, then its server name.
pub fn parse_client_hello(data: &[u8]) -> Result<ClientHelloParse, ClientHelloError> {
    let Some(hs) = handshake_bytes(data)? else {
        return Ok(ClientHelloParse::Incomplete);
    };
    let mut r = Reader::new(&hs);
    if r.u8()? != 1 {
        return Err(ClientHelloError::Malformed("first handshake message is not a ClientHello"));
    }
    r.take(3)?; // length, already applied
    let version = r.u16()?;
    if version >> 8 != 3 {
        return Err(ClientHelloError::Malformed("ClientHello version is not TLS"));
    }
    r.take(32)?; // random
    let session_id = r.vec8()?;
    if session_id.len() > 32 {
        return Err(ClientHelloError::Malformed("session id longer than 32 bytes"));
    }
    let suites = r.vec16()?;
    if suites.is_empty() || suites.len() % 2 != 0 {
        return Err(ClientHelloError::Malformed("cipher suite list empty or odd"));
    }
    if r.vec8()?.is_empty() {
        return Err(ClientHelloError::Malformed("compression method list empty"));
    }
    if r.is_empty() {
        return Ok(ClientHelloParse::Complete(None)); // no extensions at all
    }
    let mut exts = Reader::new(r.vec16()?);
    if !r.is_empty() {
        return Err(ClientHelloError::Malformed("bytes after the extensions"));
    }
    let mut name = None;
    let mut seen_sni = false;
    while !exts.is_empty() {
        let kind = exts.u16()?;
        let body = exts.vec16()?;
        if kind != 0 {
            continue;
        }
        if seen_sni {
            return Err(ClientHelloError::Malformed("two server_name extensions"));
        }
        seen_sni = true;
        name = server_name(body)?;
    }
    Ok(ClientHelloParse::Complete(name))
}

/// The `host_name` entry of a server_name extension body (RFC 6066 §3); at most one is allowed.
fn server_name(body: &[u8]) -> Result<Option<String>, ClientHelloError> {
    let mut outer = Reader::new(body);
    let mut list = Reader::new(outer.vec16()?);
    if !outer.is_empty() {
        return Err(ClientHelloError::Malformed("bytes after the server name list"));
    }
    let mut host = None;
    while !list.is_empty() {
        let kind = list.u8()?;
        let value = list.vec16()?;
        if kind != 0 {
            continue;
        }
        if host.is_some() {
            return Err(ClientHelloError::Malformed("two host_name entries"));
        }
        let s = std::str::from_utf8(value).map_err(|_| ClientHelloError::BadServerName)?;
        // RFC 6066: literal IP addresses are not permitted in host_name.
        if s.parse::<std::net::IpAddr>().is_ok() {
            return Err(ClientHelloError::BadServerName);
        }
        host = Some(crate::allow::normalise_name(s).map_err(|_| ClientHelloError::BadServerName)?);
    }
    Ok(host)
}

/// Builders of ClientHello bytes, for tests and benches.
pub mod testing {
    /// A minimal, well-formed TLS 1.2-style ClientHello record carrying `sni` (none when `None`).
    pub fn client_hello(sni: Option<&str>) -> Vec<u8> {
        let mut exts = Vec::new();
        if let Some(name) = sni {
            let name = name.as_bytes();
            let mut entry = vec![0u8];
            entry.extend_from_slice(&(name.len() as u16).to_be_bytes());
            entry.extend_from_slice(name);
            let mut list = (entry.len() as u16).to_be_bytes().to_vec();
            list.extend_from_slice(&entry);
            exts.extend_from_slice(&0u16.to_be_bytes());
            exts.extend_from_slice(&(list.len() as u16).to_be_bytes());
            exts.extend_from_slice(&list);
        }
        // supported_versions, to look like a real client.
        exts.extend_from_slice(&[0x00, 0x2b, 0x00, 0x03, 0x02, 0x03, 0x04]);
        let mut body = vec![0x03, 0x03];
        body.extend_from_slice(&[0x42; 32]);
        body.push(0); // session id
        body.extend_from_slice(&[0x00, 0x02, 0x13, 0x01]); // one cipher suite
        body.extend_from_slice(&[0x01, 0x00]); // null compression
        body.extend_from_slice(&(exts.len() as u16).to_be_bytes());
        body.extend_from_slice(&exts);
        let mut hs = vec![0x01];
        hs.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
        hs.extend_from_slice(&body);
        let mut rec = vec![0x16, 0x03, 0x01];
        rec.extend_from_slice(&(hs.len() as u16).to_be_bytes());
        rec.extend_from_slice(&hs);
        rec
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::testing::client_hello;
    use super::*;

    #[test]
    fn reads_the_server_name() {
        let hello = client_hello(Some("Example.COM."));
        assert_eq!(parse_client_hello(&hello), Ok(ClientHelloParse::Complete(Some("example.com".into()))));
        assert_eq!(parse_client_hello(&client_hello(None)), Ok(ClientHelloParse::Complete(None)));
    }

    #[test]
    fn every_prefix_is_incomplete_or_an_error_never_a_panic() {
        let hello = client_hello(Some("example.com"));
        for n in 0..hello.len() {
            match parse_client_hello(&hello[..n]) {
                Ok(ClientHelloParse::Incomplete) | Err(_) => {}
                other => panic!("prefix {n}: {other:?}"),
            }
        }
    }

    #[test]
    fn fragmented_across_records_is_reassembled() {
        let hello = client_hello(Some("a.example.com"));
        let hs = &hello[5..];
        let (a, b) = hs.split_at(10);
        let mut two = Vec::new();
        for part in [a, b] {
            two.extend_from_slice(&[0x16, 0x03, 0x01]);
            two.extend_from_slice(&(part.len() as u16).to_be_bytes());
            two.extend_from_slice(part);
        }
        assert_eq!(parse_client_hello(&two), Ok(ClientHelloParse::Complete(Some("a.example.com".into()))));
    }

    #[test]
    fn corrupted_lengths_are_errors() {
        let hello = client_hello(Some("example.com"));
        // Flip every byte to each of a few hostile values; nothing may panic.
        for i in 0..hello.len() {
            for v in [0x00, 0x01, 0x7f, 0x80, 0xff] {
                let mut h = hello.clone();
                h[i] = v;
                let _ = parse_client_hello(&h);
            }
        }
        // A handshake length claiming more than the cap.
        let mut big = hello.clone();
        big[6] = 0xff;
        assert!(matches!(parse_client_hello(&big), Err(ClientHelloError::TooLarge) | Ok(ClientHelloParse::Incomplete)));
        // A record that is not a handshake.
        let mut not_hs = hello.clone();
        not_hs[0] = 0x17;
        assert!(parse_client_hello(&not_hs).is_err());
        // Zero-length record.
        assert!(parse_client_hello(&[0x16, 0x03, 0x01, 0x00, 0x00]).is_err());
    }

    #[test]
    fn ip_and_non_ascii_server_names_are_refused() {
        assert_eq!(parse_client_hello(&client_hello(Some("10.0.0.1"))), Err(ClientHelloError::BadServerName));
        assert_eq!(parse_client_hello(&client_hello(Some("bücher.de"))), Err(ClientHelloError::BadServerName));
        assert_eq!(parse_client_hello(&client_hello(Some("a@b.com"))), Err(ClientHelloError::BadServerName));
    }
}
