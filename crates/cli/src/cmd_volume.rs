//! `volume create|list|resize|clone|delete|import|export`: the VM disks of a pool.
//!
//! Everything but import and export works on a served pool too, through the control
//! socket; import and export move whole images and belong to NBD while a server runs.

use anyhow::{bail, Result};
use clap::Subcommand;
use fewerbytes_engine::VolumeInfo;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::control::{inspect_pool, with_pool, Answer, Request};
use crate::output::{print_json, Align, Table};
use crate::size::{format_size, parse_size_arg};
use crate::transfer;

/// `fewerbytes volume …`
#[derive(Subcommand)]
pub enum VolumeCommand {
    /// Create a volume; refused past what the pool can address unless it overcommits.
    Create {
        /// Name (also its NBD export name).
        name: String,
        /// Size (512, 4K, 64M, 10G, 1T; binary units).
        #[arg(long, value_parser = parse_size_arg, value_name = "S")]
        size: u64,
    },
    /// Every volume: size, logical used, zeros, stored bytes only it holds, users.
    List {
        /// Print the list as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Grow a volume (or shrink it with --shrink, discarding its tail).
    Resize {
        /// Name.
        name: String,
        /// New size.
        #[arg(long, value_parser = parse_size_arg, value_name = "S")]
        size: u64,
        /// Allow a smaller size; the data past it is lost.
        #[arg(long)]
        shrink: bool,
    },
    /// Clone a volume instantly: the copy shares every block by reference.
    Clone {
        /// The volume to copy.
        src: String,
        /// The new volume's name.
        dst: String,
    },
    /// Delete a volume, freeing every block only it held.
    Delete {
        /// Name.
        name: String,
        /// Delete even while NBD clients have it open.
        #[arg(long)]
        force: bool,
    },
    /// Write a raw image into a volume (created, sized to the file, if missing).
    Import {
        /// Volume name.
        name: String,
        /// Raw image file (or block device).
        file: PathBuf,
    },
    /// Write a volume out as a raw image (sparse where the volume has holes).
    Export {
        /// Volume name.
        name: String,
        /// Raw image file or block device to write (a file is replaced if it
        /// exists); `-`, a pipe or a terminal gets every byte in order.
        file: PathBuf,
    },
}

/// Run a `volume` subcommand.
pub fn run(command: VolumeCommand, pool_path: &Path) -> Result<ExitCode> {
    match command {
        VolumeCommand::Create { name, size } => {
            let volume = expect_volume(
                pool_path,
                &Request::CreateVolume {
                    name,
                    size_bytes: size,
                },
            )?;
            println!(
                "Volume '{}' created: {}.",
                volume.name,
                format_size(volume.size_bytes)
            );
        }
        VolumeCommand::List { json } => {
            let volumes = inspect_pool(pool_path, |pool| {
                match pool.call(&Request::ListVolumes)? {
                    Answer::Volumes(volumes) => Ok(volumes),
                    other => bail!("unexpected answer to volume list: {other:?}"),
                }
            })?;
            if json {
                print_json(&volumes)?;
            } else {
                volume_table(&volumes).print();
            }
        }
        VolumeCommand::Resize { name, size, shrink } => {
            let volume = expect_volume(
                pool_path,
                &Request::ResizeVolume {
                    name,
                    size_bytes: size,
                    allow_shrink: shrink,
                },
            )?;
            println!(
                "Volume '{}' resized to {}.",
                volume.name,
                format_size(volume.size_bytes)
            );
        }
        VolumeCommand::Clone { src, dst } => {
            let volume = expect_volume(
                pool_path,
                &Request::CloneVolume {
                    src: src.clone(),
                    dst,
                },
            )?;
            println!(
                "Volume '{}' cloned from '{src}': {}, sharing every block.",
                volume.name,
                format_size(volume.size_bytes)
            );
        }
        VolumeCommand::Delete { name, force } => {
            with_pool(pool_path, |pool| {
                pool.call(&Request::DeleteVolume {
                    name: name.clone(),
                    force,
                })
            })?;
            println!("Volume '{name}' deleted.");
        }
        VolumeCommand::Import { name, file } => transfer::import(pool_path, &name, &file)?,
        VolumeCommand::Export { name, file } => transfer::export(pool_path, &name, &file)?,
    }
    Ok(ExitCode::SUCCESS)
}

fn expect_volume(pool_path: &Path, request: &Request) -> Result<VolumeInfo> {
    with_pool(pool_path, |pool| match pool.call(request)? {
        Answer::Volume(volume) => Ok(volume),
        other => bail!("unexpected answer to {request:?}: {other:?}"),
    })
}

/// The `volume list` table.
pub fn volume_table(volumes: &[VolumeInfo]) -> Table {
    let mut table = Table::new(&[
        ("Name", Align::Left),
        ("Size", Align::Right),
        ("Logical used", Align::Right),
        ("Zero", Align::Right),
        ("Exclusive stored", Align::Right),
        ("Users", Align::Right),
    ]);
    for volume in volumes {
        table.row(vec![
            volume.name.clone(),
            format_size(volume.size_bytes),
            format_size(volume.logical_used_bytes),
            format_size(volume.zero_bytes),
            format_size(volume.exclusive_stored_bytes),
            volume.users.to_string(),
        ]);
    }
    table
}
