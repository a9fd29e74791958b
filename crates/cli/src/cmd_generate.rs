//! `completions SHELL` and `man DIR`: shell completions and man pages generated from
//! the command line's own definition, so they never disagree with `--help`.

use anyhow::{Context, Result};
use clap::CommandFactory;
use std::path::Path;
use std::process::ExitCode;

/// Print the completion script for `shell` on stdout.
pub fn completions<C: CommandFactory>(shell: clap_complete::Shell) -> Result<ExitCode> {
    let mut command = C::command();
    clap_complete::generate(shell, &mut command, "fewerbytes", &mut std::io::stdout());
    Ok(ExitCode::SUCCESS)
}

/// Write `fewerbytes.1` and a page per subcommand (`fewerbytes-volume-create.1`, ...)
/// into `dir`, creating it.
pub fn man_pages<C: CommandFactory>(dir: &Path) -> Result<ExitCode> {
    std::fs::create_dir_all(dir).with_context(|| format!("could not create {}", dir.display()))?;
    clap_mangen::generate_to(C::command(), dir)
        .with_context(|| format!("could not write the man pages into {}", dir.display()))?;
    println!("Man pages written to {}.", dir.display());
    Ok(ExitCode::SUCCESS)
}
