//! A WASI 0.2 command component that uses the network, one behaviour per first argument; every failure is printed
//! as one line `error: KIND: MESSAGE` and exits 1:
//!
//! - `get HOST:PORT`: connects (resolving HOST through wasi:sockets/ip-name-lookup when it is a name), sends
//!   `GET / HTTP/1.1`, prints the whole response;
//! - `upload TARGET N [TARGET N]...`: connects to each TARGET in turn (a failed connect is printed as
//!   `TARGET: error: connect: KIND` and skipped), then sends N bytes on each connection and shuts its sending
//!   side, then reads each reply to the end, last connection first, and prints it as `TARGET: REPLY`;
//! - `send TARGET HEX`: connects, writes the bytes HEX spells in one write, shuts its sending side, prints
//!   `sent N` and then `got M` with the byte count of the reply (a refused write is `error: write: …`);
//! - `lookup NAME`: resolves NAME and prints each address as `addr IP`;
//! - `listen`: binds 127.0.0.1:0 and listens, prints `listening`;
//! - `udp`: binds a UDP socket on 127.0.0.1:0, prints `bound`.
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs, UdpSocket};

fn fail(what: &str, err: std::io::Error) -> ! {
    println!("error: {what}: {:?}: {err}", err.kind());
    std::process::exit(1);
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize| args.get(i).cloned().unwrap_or_default();
    match arg(1).as_str() {
        "get" => {
            let target = arg(2);
            let mut stream = TcpStream::connect(&target).unwrap_or_else(|e| fail("connect", e));
            let host = target.rsplit_once(':').map_or(target.as_str(), |(h, _)| h);
            let request = format!("GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
            stream.write_all(request.as_bytes()).unwrap_or_else(|e| fail("write", e));
            let mut response = String::new();
            stream.read_to_string(&mut response).unwrap_or_else(|e| fail("read", e));
            print!("{response}");
        }
        "upload" => {
            let mut open = Vec::new();
            for pair in args[2..].chunks(2) {
                let target = pair[0].as_str();
                let size = pair.get(1).and_then(|n| n.parse::<usize>().ok()).unwrap_or(0);
                match TcpStream::connect(target) {
                    Ok(stream) => open.push((target, size, stream)),
                    Err(e) => println!("{target}: error: connect: {:?}", e.kind()),
                }
            }
            for (_, size, stream) in &mut open {
                stream.write_all(&vec![b'x'; *size]).unwrap_or_else(|e| fail("write", e));
                stream.shutdown(Shutdown::Write).unwrap_or_else(|e| fail("shutdown", e));
            }
            for (target, _, stream) in open.iter_mut().rev() {
                let mut reply = String::new();
                stream.read_to_string(&mut reply).unwrap_or_else(|e| fail("read", e));
                println!("{target}: {reply}");
            }
        }
        "send" => {
            let hex = arg(3);
            let bytes: Vec<u8> = (0..hex.len() / 2)
                .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap_or_default())
                .collect();
            let mut stream = TcpStream::connect(arg(2)).unwrap_or_else(|e| fail("connect", e));
            stream.write_all(&bytes).unwrap_or_else(|e| fail("write", e));
            println!("sent {}", bytes.len());
            let _ = stream.shutdown(Shutdown::Write);
            let mut reply = Vec::new();
            stream.read_to_end(&mut reply).unwrap_or_else(|e| fail("read", e));
            println!("got {}", reply.len());
        }
        "lookup" => {
            let addrs = (arg(2).as_str(), 0).to_socket_addrs().unwrap_or_else(|e| fail("lookup", e));
            for addr in addrs {
                println!("addr {}", addr.ip());
            }
        }
        "listen" => {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| fail("listen", e));
            println!("listening on {:?}", listener.local_addr());
        }
        "udp" => {
            let socket = UdpSocket::bind("127.0.0.1:0").unwrap_or_else(|e| fail("udp", e));
            println!("bound {:?}", socket.local_addr());
        }
        other => {
            eprintln!("unknown mode {other:?}");
            std::process::exit(2);
        }
    }
}
