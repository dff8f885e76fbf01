//! The Dockerfile subset Strata builds: `FROM`, `RUN`, `COPY`/`ADD` (local files), `ENV`, `WORKDIR`, `USER`,
//! `ARG`, `CMD`, plus `LABEL` and `EXPOSE` (accepted, without effect on the filesystem) and Strata's own comment
//! directives `# strata: start=COMMAND` and `# strata: ready=COMMAND` (E2B's start and ready commands; both may
//! share one line, `start=… ready=…`).
//!
//! [`parse`] turns the text into [`Instruction`]s with their line numbers; [`expand`] substitutes `$NAME`,
//! `${NAME}`, `${NAME:-default}` and `${NAME:+alternate}` as Docker does in `ENV`, `WORKDIR`, `USER`, `COPY` and
//! `ARG` (never in `RUN`, whose shell sees the variables in its environment). What the subset does not cover is
//! refused with the line it is on — a second `FROM` (multi-stage builds), `COPY --from`, `ADD` of a URL or of a
//! local archive (Docker would unpack it; `COPY` it and `RUN tar`), `ENTRYPOINT`, `SHELL`, `VOLUME`,
//! `HEALTHCHECK`, `ONBUILD`, `STOPSIGNAL` — never silently built differently. The text is bounded
//! ([`MAX_DOCKERFILE`], [`MAX_INSTRUCTIONS`]) before it is parsed.

use std::collections::BTreeMap;

/// The largest Dockerfile parsed.
pub const MAX_DOCKERFILE: usize = 1 << 20;
/// The most instructions a Dockerfile may hold.
pub const MAX_INSTRUCTIONS: usize = 1000;
/// The longest a value may grow by substitution.
const MAX_EXPANDED: usize = 64 * 1024;

/// Why a Dockerfile is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DockerfileError {
    /// Bigger than [`MAX_DOCKERFILE`] or more than [`MAX_INSTRUCTIONS`] instructions.
    #[error("the Dockerfile is too large: {0}")]
    TooLarge(String),
    /// A line that is not valid.
    #[error("Dockerfile line {line}: {message}")]
    Syntax {
        /// 1-based line of the instruction's start.
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// Valid Docker, outside the subset.
    #[error("Dockerfile line {line}: {what} is not supported by Strata's builder{hint}")]
    Unsupported {
        /// 1-based line.
        line: usize,
        /// The instruction or flag.
        what: String,
        /// How to do it otherwise (empty or starting with "; ").
        hint: String,
    },
}

/// A command as `RUN` and `CMD` take it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommandForm {
    /// `RUN apt-get update`: run by `/bin/sh -c`.
    Shell(String),
    /// `RUN ["make", "all"]`: run as it is.
    Exec(Vec<String>),
}

impl CommandForm {
    /// The argv it runs.
    pub fn argv(&self) -> Vec<String> {
        match self {
            CommandForm::Shell(line) => vec!["/bin/sh".into(), "-c".into(), line.clone()],
            CommandForm::Exec(argv) => argv.clone(),
        }
    }
}

/// One instruction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Instruction {
    /// `RUN`.
    Run(CommandForm),
    /// `COPY` or `ADD` of local files from the build context.
    Copy {
        /// Paths relative to the context (unexpanded).
        sources: Vec<String>,
        /// Where they go (unexpanded; relative to the working directory).
        dest: String,
        /// `--chown=USER[:GROUP]` (unexpanded).
        chown: Option<String>,
        /// `--chmod=OCTAL`.
        chmod: Option<u32>,
    },
    /// `ENV` (unexpanded values).
    Env(Vec<(String, String)>),
    /// `WORKDIR` (unexpanded).
    Workdir(String),
    /// `USER` (unexpanded).
    User(String),
    /// `ARG NAME[=DEFAULT]`.
    Arg {
        /// The name.
        name: String,
        /// Its default (unexpanded).
        default: Option<String>,
    },
    /// `CMD`.
    Cmd(CommandForm),
    /// `LABEL`, `EXPOSE`: recorded by Docker as metadata; nothing here.
    Metadata(String),
}

/// A parsed Dockerfile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dockerfile {
    /// `ARG`s before `FROM` (usable in `FROM` only).
    pub pre_from_args: Vec<(String, Option<String>)>,
    /// `FROM`'s image (unexpanded).
    pub from: String,
    /// The instructions after `FROM`, each with its 1-based line.
    pub instructions: Vec<(usize, Instruction)>,
    /// `# strata: start=`.
    pub start: Option<String>,
    /// `# strata: ready=`.
    pub ready: Option<String>,
}

/// Parses a Dockerfile.
pub fn parse(text: &str) -> Result<Dockerfile, DockerfileError> {
    if text.len() > MAX_DOCKERFILE {
        return Err(DockerfileError::TooLarge(format!("{} bytes (at most {MAX_DOCKERFILE})", text.len())));
    }
    let (mut start, mut ready) = (None, None);
    let mut logical: Vec<(usize, String)> = Vec::new();
    let mut pending: Option<(usize, String)> = None;
    for (index, raw) in text.lines().enumerate() {
        let line = index + 1;
        let trimmed = raw.trim_start();
        if let Some(comment) = trimmed.strip_prefix('#') {
            if let Some(directive) = comment.trim_start().strip_prefix("strata:") {
                strata_directive(line, directive.trim(), &mut start, &mut ready)?;
            }
            continue;
        }
        if pending.is_none() && trimmed.trim().is_empty() {
            continue;
        }
        let (continued, body) = match raw.trim_end().strip_suffix('\\') {
            Some(body) => (true, body),
            None => (false, raw),
        };
        let entry = pending.get_or_insert_with(|| (line, String::new()));
        entry.1.push_str(body);
        if continued {
            entry.1.push(' ');
        } else if let Some(done) = pending.take() {
            logical.push(done);
        }
        if logical.len() > MAX_INSTRUCTIONS {
            return Err(DockerfileError::TooLarge(format!("more than {MAX_INSTRUCTIONS} instructions")));
        }
    }
    if let Some(done) = pending.take().filter(|(_, text)| !text.trim().is_empty()) {
        logical.push(done);
    }

    let mut pre_from_args = Vec::new();
    let mut from = None;
    let mut instructions = Vec::new();
    for (line, text) in logical {
        let text = text.trim();
        let (keyword, rest) = text.split_once(char::is_whitespace).unwrap_or((text, ""));
        let keyword = keyword.to_ascii_uppercase();
        let rest = rest.trim();
        let syntax = |message: &str| DockerfileError::Syntax { line, message: message.to_owned() };
        let unsupported = |what: &str, hint: &str| DockerfileError::Unsupported {
            line,
            what: what.to_owned(),
            hint: if hint.is_empty() { String::new() } else { format!("; {hint}") },
        };
        if from.is_none() && keyword != "FROM" && keyword != "ARG" {
            return Err(syntax(&format!("{keyword} before FROM")));
        }
        let instruction = match keyword.as_str() {
            "FROM" => {
                if from.is_some() {
                    return Err(unsupported("a second FROM (multi-stage builds)", "build each stage as an image"));
                }
                let words = split_words(rest).map_err(|m| syntax(&m))?;
                let image = match words.as_slice() {
                    [image] => image.clone(),
                    [image, as_, _] if as_.eq_ignore_ascii_case("as") => image.clone(),
                    [flag, ..] if flag.starts_with("--") => return Err(unsupported(flag, "")),
                    _ => return Err(syntax("FROM takes an image (and `AS name`)")),
                };
                from = Some(image);
                continue;
            }
            "ARG" => {
                let words = split_words(rest).map_err(|m| syntax(&m))?;
                let [word] = words.as_slice() else {
                    return Err(syntax("ARG takes one NAME[=DEFAULT]"));
                };
                let (name, default) = match word.split_once('=') {
                    Some((name, default)) => (name.to_owned(), Some(default.to_owned())),
                    None => (word.clone(), None),
                };
                check_name(&name).map_err(|m| syntax(&m))?;
                if from.is_none() {
                    pre_from_args.push((name, default));
                    continue;
                }
                Instruction::Arg { name, default }
            }
            "RUN" => {
                if rest.starts_with("--") {
                    return Err(unsupported("RUN flags (--mount, --network, --security)", ""));
                }
                Instruction::Run(command_form(rest).map_err(|m| syntax(&m))?)
            }
            "CMD" => Instruction::Cmd(command_form(rest).map_err(|m| syntax(&m))?),
            "COPY" | "ADD" => copy(&keyword, rest).map_err(|err| match err {
                CopyError::Syntax(m) => syntax(&m),
                CopyError::Unsupported(what, hint) => unsupported(&what, hint),
            })?,
            "ENV" => Instruction::Env(env_pairs(rest).map_err(|m| syntax(&m))?),
            "WORKDIR" if !rest.is_empty() => Instruction::Workdir(rest.to_owned()),
            "USER" if !rest.is_empty() => Instruction::User(rest.to_owned()),
            "WORKDIR" | "USER" => return Err(syntax(&format!("{keyword} needs a value"))),
            "LABEL" | "EXPOSE" | "MAINTAINER" => Instruction::Metadata(keyword.clone()),
            "ENTRYPOINT" => return Err(unsupported("ENTRYPOINT", "use CMD, or `# strata: start=` for a service")),
            "SHELL" | "VOLUME" | "HEALTHCHECK" | "ONBUILD" | "STOPSIGNAL" => return Err(unsupported(&keyword, "")),
            other => return Err(syntax(&format!("unknown instruction {other:?}"))),
        };
        instructions.push((line, instruction));
    }
    let from = from.ok_or(DockerfileError::Syntax { line: 1, message: "no FROM".into() })?;
    Ok(Dockerfile { pre_from_args, from, instructions, start, ready })
}

fn strata_directive(
    line: usize,
    directive: &str,
    start: &mut Option<String>,
    ready: &mut Option<String>,
) -> Result<(), DockerfileError> {
    let syntax = |message: String| DockerfileError::Syntax { line, message };
    let (start_part, ready_part) = match directive.find(" ready=") {
        Some(at) if directive.starts_with("start=") => (Some(&directive[..at]), Some(&directive[at + 1..])),
        _ if directive.starts_with("start=") => (Some(directive), None),
        _ if directive.starts_with("ready=") => (None, Some(directive)),
        _ => return Err(syntax(format!("unknown strata directive {directive:?} (start= or ready=)"))),
    };
    for (part, key, slot) in [(start_part, "start=", &mut *start), (ready_part, "ready=", &mut *ready)] {
        let Some(part) = part else { continue };
        let command = part.trim().strip_prefix(key).unwrap_or_default().trim();
        if command.is_empty() {
            return Err(syntax(format!("{key} needs a command")));
        }
        if slot.is_some() {
            return Err(syntax(format!("a second {key}")));
        }
        *slot = Some(command.to_owned());
    }
    Ok(())
}

enum CopyError {
    Syntax(String),
    Unsupported(String, &'static str),
}

fn copy(keyword: &str, rest: &str) -> Result<Instruction, CopyError> {
    let mut words = if rest.starts_with('[') {
        json_array(rest).map_err(CopyError::Syntax)?
    } else {
        split_words(rest).map_err(CopyError::Syntax)?
    };
    let (mut chown, mut chmod) = (None, None);
    while words.first().is_some_and(|w| w.starts_with("--")) {
        let flag = words.remove(0);
        let (name, value) = flag.split_once('=').unwrap_or((flag.as_str(), ""));
        match name {
            "--chown" if !value.is_empty() => chown = Some(value.to_owned()),
            "--chmod" => {
                let mode = u32::from_str_radix(value, 8)
                    .ok()
                    .filter(|m| *m <= 0o7777)
                    .ok_or_else(|| CopyError::Syntax(format!("--chmod={value:?} is not an octal mode")))?;
                chmod = Some(mode);
            }
            "--from" => return Err(CopyError::Unsupported("COPY --from (multi-stage builds)".into(), "")),
            other => return Err(CopyError::Unsupported(format!("{keyword} {other}"), "")),
        }
    }
    if words.len() < 2 {
        return Err(CopyError::Syntax(format!("{keyword} takes sources and a destination")));
    }
    let dest = words.pop().unwrap_or_default();
    if keyword == "ADD" {
        for source in &words {
            if source.contains("://") || source.starts_with("git@") {
                return Err(CopyError::Unsupported(
                    format!("ADD of a URL ({source})"),
                    "fetch it in a RUN with --allow-net for its host",
                ));
            }
            let archive = [".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst"];
            if archive.iter().any(|ext| source.to_ascii_lowercase().ends_with(ext)) {
                return Err(CopyError::Unsupported(
                    format!("ADD of a local archive ({source}), which Docker unpacks"),
                    "COPY it and unpack it in a RUN",
                ));
            }
        }
    }
    Ok(Instruction::Copy { sources: words, dest, chown, chmod })
}

fn command_form(rest: &str) -> Result<CommandForm, String> {
    if rest.is_empty() {
        return Err("a command is needed".into());
    }
    if rest.starts_with('[')
        && let Ok(argv) = json_array(rest)
    {
        if argv.is_empty() {
            return Err("an empty command".into());
        }
        return Ok(CommandForm::Exec(argv));
    }
    Ok(CommandForm::Shell(rest.to_owned()))
}

fn json_array(text: &str) -> Result<Vec<String>, String> {
    serde_json::from_str::<Vec<String>>(text).map_err(|e| format!("not a JSON array of strings: {e}"))
}

fn check_name(name: &str) -> Result<(), String> {
    let ok = name.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if ok { Ok(()) } else { Err(format!("{name:?} is not a variable name")) }
}

/// `ENV a=1 b="two words"` or the old `ENV a one value`.
fn env_pairs(rest: &str) -> Result<Vec<(String, String)>, String> {
    let words = split_words(rest)?;
    let Some(first) = words.first() else {
        return Err("ENV needs NAME=VALUE".into());
    };
    if !first.contains('=') {
        check_name(first)?;
        let value = rest[first.len()..].trim();
        return Ok(vec![(first.clone(), unquote(value)?)]);
    }
    let mut pairs = Vec::new();
    for word in words {
        let (name, value) = word.split_once('=').ok_or_else(|| format!("{word:?} is not NAME=VALUE"))?;
        check_name(name)?;
        pairs.push((name.to_owned(), value.to_owned()));
    }
    Ok(pairs)
}

fn unquote(text: &str) -> Result<String, String> {
    Ok(split_words(text)?.join(" "))
}

/// Splits on unquoted whitespace; quotes group and are removed; a backslash escapes the next character
/// (outside single quotes). `$` stays as it is (substitution is [`expand`]'s).
pub fn split_words(text: &str) -> Result<Vec<String>, String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut chars = text.chars();
    let mut quote: Option<char> = None;
    while let Some(c) = chars.next() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some('"') | None, '\\') => match chars.next() {
                Some(next) => {
                    word.push(next);
                    in_word = true;
                }
                None => return Err("a trailing backslash".into()),
            },
            (Some(_), c) => word.push(c),
            (None, '"' | '\'') => {
                quote = Some(c);
                in_word = true;
            }
            (None, c) if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            (None, c) => {
                word.push(c);
                in_word = true;
            }
        }
    }
    if quote.is_some() {
        return Err("an unterminated quote".into());
    }
    if in_word {
        words.push(word);
    }
    Ok(words)
}

/// Substitutes `$NAME`, `${NAME}`, `${NAME:-default}` and `${NAME:+alternate}` from `vars` (unset names are
/// empty); `\$` is a literal `$`.
pub fn expand(text: &str, vars: &BTreeMap<String, String>) -> Result<String, String> {
    let mut out = String::new();
    let mut chars = text.char_indices().peekable();
    while let Some((_, c)) = chars.next() {
        if out.len() > MAX_EXPANDED {
            return Err(format!("a value longer than {MAX_EXPANDED} bytes after substitution"));
        }
        match c {
            '\\' if chars.peek().is_some_and(|(_, n)| *n == '$') => {
                out.push('$');
                chars.next();
            }
            '$' => match chars.peek().map(|(_, n)| *n) {
                Some('{') => {
                    chars.next();
                    let mut inner = String::new();
                    loop {
                        match chars.next() {
                            Some((_, '}')) => break,
                            Some((_, c)) => inner.push(c),
                            None => return Err(format!("an unterminated ${{ in {text:?}")),
                        }
                    }
                    let (name, op) = match inner.find(":-").or_else(|| inner.find(":+")) {
                        Some(at) => (&inner[..at], Some((&inner[at..at + 2], &inner[at + 2..]))),
                        None => (inner.as_str(), None),
                    };
                    check_name(name)?;
                    let value = vars.get(name).filter(|v| !v.is_empty());
                    match (op, value) {
                        (None, value) => out.push_str(value.map(String::as_str).unwrap_or_default()),
                        (Some((":-", default)), None) => out.push_str(&expand(default, vars)?),
                        (Some((":-", _)), Some(value)) => out.push_str(value),
                        (Some((_, alternate)), Some(_)) => out.push_str(&expand(alternate, vars)?),
                        (Some(_), None) => {}
                    }
                }
                Some(n) if n.is_ascii_alphabetic() || n == '_' => {
                    let mut name = String::new();
                    while let Some((_, n)) =
                        chars.peek().copied().filter(|(_, n)| n.is_ascii_alphanumeric() || *n == '_')
                    {
                        name.push(n);
                        chars.next();
                    }
                    out.push_str(vars.get(&name).map(String::as_str).unwrap_or_default());
                }
                _ => out.push('$'),
            },
            c => out.push(c),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_subset_parses_with_continuations_comments_and_both_forms() {
        let text = "# syntax ignored\nARG BASE=strata-debian\nFROM ${BASE} AS build\n# strata: start=python3 -m http.server 8000 ready=curl -sf localhost:8000\n\
                    ENV A=1 B=\"two words\"\nENV OLD old style value\nRUN apt-get update && \\\n    # a comment inside\n    apt-get install -y x\n\
                    RUN [\"echo\", \"hi\"]\nCOPY --chown=user:user --chmod=755 a.sh b/ /opt/\nWORKDIR /opt\nUSER user\nARG V=2\nCMD python3 app.py\nEXPOSE 8000\n";
        let file = parse(text).expect("parses");
        assert_eq!(file.from, "${BASE}");
        assert_eq!(file.pre_from_args, vec![("BASE".into(), Some("strata-debian".into()))]);
        assert_eq!(file.start.as_deref(), Some("python3 -m http.server 8000"));
        assert_eq!(file.ready.as_deref(), Some("curl -sf localhost:8000"));
        let kinds: Vec<&Instruction> = file.instructions.iter().map(|(_, i)| i).collect();
        assert_eq!(kinds[0], &Instruction::Env(vec![("A".into(), "1".into()), ("B".into(), "two words".into())]));
        assert_eq!(kinds[1], &Instruction::Env(vec![("OLD".into(), "old style value".into())]));
        assert_eq!(
            kinds[2],
            &Instruction::Run(CommandForm::Shell("apt-get update &&      apt-get install -y x".into()))
        );
        assert_eq!(file.instructions[2].0, 7);
        assert_eq!(kinds[3], &Instruction::Run(CommandForm::Exec(vec!["echo".into(), "hi".into()])));
        assert_eq!(
            kinds[4],
            &Instruction::Copy {
                sources: vec!["a.sh".into(), "b/".into()],
                dest: "/opt/".into(),
                chown: Some("user:user".into()),
                chmod: Some(0o755)
            }
        );
        assert_eq!(kinds.len(), 10);
    }

    #[test]
    fn what_the_subset_lacks_is_refused_with_its_line() {
        for (text, line) in [
            ("FROM a\nFROM b\n", 2),
            ("FROM a\nCOPY --from=x a b\n", 2),
            ("FROM a\nADD https://x/y.tgz /\n", 2),
            ("FROM a\nADD local.tar.gz /\n", 2),
            ("FROM a\n\nENTRYPOINT [\"x\"]\n", 3),
            ("FROM a\nRUN --mount=type=cache x\n", 2),
        ] {
            match parse(text) {
                Err(DockerfileError::Unsupported { line: got, .. }) => assert_eq!(got, line, "{text}"),
                other => panic!("{text}: {other:?}"),
            }
        }
        for text in ["RUN x\n", "FROM a\nFOO x\n", "FROM a\nENV\n", "FROM a\nCOPY x\n", "", "FROM a\nENV A=\"x\n"] {
            assert!(matches!(parse(text), Err(DockerfileError::Syntax { .. })), "{text}");
        }
        assert!(matches!(parse(&"#".repeat(MAX_DOCKERFILE + 1)), Err(DockerfileError::TooLarge(_))));
    }

    #[test]
    fn substitution_follows_docker() {
        let vars: BTreeMap<String, String> =
            [("A".into(), "1".into()), ("E".into(), String::new())].into_iter().collect();
        assert_eq!(
            expand("$A-${A}-${B:-d$A}-${A:+alt}-${E:-empty}-\\$A-$", &vars).expect("x"),
            "1-1-d1-alt-empty-$A-$"
        );
        assert!(expand("${A", &vars).is_err());
        assert!(expand("${1x}", &vars).is_err());
    }
}
