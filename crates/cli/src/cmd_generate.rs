//! `completions SHELL` and `man DIR`: shell completions and man pages generated from
//! the command line's own definition, so they never disagree with `--help`. The man
//! pages add what `--help` has no place for: EXIT STATUS and EXAMPLES (`man_extra`).

use crate::man_extra;
use anyhow::{bail, Context, Result};
use clap::CommandFactory;
use clap_mangen::roff::{roman, Roff};
use clap_mangen::Man;
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
    let mut command = C::command().disable_help_subcommand(true);
    command.build();
    write_pages(&command, "", dir)
        .with_context(|| format!("could not write the man pages into {}", dir.display()))?;
    println!("Man pages written to {}.", dir.display());
    Ok(ExitCode::SUCCESS)
}

/// The page of `command` (whose words after `fewerbytes` are `path`, "" for the top)
/// and those of its subcommands.
fn write_pages(command: &clap::Command, path: &str, dir: &Path) -> Result<()> {
    for sub in command.get_subcommands().filter(|s| !s.is_hide_set()) {
        let sub_path = if path.is_empty() {
            sub.get_name().to_string()
        } else {
            format!("{path} {}", sub.get_name())
        };
        write_pages(sub, &sub_path, dir)?;
    }
    let Some(extra) = man_extra::for_command(path) else {
        // Every page gets both sections: a new command must say how it exits and how
        // it is used, here and not only in the README.
        bail!("no EXIT STATUS and EXAMPLES for `fewerbytes {path}` in man_extra.rs");
    };
    let man = Man::new(command.clone());
    let file = dir.join(man.get_filename());
    let mut out = Vec::new();
    man.render_title(&mut out)?;
    man.render_name_section(&mut out)?;
    man.render_synopsis_section(&mut out)?;
    man.render_description_section(&mut out)?;
    if command.get_arguments().any(|a| !a.is_hide_set()) {
        man.render_options_section(&mut out)?;
    }
    if command.has_subcommands() {
        man.render_subcommands_section(&mut out)?;
    }
    let mut roff = Roff::default();
    roff.control("SH", ["EXIT STATUS"]);
    for (code, meaning) in extra.exit_status {
        roff.control("TP", []);
        roff.text([roman(code.to_string())]);
        roff.text([roman(*meaning)]);
    }
    roff.control("SH", ["EXAMPLES"]);
    for (what, example) in extra.examples {
        roff.text([roman(*what)]);
        roff.control("PP", []);
        roff.control("RS", ["4"]);
        roff.control("nf", []);
        roff.text([roman(*example)]);
        roff.control("fi", []);
        roff.control("RE", []);
        roff.control("PP", []);
    }
    roff.to_writer(&mut out)?;
    man.render_version_section(&mut out)?;
    std::fs::write(&file, out).with_context(|| format!("could not write {}", file.display()))?;
    Ok(())
}
