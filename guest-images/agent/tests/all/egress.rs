//! `StartEgress`: the forwarder starts once per connection with sane settings, tunnels to `<prefix>_<port>`, and
//! stops listening when the connection ends.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};

use strata_agent::egress::EgressDial;
use strata_agent::{Agent, AgentConfig};
use strata_guest_proto::{AgentClient, ClientConfig, ClientError};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

#[test]
fn start_egress_refuses_bad_settings_and_a_second_start_then_stops_with_the_connection() {
    let dir = tempfile::tempdir().expect("tempdir");
    let prefix = dir.path().join("agent.sock");
    let host_side = UnixListener::bind(dir.path().join("agent.sock_1028")).expect("bind");
    let (host, guest) = UnixStream::pair().expect("socketpair");
    let agent = Agent::new(AgentConfig::host()).expect("agent").with_egress_dial(EgressDial::Unix(prefix));
    let serve = std::thread::spawn(move || agent.serve(guest));
    let client = AgentClient::connect(host, ClientConfig::default()).expect("connect");

    let port = free_port();
    for (listen, max) in [(0, 4), (port, 0), (port, strata_guest_proto::MAX_EGRESS_CONNECTIONS + 1)] {
        let err = client.start_egress(listen, 1028, max).expect_err("bad setting");
        assert!(matches!(err, ClientError::Refused { .. }), "{err}");
    }
    client.start_egress(port, 1028, 4).expect("start");
    let err = client.start_egress(free_port(), 1028, 4).expect_err("second start");
    assert!(matches!(err, ClientError::Refused { .. }), "{err}");

    let echo = std::thread::spawn(move || {
        let (mut s, _) = host_side.accept().expect("accept");
        let mut got = Vec::new();
        s.read_to_end(&mut got).expect("read");
        s.write_all(&got).expect("echo");
    });
    let mut c = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    c.write_all(b"ping").expect("write");
    c.shutdown(Shutdown::Write).expect("half close");
    let mut back = Vec::new();
    c.read_to_end(&mut back).expect("read");
    assert_eq!(back, b"ping");
    echo.join().expect("echo");

    drop(client);
    serve.join().expect("agent thread").expect("serve");
    assert!(TcpStream::connect(("127.0.0.1", port)).is_err(), "the forwarder outlived its connection");
}
