//! Host tools: Rust functions an embedder offers guests, called over the tool protocol (JSON frames through
//! the guest's `host.call` import; `from host import tools` in Python).
//!
//! A [`Tool`] has a name, a description, a JSON-schema of its arguments and a handler. Schemas are checked
//! when a tool is built against the subset Strata validates ([`SCHEMA_KEYWORDS`]), so a constraint is never
//! silently ignored; arguments are validated against the schema before the handler runs.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, RwLock};

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The keywords a tool's input schema may use. Anything else is refused when the tool is built.
pub const SCHEMA_KEYWORDS: &[&str] = &[
    "type",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "enum",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "description",
    "title",
    "default",
    "examples",
];

/// How a handler refuses or fails; the guest sees the message, never host details.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolFailure {
    /// The tool ran and failed (`tool_error`; Python raises `host.ToolError`).
    Error(String),
    /// The tool refused to act (`denied`; Python raises `host.ToolDenied`).
    Denied(String),
}

type Handler = dyn Fn(Value) -> Result<Value, ToolFailure> + Send + Sync;

/// A host function offered to guests.
#[derive(Clone)]
pub struct Tool {
    name: String,
    description: String,
    input_schema: Value,
    handler: Arc<Handler>,
}

impl fmt::Debug for Tool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tool").field("name", &self.name).field("input_schema", &self.input_schema).finish()
    }
}

/// A tool definition Strata cannot offer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ToolDefinitionError {
    /// Names are identifiers: `[A-Za-z_][A-Za-z0-9_]*`, at most 64 characters.
    #[error("invalid tool name {0:?}: use letters, digits and _, not starting with a digit, at most 64")]
    Name(String),
    /// The schema uses something Strata does not validate, or its root is not an object schema.
    #[error("tool {tool}: unsupported input schema: {reason}")]
    Schema {
        /// The tool.
        tool: String,
        /// What is wrong.
        reason: String,
    },
    /// Two tools with one name.
    #[error("a tool named {0} is already registered")]
    Duplicate(String),
    /// `Capabilities::tools` names a tool nobody registered.
    #[error("no tool named {0} is registered")]
    Unknown(String),
}

impl Tool {
    /// A tool. `input_schema` must be a JSON schema whose root is `{"type": "object", ...}` using only
    /// [`SCHEMA_KEYWORDS`].
    pub fn new(
        name: &str,
        description: &str,
        input_schema: Value,
        handler: impl Fn(Value) -> Result<Value, ToolFailure> + Send + Sync + 'static,
    ) -> Result<Tool, ToolDefinitionError> {
        let valid_name = !name.is_empty()
            && name.len() <= 64
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            && !name.starts_with(|c: char| c.is_ascii_digit());
        if !valid_name {
            return Err(ToolDefinitionError::Name(name.to_owned()));
        }
        let schema_err = |reason: String| ToolDefinitionError::Schema { tool: name.to_owned(), reason };
        if input_schema.get("type") != Some(&Value::String("object".into())) {
            return Err(schema_err("the root must be {\"type\": \"object\"}".into()));
        }
        check_schema(&input_schema, "").map_err(schema_err)?;
        Ok(Tool {
            name: name.to_owned(),
            description: description.to_owned(),
            input_schema,
            handler: Arc::new(handler),
        })
    }

    /// The tool's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The descriptor guests see in the tool list (MCP field names).
    pub fn descriptor(&self) -> Value {
        serde_json::json!({"name": self.name, "description": self.description, "inputSchema": self.input_schema})
    }

    /// Checks `args` against the input schema; the message names the argument.
    pub fn validate(&self, args: &Value) -> Result<(), String> {
        validate(&self.input_schema, args, "")
    }

    /// Runs the handler (arguments already validated).
    pub fn call(&self, args: Value) -> Result<Value, ToolFailure> {
        (self.handler)(args)
    }
}

fn check_schema(schema: &Value, at: &str) -> Result<(), String> {
    let Value::Object(map) = schema else { return Err(format!("{}: a schema must be an object", where_(at))) };
    for (key, value) in map {
        if !SCHEMA_KEYWORDS.contains(&key.as_str()) {
            return Err(format!("{}: keyword {key:?} is not supported", where_(at)));
        }
        match key.as_str() {
            "type" => {
                let types: Vec<&Value> = match value {
                    Value::Array(items) => items.iter().collect(),
                    other => vec![other],
                };
                for t in types {
                    match t.as_str() {
                        Some("object" | "array" | "string" | "number" | "integer" | "boolean" | "null") => {}
                        _ => return Err(format!("{}: unknown type {t}", where_(at))),
                    }
                }
            }
            "properties" => {
                let Value::Object(props) = value else {
                    return Err(format!("{}: properties must be an object", where_(at)));
                };
                for (name, sub) in props {
                    check_schema(sub, &join(at, name))?;
                }
            }
            "items" => check_schema(value, &format!("{at}[]"))?,
            "additionalProperties" if !value.is_boolean() => {
                return Err(format!("{}: additionalProperties must be true or false", where_(at)));
            }
            "required" if !value.as_array().is_some_and(|a| a.iter().all(Value::is_string)) => {
                return Err(format!("{}: required must be a list of names", where_(at)));
            }
            "enum" if !value.is_array() => return Err(format!("{}: enum must be a list", where_(at))),
            "minimum" | "maximum" if !value.is_number() => {
                return Err(format!("{}: {key} must be a number", where_(at)));
            }
            "minLength" | "maxLength" | "minItems" | "maxItems" if !value.is_u64() => {
                return Err(format!("{}: {key} must be a whole number", where_(at)));
            }
            _ => {}
        }
    }
    Ok(())
}

fn join(at: &str, name: &str) -> String {
    if at.is_empty() { name.to_owned() } else { format!("{at}.{name}") }
}

fn where_(at: &str) -> String {
    if at.is_empty() { "the arguments".to_owned() } else { format!("argument {at}") }
}

fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

fn type_matches(expected: &str, value: &Value) -> bool {
    match expected {
        "number" => value.is_number(),
        "integer" => value.is_i64() || value.is_u64() || value.as_f64().is_some_and(|f| f.fract() == 0.0),
        other => type_name(value) == other,
    }
}

fn validate(schema: &Value, value: &Value, at: &str) -> Result<(), String> {
    let here = || where_(at);
    if let Some(t) = schema.get("type") {
        let types: Vec<&str> = match t {
            Value::Array(items) => items.iter().filter_map(Value::as_str).collect(),
            other => other.as_str().into_iter().collect(),
        };
        if !types.iter().any(|t| type_matches(t, value)) {
            return Err(format!("{}: expected {}, got {}", here(), types.join(" or "), type_name(value)));
        }
    }
    if let Some(Value::Array(options)) = schema.get("enum")
        && !options.contains(value)
    {
        return Err(format!("{}: {value} is not one of {}", here(), Value::Array(options.clone())));
    }
    if let Some(n) = value.as_f64() {
        if let Some(min) = schema.get("minimum").and_then(Value::as_f64)
            && n < min
        {
            return Err(format!("{}: {value} is less than {min}", here()));
        }
        if let Some(max) = schema.get("maximum").and_then(Value::as_f64)
            && n > max
        {
            return Err(format!("{}: {value} is more than {max}", here()));
        }
    }
    if let Value::String(s) = value {
        let len = s.chars().count() as u64;
        if schema.get("minLength").and_then(Value::as_u64).is_some_and(|m| len < m) {
            return Err(format!("{}: shorter than {} characters", here(), schema["minLength"]));
        }
        if schema.get("maxLength").and_then(Value::as_u64).is_some_and(|m| len > m) {
            return Err(format!("{}: longer than {} characters", here(), schema["maxLength"]));
        }
    }
    if let Value::Array(items) = value {
        let len = items.len() as u64;
        if schema.get("minItems").and_then(Value::as_u64).is_some_and(|m| len < m) {
            return Err(format!("{}: fewer than {} items", here(), schema["minItems"]));
        }
        if schema.get("maxItems").and_then(Value::as_u64).is_some_and(|m| len > m) {
            return Err(format!("{}: more than {} items", here(), schema["maxItems"]));
        }
        if let Some(item_schema) = schema.get("items") {
            for (i, item) in items.iter().enumerate() {
                validate(item_schema, item, &format!("{at}[{i}]"))?;
            }
        }
    }
    if let Value::Object(map) = value {
        let props = schema.get("properties").and_then(Value::as_object);
        if let Some(Value::Array(required)) = schema.get("required") {
            for name in required.iter().filter_map(Value::as_str) {
                if !map.contains_key(name) {
                    return Err(format!("{}: missing required argument {name:?}", here()));
                }
            }
        }
        for (name, item) in map {
            match props.and_then(|p| p.get(name)) {
                Some(sub) => validate(sub, item, &join(at, name))?,
                None if schema.get("additionalProperties") == Some(&Value::Bool(false)) => {
                    return Err(format!("{}: unknown argument {name:?}", here()));
                }
                None => {}
            }
        }
    }
    Ok(())
}

/// The tools an engine offers, by name. Cheap to clone; clones share the set.
#[derive(Debug, Clone, Default)]
pub struct ToolRegistry {
    tools: Arc<RwLock<BTreeMap<String, Tool>>>,
}

impl ToolRegistry {
    /// An empty registry.
    pub fn new() -> ToolRegistry {
        ToolRegistry::default()
    }

    /// Adds a tool; names are unique.
    pub fn register(&self, tool: Tool) -> Result<(), ToolDefinitionError> {
        let mut tools = self.tools.write().unwrap_or_else(|p| p.into_inner());
        if tools.contains_key(&tool.name) {
            return Err(ToolDefinitionError::Duplicate(tool.name));
        }
        tools.insert(tool.name.clone(), tool);
        Ok(())
    }

    /// The tools with these names, in the order given.
    pub fn select(&self, names: &[String]) -> Result<Vec<Tool>, ToolDefinitionError> {
        let tools = self.tools.read().unwrap_or_else(|p| p.into_inner());
        names.iter().map(|n| tools.get(n).cloned().ok_or_else(|| ToolDefinitionError::Unknown(n.clone()))).collect()
    }
}

/// One frame of the tool protocol a job exchanged, as the Outcome records it (`"tools": [...]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolCall {
    /// 1 for the job's first frame.
    pub seq: u32,
    /// `list` or `call` (absent when the frame was unreadable).
    pub op: Option<String>,
    /// The tool called.
    pub tool: Option<String>,
    /// `ok`, or the error kind the guest was answered with (`invalid_arguments`, `tool_error`, ...).
    pub outcome: String,
    /// The error message the guest was given.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub message: Option<String>,
    /// Size of the request frame.
    pub request_bytes: u64,
    /// Size of the answer frame.
    pub response_bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn adder() -> Tool {
        let schema = json!({
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer", "minimum": 0}},
            "required": ["a"],
            "additionalProperties": false
        });
        Tool::new("add", "Adds.", schema, |args| Ok(json!(args["a"].as_i64().unwrap_or(0) + 1))).expect("tool")
    }

    #[test]
    fn arguments_are_checked_against_the_schema() {
        let tool = adder();
        assert_eq!(tool.validate(&json!({"a": 1, "b": 2})), Ok(()));
        assert_eq!(tool.validate(&json!({"a": "x"})), Err("argument a: expected integer, got string".into()));
        assert_eq!(tool.validate(&json!({})), Err("the arguments: missing required argument \"a\"".into()));
        assert_eq!(tool.validate(&json!({"a": 1, "c": 1})), Err("the arguments: unknown argument \"c\"".into()));
        assert_eq!(tool.validate(&json!({"a": 1, "b": -1})), Err("argument b: -1 is less than 0".into()));
    }

    #[test]
    fn unsupported_schemas_and_names_are_refused() {
        let handler = |_| Ok(Value::Null);
        assert!(matches!(
            Tool::new("9lives", "", json!({"type": "object"}), handler),
            Err(ToolDefinitionError::Name(_))
        ));
        let err = Tool::new("t", "", json!({"type": "object", "patternProperties": {}}), handler).expect_err("keyword");
        assert!(err.to_string().contains("patternProperties"), "{err}");
        assert!(Tool::new("t", "", json!({"type": "string"}), handler).is_err());
    }

    #[test]
    fn the_registry_selects_by_name() {
        let registry = ToolRegistry::new();
        registry.register(adder()).expect("register");
        assert!(matches!(registry.register(adder()), Err(ToolDefinitionError::Duplicate(_))));
        assert_eq!(registry.select(&["add".into()]).expect("found").len(), 1);
        assert_eq!(
            registry.select(&["nope".into()]).expect_err("unknown"),
            ToolDefinitionError::Unknown("nope".into())
        );
    }
}
