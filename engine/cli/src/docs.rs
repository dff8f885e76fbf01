//! `strata completions SHELL` and `strata man`: shell completion scripts and manual pages, generated from the
//! same clap definitions that parse the arguments, so they cannot drift from `--help`.

use std::io::Write;
use std::path::PathBuf;

use clap::{Args, CommandFactory};
use clap_complete::Shell;

use crate::Failure;

#[derive(Args)]
pub(crate) struct CompletionsArgs {
    /// The shell: bash, zsh, fish, elvish or powershell.
    #[arg(value_enum)]
    shell: Shell,
}

#[derive(Args)]
pub(crate) struct ManArgs {
    /// Write `strata.1` and one `strata-COMMAND.1` per command into this directory (made if missing), instead of
    /// printing `strata.1`. Then: `man -l DIR/strata.1`, or put DIR in MANPATH's `man1`.
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
}

/// Prints the completion script of `shell` for the command `C`.
pub(crate) fn completions<C: CommandFactory>(args: &CompletionsArgs) -> Result<i32, Failure> {
    let mut command = C::command();
    let mut out = Vec::new();
    clap_complete::generate(args.shell, &mut command, "strata", &mut out);
    std::io::stdout().write_all(&out).map_err(|e| Failure::new("io", format!("cannot write the script: {e}")))?;
    Ok(0)
}

/// Prints `strata.1`, or writes it and a page per command into `--dir`.
pub(crate) fn man<C: CommandFactory>(args: &ManArgs) -> Result<i32, Failure> {
    let command = C::command();
    let Some(dir) = &args.dir else {
        let page = render(command)?;
        std::io::stdout().write_all(&page).map_err(|e| Failure::new("io", format!("cannot write the page: {e}")))?;
        return Ok(0);
    };
    std::fs::create_dir_all(dir).map_err(|e| Failure::new("io", format!("cannot make {}: {e}", dir.display())))?;
    let mut pages = vec![("strata.1".to_owned(), render(command.clone())?)];
    for sub in command.get_subcommands() {
        let name = format!("strata-{}", sub.get_name());
        let page = sub.clone().display_name(name.clone()).bin_name(format!("strata {}", sub.get_name()));
        pages.push((format!("{name}.1"), render(page)?));
    }
    for (file, page) in &pages {
        let path = dir.join(file);
        std::fs::write(&path, page).map_err(|e| Failure::new("io", format!("cannot write {}: {e}", path.display())))?;
    }
    eprintln!(
        "strata: wrote {} manual pages into {} (try: man -l {})",
        pages.len(),
        dir.display(),
        dir.join("strata.1").display()
    );
    Ok(0)
}

fn render(command: clap::Command) -> Result<Vec<u8>, Failure> {
    let mut page = Vec::new();
    clap_mangen::Man::new(command)
        .render(&mut page)
        .map_err(|e| Failure::new("io", format!("cannot render the manual page: {e}")))?;
    Ok(page)
}
