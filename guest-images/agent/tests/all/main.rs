//! The agent and its protocol end to end over a Unix socket: the serve loop in a thread of this process (most
//! tests), or the real `strata-agent` binary (`binary`).

mod binary;
mod egress;
mod exec;
mod files;
mod hostile;
mod protocol;

use std::os::unix::net::UnixStream;
use std::thread::JoinHandle;

use strata_agent::{Agent, AgentConfig, ServeEnd, ServeError};
use strata_guest_proto::{AgentClient, ClientConfig, ExecRequest, ExitReport, OutputStream};

/// An agent serving one connection from a thread, and the client on the other end.
#[allow(missing_debug_implementations)]
pub struct InThread {
    client: Option<AgentClient>,
    agent: Option<JoinHandle<Result<ServeEnd, ServeError>>>,
}

impl InThread {
    pub fn client(&self) -> &AgentClient {
        self.client.as_ref().expect("client")
    }

    /// Closes the client and returns how the agent's serve loop ended.
    pub fn finish(mut self) -> Result<ServeEnd, ServeError> {
        drop(self.client.take());
        self.agent.take().expect("agent").join().expect("agent thread")
    }

    /// Powers off through the client and returns how the agent's serve loop ended.
    pub fn power_off(mut self) -> Result<ServeEnd, ServeError> {
        self.client.take().expect("client").power_off().expect("power off");
        self.agent.take().expect("agent").join().expect("agent thread")
    }
}

impl Drop for InThread {
    fn drop(&mut self) {
        drop(self.client.take());
        if let Some(agent) = self.agent.take() {
            let _ = agent.join();
        }
    }
}

/// The serve loop on one end of a socket pair, in a thread; returns its socket's other end.
pub fn agent_thread() -> (UnixStream, JoinHandle<Result<ServeEnd, ServeError>>) {
    let (host, guest) = UnixStream::pair().expect("socketpair");
    let agent = Agent::new(AgentConfig::host()).expect("agent");
    (host, std::thread::spawn(move || agent.serve(guest)))
}

pub fn start() -> InThread {
    let (host, agent) = agent_thread();
    let client = AgentClient::connect(host, ClientConfig::default()).expect("connect");
    InThread { client: Some(client), agent: Some(agent) }
}

pub fn argv(args: &[&str]) -> ExecRequest {
    ExecRequest {
        argv: args.iter().map(|s| s.to_string()).collect(),
        env: vec![("PATH".into(), "/usr/local/bin:/usr/bin:/bin".into())],
        cwd: "/".into(),
        ..ExecRequest::default()
    }
}

pub fn sh(script: &str) -> ExecRequest {
    argv(&["sh", "-c", script])
}

/// Output of a finished exec.
#[derive(Debug)]
pub struct Ran {
    pub report: ExitReport,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

pub fn run(client: &AgentClient, request: &ExecRequest, stdin: &[u8]) -> Ran {
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    let report = client
        .exec(request, stdin, |stream, data| match stream {
            OutputStream::Stdout => stdout.extend_from_slice(data),
            OutputStream::Stderr => stderr.extend_from_slice(data),
        })
        .expect("exec");
    Ran { report, stdout, stderr }
}

/// Random bytes (xorshift; no dependency needed).
pub fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 24) as u8
        })
        .collect()
}
