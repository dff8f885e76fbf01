//! Makes a module snapshot-ready, once per module: the instance state a snapshot needs becomes reachable from
//! the host, and the memory a fresh instance starts with becomes a memory image a fork can map instead.
//!
//! Wizer snapshots an instance by writing a new module whose data segments are the instance's memory, which
//! wasmtime then compiles: for CPython's 74 MB of code that is a one- to two-minute Cranelift compile per
//! snapshot. Here the rewrite happens once per *module*, and a snapshot is only data:
//!
//! - every defined mutable global is exported as `strata:global:<index>`, so the host can read it for a
//!   snapshot and set it in a fork (as wizer's instrumentation does);
//! - the data segments are taken out of the module and laid out into a memory image of the module's initial
//!   memory. Every instance of the rewritten module, fresh or forked, gets its linear memory from an image
//!   file mapped copy-on-write ([`super::memory_image`]): the base image for a fresh session, the snapshot's memory
//!   file for a fork.
//!
//! Only state that this covers may exist in a module that is made snapshot-ready, and anything else is
//! refused here with the reason: imported memories or mutable globals (state outside the instance), more than
//! one memory, shared or 64-bit memories, mutable globals of reference types, a start function (a fork would
//! run it again), and code that changes tables or uses `memory.init`/`data.drop`/`elem.drop` (table contents
//! and dropped segments are instance state a snapshot does not hold; without such instructions the tables
//! always hold what the element segments put there at instantiation, and passive data segments are dead data,
//! dropped with the rest).

use wasm_encoder::{ExportKind, ExportSection, RawSection};
use wasmparser::{DataKind, Encoding, ExternalKind, Operator, Parser, Payload, TypeRef, ValType};

/// The export name of a defined mutable global in a snapshot-ready module.
pub(crate) const GLOBAL_EXPORT_PREFIX: &str = "strata:global:";

/// A WebAssembly page.
pub(crate) const WASM_PAGE: u64 = 1 << 16;

/// The largest initial memory a snapshot-ready module may declare (its image is built in memory).
const MAX_INITIAL_MEMORY: u64 = 1 << 30;

/// Why a module cannot be made snapshot-ready.
#[derive(Debug, thiserror::Error)]
pub(crate) enum InstrumentError {
    /// The module does not parse.
    #[error("cannot parse it: {0}")]
    Parse(#[from] wasmparser::BinaryReaderError),
    /// The module holds state a snapshot cannot carry.
    #[error("{0}")]
    Unsupported(String),
}

/// A snapshot-ready module and the image of its initial memory.
pub(crate) struct Instrumented {
    /// The rewritten module: globals exported, no data segments.
    pub(crate) module: Vec<u8>,
    /// The module's initial linear memory (its minimum size), data segments applied; empty without memory.
    pub(crate) image: Vec<u8>,
}

fn refuse<T>(reason: impl Into<String>) -> Result<T, InstrumentError> {
    Err(InstrumentError::Unsupported(reason.into()))
}

/// Section ids that come after the export section.
const AFTER_EXPORTS: [u8; 5] = [8, 9, 10, 11, 12];
const DATA_SECTION: u8 = 11;
const DATA_COUNT_SECTION: u8 = 12;

/// Rewrites `bytes` into its snapshot-ready form.
pub(crate) fn instrument(bytes: &[u8]) -> Result<Instrumented, InstrumentError> {
    let mut out = wasm_encoder::Module::new();
    let mut imported_globals = 0u32;
    let mut mutable_globals: Vec<u32> = Vec::new();
    let mut image: Vec<u8> = Vec::new();
    let mut memories = 0usize;
    let mut exports: Option<ExportSection> = Some(ExportSection::new());
    let extra_exports = |section: &mut ExportSection, globals: &[u32]| {
        for index in globals {
            section.export(&format!("{GLOBAL_EXPORT_PREFIX}{index}"), ExportKind::Global, *index);
        }
    };

    for payload in Parser::new(0).parse_all(bytes) {
        let payload = payload?;
        match &payload {
            Payload::Version { encoding, .. } if *encoding != Encoding::Module => {
                return refuse("it is a component, not a core module");
            }
            Payload::ImportSection(reader) => {
                for import in reader.clone().into_imports() {
                    match import?.ty {
                        TypeRef::Global(global) if global.mutable => {
                            return refuse("it imports a mutable global, which is state outside the instance");
                        }
                        TypeRef::Global(_) => imported_globals += 1,
                        TypeRef::Memory(_) => return refuse("it imports its memory"),
                        _ => {}
                    }
                }
            }
            Payload::MemorySection(reader) => {
                for memory in reader.clone() {
                    let memory = memory?;
                    memories += 1;
                    if memories > 1 {
                        return refuse("it has more than one memory");
                    }
                    if memory.memory64 || memory.shared || memory.page_size_log2.is_some() {
                        return refuse("its memory is 64-bit, shared or has a custom page size");
                    }
                    let initial = memory.initial.saturating_mul(WASM_PAGE);
                    if initial > MAX_INITIAL_MEMORY {
                        return refuse(format!("its initial memory ({initial} bytes) is larger than 1 GiB"));
                    }
                    image = vec![0; initial as usize];
                }
            }
            Payload::GlobalSection(reader) => {
                for (i, global) in reader.clone().into_iter().enumerate() {
                    let global = global?;
                    if !global.ty.mutable {
                        continue;
                    }
                    if !matches!(global.ty.content_type, ValType::I32 | ValType::I64 | ValType::F32 | ValType::F64) {
                        return refuse(format!(
                            "its mutable global {i} holds a {}, which a snapshot cannot carry",
                            global.ty.content_type
                        ));
                    }
                    let index = imported_globals
                        .checked_add(
                            u32::try_from(i).map_err(|_| InstrumentError::Unsupported("too many globals".into()))?,
                        )
                        .ok_or_else(|| InstrumentError::Unsupported("too many globals".into()))?;
                    mutable_globals.push(index);
                }
            }
            Payload::ExportSection(reader) => {
                let mut section = ExportSection::new();
                for export in reader.clone() {
                    let export = export?;
                    if export.name.starts_with(GLOBAL_EXPORT_PREFIX) {
                        return refuse(format!("it already exports `{}`", export.name));
                    }
                    let kind = match export.kind {
                        ExternalKind::Func => ExportKind::Func,
                        ExternalKind::Table => ExportKind::Table,
                        ExternalKind::Memory => ExportKind::Memory,
                        ExternalKind::Global => ExportKind::Global,
                        ExternalKind::Tag => ExportKind::Tag,
                        ExternalKind::FuncExact => return refuse("it exports an exact function reference"),
                    };
                    section.export(export.name, kind, export.index);
                }
                extra_exports(&mut section, &mutable_globals);
                out.section(&section);
                exports = None;
                continue;
            }
            Payload::StartSection { .. } => {
                return refuse("it has a start function, which every fork would run again");
            }
            Payload::DataSection(reader) => {
                for data in reader.clone() {
                    let data = data?;
                    let (memory_index, offset_expr) = match data.kind {
                        // No code uses passive segments (`memory.init` was refused above, and the code section
                        // comes before the data section): they are dead data.
                        DataKind::Passive => continue,
                        DataKind::Active { memory_index, offset_expr } => (memory_index, offset_expr),
                    };
                    if memory_index != 0 {
                        return refuse("a data segment names a memory other than the first");
                    }
                    let mut ops = offset_expr.get_operators_reader();
                    let offset = match ops.read()? {
                        Operator::I32Const { value } => u64::from(value as u32),
                        _ => return refuse("a data segment's offset is not a constant"),
                    };
                    let end = offset.saturating_add(data.data.len() as u64);
                    if end > image.len() as u64 {
                        return refuse("a data segment lies beyond the initial memory");
                    }
                    image[offset as usize..end as usize].copy_from_slice(data.data);
                }
            }
            Payload::CodeSectionEntry(body) => {
                let mut ops = body.get_operators_reader()?;
                while !ops.eof() {
                    match ops.read()? {
                        Operator::TableSet { .. }
                        | Operator::TableGrow { .. }
                        | Operator::TableFill { .. }
                        | Operator::TableCopy { .. }
                        | Operator::TableInit { .. }
                        | Operator::ElemDrop { .. } => {
                            return refuse("its code changes tables, which a snapshot does not hold");
                        }
                        Operator::MemoryInit { .. } | Operator::DataDrop { .. } => {
                            return refuse("its code uses memory.init or data.drop");
                        }
                        _ => {}
                    }
                }
                // The section was copied whole at its start.
                continue;
            }
            _ => {}
        }
        let Some((id, range)) = payload.as_section() else {
            continue;
        };
        if AFTER_EXPORTS.contains(&id)
            && let Some(mut section) = exports.take()
        {
            // The module had no export section: ours goes where it would have been.
            extra_exports(&mut section, &mutable_globals);
            out.section(&section);
        }
        if id == DATA_SECTION || id == DATA_COUNT_SECTION {
            continue;
        }
        let data = bytes.get(range).ok_or_else(|| InstrumentError::Unsupported("a section is out of bounds".into()))?;
        out.section(&RawSection { id, data });
    }
    if let Some(mut section) = exports.take() {
        extra_exports(&mut section, &mutable_globals);
        out.section(&section);
    }
    Ok(Instrumented { module: out.finish(), image })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wat(text: &str) -> Vec<u8> {
        wat::parse_str(text).expect("wat")
    }

    #[test]
    fn globals_are_exported_and_data_moves_into_the_image() {
        let module = wat(r#"(module
            (global $g (mut i32) (i32.const 7))
            (global $c i64 (i64.const 1))
            (memory (export "memory") 1)
            (data (i32.const 16) "hello")
            (func (export "_start") (global.set $g (i32.const 8))))"#);
        let done = instrument(&module).expect("instrument");
        assert_eq!(done.image.len(), 65536);
        assert_eq!(&done.image[16..21], b"hello");
        let mut exports = Vec::new();
        let mut has_data = false;
        for payload in Parser::new(0).parse_all(&done.module) {
            match payload.expect("parse") {
                Payload::ExportSection(reader) => {
                    exports = reader.into_iter().map(|e| e.expect("export").name.to_owned()).collect();
                }
                Payload::DataSection(_) => has_data = true,
                _ => {}
            }
        }
        assert_eq!(exports, ["memory", "_start", "strata:global:0"]);
        assert!(!has_data);
        wasmparser::Validator::new().validate_all(&done.module).expect("valid");
    }

    #[test]
    fn a_module_without_exports_gets_an_export_section() {
        let done = instrument(&wat(r#"(module (global (mut i64) (i64.const 0)) (func))"#)).expect("instrument");
        wasmparser::Validator::new().validate_all(&done.module).expect("valid");
        assert!(done.image.is_empty());
    }

    #[test]
    fn state_outside_the_snapshot_is_refused() {
        for (text, reason) in [
            (r#"(module (table 1 funcref) (func (drop (table.grow 0 (ref.null func) (i32.const 1)))))"#, "tables"),
            (r#"(module (func $f) (start $f))"#, "start function"),
            (
                r#"(module (memory 1) (data "x") (func (memory.init 0 (i32.const 0) (i32.const 0) (i32.const 1))))"#,
                "memory.init",
            ),
            (r#"(module (import "a" "b" (global (mut i32))))"#, "mutable global"),
            (r#"(module (global (mut funcref) (ref.null func)))"#, "funcref"),
        ] {
            let err = instrument(&wat(text)).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(err.contains(reason), "{text}: {err}");
        }
    }
}
