//! `volume create|list|info|resize|clone|rename|delete|import|export`: the VM disks of a pool.
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
        #[command(flatten)]
        format: ListFormat,
    },
    /// One volume: size, logical used, zeros, stored bytes only it holds, users.
    Info {
        /// Name.
        name: String,
        #[command(flatten)]
        format: ListFormat,
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
    /// Give a volume another name (and so another NBD export name).
    ///
    /// No data moves: the catalog names the volume anew, durably on return (a crash
    /// leaves one name or the other). A volume a client has open is refused.
    Rename {
        /// The current name.
        name: String,
        /// The new name.
        new_name: String,
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
    ///
    /// qcow2, VMDK, VHD, VHDX and VDI files are refused, naming the qemu-img command
    /// that converts them.
    Import {
        /// Volume name.
        name: String,
        /// Raw image file (or block device).
        file: PathBuf,
        /// Overwrite a volume that already holds data.
        #[arg(long)]
        force: bool,
    },
    /// Write a volume out as a raw image (sparse where the volume has holes).
    Export {
        /// Volume name.
        name: String,
        /// Raw image file or block device to write (a file that holds bytes only with
        /// --force); `-`, a pipe or a terminal gets every byte in order.
        file: PathBuf,
        /// Replace a file that already holds bytes.
        #[arg(long)]
        force: bool,
    },
}

/// How `volume list` and `volume info` print.
#[derive(clap::Args)]
pub struct ListFormat {
    /// Print JSON (`list`: an array; `info`: one object), sizes in bytes.
    #[arg(long, conflicts_with_all = ["bytes", "no_header"])]
    json: bool,
    /// Sizes as exact byte counts rather than binary units.
    #[arg(long)]
    bytes: bool,
    /// Leave out the header line (for scripts reading the columns).
    #[arg(long)]
    no_header: bool,
}

impl ListFormat {
    fn print(&self, volumes: &[VolumeInfo]) -> Result<()> {
        let table = volume_table(volumes, self.bytes);
        if self.no_header {
            table.print_rows();
        } else {
            table.print();
        }
        Ok(())
    }
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
        VolumeCommand::List { format } => {
            let volumes = list_volumes(pool_path)?;
            if format.json {
                print_json(&volumes)?;
            } else {
                format.print(&volumes)?;
            }
        }
        VolumeCommand::Info { name, format } => {
            let Some(volume) = list_volumes(pool_path)?
                .into_iter()
                .find(|v| v.name == name)
            else {
                bail!("no volume named '{name}' in this pool");
            };
            if format.json {
                print_json(&volume)?;
            } else {
                format.print(std::slice::from_ref(&volume))?;
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
        VolumeCommand::Rename { name, new_name } => {
            let volume = expect_volume(
                pool_path,
                &Request::RenameVolume {
                    name: name.clone(),
                    new_name,
                },
            )?;
            println!("Volume '{name}' renamed to '{}'.", volume.name);
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
        VolumeCommand::Import { name, file, force } => {
            transfer::import(pool_path, &name, &file, force)?
        }
        VolumeCommand::Export { name, file, force } => {
            transfer::export(pool_path, &name, &file, force)?
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn list_volumes(pool_path: &Path) -> Result<Vec<VolumeInfo>> {
    inspect_pool(pool_path, |pool| {
        match pool.call(&Request::ListVolumes)? {
            Answer::Volumes(volumes) => Ok(volumes),
            other => bail!("unexpected answer to volume list: {other:?}"),
        }
    })
}

fn expect_volume(pool_path: &Path, request: &Request) -> Result<VolumeInfo> {
    with_pool(pool_path, |pool| match pool.call(request)? {
        Answer::Volume(volume) => Ok(volume),
        other => bail!("unexpected answer to {request:?}: {other:?}"),
    })
}

/// The `volume list` table; sizes in bytes when `bytes`, else in binary units.
fn volume_table(volumes: &[VolumeInfo], bytes: bool) -> Table {
    let size = |n: u64| if bytes { n.to_string() } else { format_size(n) };
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
            size(volume.size_bytes),
            size(volume.logical_used_bytes),
            size(volume.zero_bytes),
            size(volume.exclusive_stored_bytes),
            volume.users.to_string(),
        ]);
    }
    table
}
