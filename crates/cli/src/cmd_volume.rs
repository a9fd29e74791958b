//! `volume create|list|info|resize|clone|set|rename|delete|allow|import|export|send|receive`: the VM
//! disks of a pool. Which TLS identities may open a volume lives in the allow file
//! (`access`), which create, clone, rename, delete and allow keep up to date: an
//! entry is written before the volume appears under a name, and removed only after
//! it is gone, so no volume is ever open to all for a moment.
//!
//! Everything but import and export works on a served pool too, through the control
//! socket; import and export move whole images and belong to NBD while a server runs.

use anyhow::{bail, Result};
use clap::Subcommand;
use fewerbytes_engine::{Provisioning, VolumeInfo};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::access;
use crate::cmd_volume_allow::{allow, copy_allowed, forget_allowed, limit};
use crate::control::{inspect_pool, with_pool, Answer, Request};
use crate::output::{print_json, Align, Table};
use crate::size::{format_size, parse_size_arg};
use crate::transfer;
use crate::volume_requests::{expect_volume, list_volumes, volume_exists};

/// `fewerbytes volume snapshot …`
#[derive(Subcommand)]
pub enum SnapshotCommand {
    /// Take a snapshot (the same as `volume snapshot VOLUME NAME`).
    Create {
        /// The volume.
        name: String,
        /// The snapshot's name.
        snapshot: String,
    },
    /// The snapshots of a volume, oldest first.
    List {
        /// The volume.
        name: String,
        #[command(flatten)]
        format: ListFormat,
    },
    /// Delete a snapshot, freeing the blocks only it held.
    Delete {
        /// The volume.
        name: String,
        /// The snapshot's name.
        snapshot: String,
    },
}

/// `fewerbytes volume …`
#[derive(Subcommand)]
pub enum VolumeCommand {
    /// Create a volume. Thick by default: it reserves its whole size, and is refused
    /// when the pool cannot hold that aside; --thin reserves nothing, --reserve some.
    Create {
        /// Name (also its NBD export name).
        name: String,
        /// Size (512, 4K, 64M, 10G, 1T; binary units).
        #[arg(long, value_parser = parse_size_arg, value_name = "S")]
        size: u64,
        #[command(flatten)]
        reserve: ReserveArgs,
        /// Only these TLS identities may open it over NBD (PSK identities or client
        /// certificate CNs, comma-separated); see `volume allow`.
        #[arg(long, value_parser = access::parse_identities, value_name = "ID,ID")]
        allow: Option<access::Identities>,
    },
    /// Every volume: size, logical used, zeros, stored bytes only it holds, users,
    /// thick or thin, reserved and reserved-but-unused space.
    List {
        #[command(flatten)]
        format: ListFormat,
    },
    /// One volume: size, logical used, zeros, stored bytes only it holds, users,
    /// thick or thin, reserved and reserved-but-unused space.
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
    ///
    /// Thick by default, as a new volume: the clone reserves its size, less the blocks
    /// it already maps. Linked clones for many VMs from one template: --thin.
    Clone {
        /// The volume to copy.
        src: String,
        /// The new volume's name.
        dst: String,
        #[command(flatten)]
        reserve: ReserveArgs,
    },
    /// Change what a volume reserves: --thick (its whole size), --thin (nothing) or
    /// --reserve S. Refused, with the numbers, when the pool cannot hold it aside.
    Set {
        /// Name.
        name: String,
        #[command(flatten)]
        reserve: SetReserveArgs,
    },
    /// Snapshots of a volume: `volume snapshot VOLUME NAME` takes one; `list` and
    /// `delete` below.
    ///
    /// A snapshot is the volume at one point in time, read-only, reached as
    /// VOLUME@NAME (also its NBD export name, served read-only). It shares every
    /// block-map page of the volume, so taking one costs the same whatever the
    /// volume's size, and it holds stored blocks only as the volume overwrites them.
    /// Taken with every write either done or not begun; durable on return.
    #[command(args_conflicts_with_subcommands = true)]
    Snapshot {
        #[command(subcommand)]
        command: Option<SnapshotCommand>,
        /// The volume.
        name: Option<String>,
        /// The snapshot's name.
        snapshot: Option<String>,
    },
    /// Roll a volume back to a snapshot: it then holds what SNAPSHOT holds, at
    /// SNAPSHOT's size.
    ///
    /// SNAPSHOT is a snapshot of the volume (`volume snapshot NAME SNAPSHOT`), or
    /// any other volume or VOLUME@SNAPSHOT (a clone taken earlier will do). One
    /// durable step: a crash leaves the volume as it was or as
    /// the snapshot, never without it. What only the volume's later writes held is
    /// freed; the snapshot is untouched. Refused while a client has the volume open.
    /// The volume keeps its name, its snapshots, what it reserves (thick, thin,
    /// --reserve) and its allow list. It takes the snapshot's block-map pages
    /// without copying them, so the step costs the same at any size.
    Rollback {
        /// The volume to roll back.
        name: String,
        /// The volume (snapshot) whose content it takes.
        snapshot: String,
    },
    /// List the byte ranges of a volume that differ from a snapshot of it.
    ///
    /// A range is changed when its blocks map other stored data than the
    /// snapshot's (a rewrite of the same bytes, which dedups to the same block, is
    /// no change; a trim of data is). What an incremental backup reads; over NBD the
    /// volume exports the same as the metadata context `qemu:dirty-bitmap:SNAPSHOT`.
    /// The snapshot's blocks past its end read as zeros. Walks the map pages either
    /// volume has written.
    Diff {
        /// The volume.
        name: String,
        /// The snapshot: the volume's own (`volume snapshot`), else any volume or
        /// VOLUME@SNAPSHOT (a clone taken earlier will do).
        #[arg(long = "from")]
        from: String,
        /// JSON: a list of {"offset", "length"} in bytes.
        #[arg(long)]
        json: bool,
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
    /// Limit a volume to some TLS identities, or open it to any client again; with
    /// neither, show who may open it.
    ///
    /// Identities are PSK identities (`serve --tls-psk`) or subject CNs of client
    /// certificates (`serve --tls-certificates … --tls-verify-peer`). Others are
    /// refused the volume and do not see it in an export list; clients in clear are
    /// told to start TLS. Takes effect for the next client, also while served.
    Allow {
        /// Volume name.
        name: String,
        /// The identities, comma-separated.
        #[arg(value_parser = access::parse_identities, value_name = "ID,ID", conflicts_with = "anyone")]
        identities: Option<access::Identities>,
        /// Remove the limit: any client the server lets in may open it.
        #[arg(long)]
        anyone: bool,
    },
    /// Write a raw image into a volume (created, sized to the file, if missing).
    ///
    /// qcow2, VMDK, VHD, VHDX and VDI files are refused, naming the qemu-img command
    /// that converts them. The volume is marked incomplete while the import runs: one
    /// cut short (Ctrl-C, SIGTERM, an error, a crash) leaves it marked, and `serve`
    /// refuses to export it until --resume finishes it or --force takes it.
    Import {
        /// Volume name.
        name: String,
        /// Raw image file (or block device); without it, --force takes a cut-short
        /// import's volume as it is.
        #[arg(required_unless_present = "force")]
        file: Option<PathBuf>,
        /// Overwrite a volume that already holds data (or is marked incomplete);
        /// without FILE, take a cut-short import's volume as it is.
        #[arg(long)]
        force: bool,
        /// Continue a cut-short import from the same FILE: only the chunks the volume
        /// does not hold yet are written.
        #[arg(long, conflicts_with = "force", requires = "file")]
        resume: bool,
    },
    /// Write a volume out as a raw image (sparse where the volume has holes).
    ///
    /// A volume with damaged blocks (stored data that fails its fingerprint) is refused
    /// before anything is written, each block named by its volume bytes and pool block
    /// (`volume 'vm1' bytes 409600..413695 (pool block 10340)`), exit status 4; a file
    /// is written beside its name and renamed over it at the end, so no partial image
    /// is left. With --skip-damaged, zeros stand in for each damaged block, each is
    /// named on stderr, and the exit status is 4 too (0: no damage).
    Export {
        /// Volume name.
        name: String,
        /// Raw image file or block device to write (a file that holds bytes only with
        /// --force); `-`, a pipe or a terminal gets every byte in order.
        file: PathBuf,
        /// Replace a file that already holds bytes.
        #[arg(long)]
        force: bool,
        /// Write zeros in place of damaged blocks instead of refusing; exit status 4
        /// when there were any.
        #[arg(long)]
        skip_damaged: bool,
    },
    /// Write a volume to stdout as a send stream, for `volume receive` in another pool.
    ///
    /// Each distinct block goes once (later copies as references), compressed with the
    /// pool's codec; with --from, only the blocks whose map entries differ from BASE's
    /// (a snapshot or a clone taken earlier, which the receiving pool also holds). A
    /// snapshot (VOLUME@SNAPSHOT) sent carries its identity, and the receiver makes
    /// the same snapshot. A served pool is read by its server, the stream coming over
    /// the control socket. docs/stream.md has the format.
    Send {
        /// Volume name, or VOLUME@SNAPSHOT.
        name: String,
        /// Send only what changed since BASE: a snapshot of the volume (its short
        /// name, as `volume diff` takes it; named by its identity), or a volume the
        /// receiver holds with the same content (checked by its size and a digest of
        /// its bytes).
        #[arg(long, value_name = "BASE")]
        from: Option<String>,
        /// Send only the records a cut-short receive lacks: the token it printed.
        #[arg(long, value_name = "TOKEN", conflicts_with = "to")]
        resume_token: Option<String>,
        /// Two-way mode: run this shell command as the receiver (`ssh host2 fewerbytes
        /// --pool P volume receive NAME --negotiate-with VOL,…`), offer it the digest
        /// of each block to send, and send only the blocks it does not hold.
        #[arg(long, value_name = "COMMAND")]
        to: Option<String>,
    },
    /// Make a new volume from a send stream on stdin.
    ///
    /// The volume is built as a hidden partial volume (no client can list, open or
    /// write it) that becomes NAME once the stream's end record checked out; a
    /// cut-short or damaged stream leaves it and its progress
    /// (`<pool>.receive.NAME.json`) for --resume, or --abandon. An incremental stream
    /// starts from a frozen copy of its base, taken when the receive begins and
    /// refused unless the base is the sender's (a snapshot named by --from or of NAME:
    /// the same identity; a volume, or a base only the stream names: the same size
    /// and content digest). A stream from one of NAME's snapshots updates an existing
    /// NAME in place, refused at the last step when NAME was written since that
    /// snapshot; a snapshot's stream makes NAME@SNAPSHOT with the sender's identity.
    /// A served pool takes the stream through its server's control socket.
    Receive {
        /// The new volume's name (or an existing one, updated in place by a stream
        /// from one of its snapshots).
        name: String,
        /// The base of an incremental stream, when not the name the stream carries.
        #[arg(long, value_name = "BASE", conflicts_with = "abandon")]
        from: Option<String>,
        /// Continue a receive that stopped: the records the pool holds are skipped.
        #[arg(long, conflicts_with = "abandon")]
        resume: bool,
        /// Discard a receive that stopped: its partial volume and progress file.
        #[arg(long)]
        abandon: bool,
        /// Two-way mode (`volume send --to`): answer the sender's offers from these
        /// volumes' blocks (read and hashed under the stream's key), which are then
        /// not sent; stdout carries the answer.
        #[arg(
            long,
            value_name = "VOL,VOL",
            value_delimiter = ',',
            conflicts_with = "abandon"
        )]
        negotiate_with: Vec<String>,
        /// Into an existing NAME (a stream from one of its snapshots): discard what
        /// was written to NAME since that snapshot, instead of refusing (never what
        /// is written while the receive runs).
        #[arg(long, conflicts_with = "abandon")]
        force: bool,
        #[command(flatten)]
        reserve: ReserveArgs,
    },
}

/// What a new volume or clone reserves (`volume create`, `volume clone`).
#[derive(clap::Args)]
pub struct ReserveArgs {
    /// Reserve nothing: writes fail (ENOSPC) when the pool has no space left outside
    /// other volumes' reservations.
    #[arg(long, conflicts_with_all = ["reserve", "thick"])]
    thin: bool,
    /// Reserve this much of the pool for it (at most its size counts).
    #[arg(long, value_parser = parse_size_arg, value_name = "S", conflicts_with = "thick")]
    reserve: Option<u64>,
    /// Reserve its whole size (the default).
    #[arg(long)]
    thick: bool,
}

impl ReserveArgs {
    fn provisioning(&self) -> Provisioning {
        match (self.thin, self.reserve) {
            (true, _) => Provisioning::THIN,
            (false, Some(bytes)) => Provisioning::Reserve(bytes),
            (false, None) => Provisioning::Thick,
        }
    }
}

/// What `volume set` changes a volume to: exactly one of the three.
#[derive(clap::Args)]
#[group(required = true, multiple = false)]
pub struct SetReserveArgs {
    /// Reserve nothing.
    #[arg(long)]
    thin: bool,
    /// Reserve this much (at most its size counts).
    #[arg(long, value_parser = parse_size_arg, value_name = "S")]
    reserve: Option<u64>,
    /// Reserve its whole size, and follow it through resizes.
    #[arg(long)]
    thick: bool,
}

impl SetReserveArgs {
    fn provisioning(&self) -> Provisioning {
        ReserveArgs {
            thin: self.thin,
            reserve: self.reserve,
            thick: self.thick,
        }
        .provisioning()
    }
}

/// "thick, reserves 20.00 GiB", "thin, reserves nothing" or "thin with a reservation,
/// reserves 2.00 GiB".
fn reservation_in_words(volume: &VolumeInfo) -> String {
    match (volume.thin, volume.reserved_bytes) {
        (false, bytes) => format!("thick, reserves {}", format_size(bytes)),
        (true, 0) => "thin, reserves nothing".to_string(),
        (true, bytes) => format!("thin with a reservation, reserves {}", format_size(bytes)),
    }
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
        VolumeCommand::Create {
            name,
            size,
            reserve,
            allow,
        } => {
            let allow_path = match allow {
                Some(_) => access::allow_path_to_write(pool_path)?,
                None => access::allow_path(pool_path)?,
            };
            let pool_id = match allow {
                Some(_) => access::pool_id(pool_path)?,
                None => String::new(),
            };
            if let Some(identities) = &allow {
                access::update(&allow_path, &pool_id, |list| {
                    list.volumes.insert(name.clone(), identities.0.clone());
                })?;
            }
            let created = expect_volume(
                pool_path,
                &Request::CreateVolume {
                    name: name.clone(),
                    size_bytes: size,
                    provisioning: reserve.provisioning(),
                },
            );
            let volume = match created {
                Ok(volume) => volume,
                Err(e) => {
                    if allow.is_some() && !volume_exists(pool_path, &name) {
                        let _ = access::update(&allow_path, &pool_id, |list| {
                            list.volumes.remove(&name);
                        });
                    }
                    return Err(e);
                }
            };
            if allow.is_some() {
                // The file's entry limits it already; the pool's flag keeps it
                // limited if the file is lost or the pool served by another name.
                limit(pool_path, &name, true)?;
            }
            println!(
                "Volume '{}' created: {} ({}).",
                volume.name,
                format_size(volume.size_bytes),
                reservation_in_words(&volume)
            );
            warn_if_thin_cannot_write(pool_path, &volume)?;
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
            // A snapshot, VOLUME@SNAPSHOT, is listed with its volume.
            let candidates = match name.split_once('@') {
                Some((of, _)) => list_snapshots(pool_path, of)?,
                None => list_volumes(pool_path)?,
            };
            let Some(volume) = candidates.into_iter().find(|v| v.name == name) else {
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
        VolumeCommand::Clone { src, dst, reserve } => {
            // The copy holds the same bytes: it keeps the same limit.
            copy_allowed(pool_path, &src, &dst)?;
            let cloned = expect_volume(
                pool_path,
                &Request::CloneVolume {
                    src: src.clone(),
                    dst: dst.clone(),
                    provisioning: reserve.provisioning(),
                },
            );
            let volume = match cloned {
                Ok(volume) => volume,
                Err(e) => {
                    if !volume_exists(pool_path, &dst) {
                        let _ = forget_allowed(pool_path, &dst);
                    }
                    return Err(e);
                }
            };
            println!(
                "Volume '{}' cloned from '{src}': {}, sharing every block ({}).",
                volume.name,
                format_size(volume.size_bytes),
                reservation_in_words(&volume)
            );
            warn_if_thin_cannot_write(pool_path, &volume)?;
        }
        VolumeCommand::Set { name, reserve } => {
            let provisioning = reserve.provisioning();
            let volume = expect_volume(pool_path, &Request::SetVolume { name, provisioning })?;
            println!(
                "Volume '{}' is now {}.",
                volume.name,
                reservation_in_words(&volume)
            );
            warn_if_thin_cannot_write(pool_path, &volume)?;
        }
        VolumeCommand::Rename { name, new_name } => {
            // Another pool's allow file is refused here, before the volume changes.
            copy_allowed(pool_path, &name, &new_name)?;
            let volume = expect_volume(
                pool_path,
                &Request::RenameVolume {
                    name: name.clone(),
                    new_name,
                },
            )?;
            forget_allowed(pool_path, &name)?;
            println!("Volume '{name}' renamed to '{}'.", volume.name);
        }
        VolumeCommand::Rollback { name, snapshot } => {
            let volume = expect_volume(
                pool_path,
                &Request::RollbackVolume {
                    name: name.clone(),
                    from: snapshot.clone(),
                },
            )?;
            println!(
                "Volume '{name}' rolled back to '{snapshot}': {} ({}).",
                format_size(volume.size_bytes),
                reservation_in_words(&volume)
            );
        }
        VolumeCommand::Snapshot {
            command,
            name,
            snapshot,
        } => {
            let command = match (command, name, snapshot) {
                (Some(command), _, _) => command,
                (None, Some(name), Some(snapshot)) => SnapshotCommand::Create { name, snapshot },
                _ => bail!(
                    "usage: fewerbytes volume snapshot VOLUME NAME (or snapshot list VOLUME, \
                     snapshot delete VOLUME NAME)"
                ),
            };
            snapshot_command(pool_path, command)?;
        }
        VolumeCommand::Diff { name, from, json } => {
            let request = Request::DiffVolume {
                name: name.clone(),
                from: from.clone(),
            };
            let changes = inspect_pool(pool_path, |pool| match pool.call(&request)? {
                Answer::Changes(changes) => Ok(changes),
                other => bail!("unexpected answer to volume diff: {other:?}"),
            })?;
            if json {
                let list: Vec<serde_json::Value> = changes
                    .iter()
                    .map(
                        |&(offset, length)| serde_json::json!({"offset": offset, "length": length}),
                    )
                    .collect();
                print_json(&list)?;
            } else {
                let total: u64 = changes.iter().map(|c| c.1).sum();
                for (offset, length) in &changes {
                    println!("{offset} {length}");
                }
                eprintln!(
                    "{} changed since '{from}' in {} range(s).",
                    format_size(total),
                    changes.len()
                );
            }
        }
        VolumeCommand::Delete { name, force } => {
            // Another pool's allow file is refused here, before the volume is gone.
            let pool_id = access::pool_id(pool_path)?;
            access::read(&access::allow_path(pool_path)?, &pool_id)?;
            with_pool(pool_path, |pool| {
                pool.call(&Request::DeleteVolume {
                    name: name.clone(),
                    force,
                })
            })?;
            forget_allowed(pool_path, &name)?;
            println!("Volume '{name}' deleted.");
        }
        VolumeCommand::Allow {
            name,
            identities,
            anyone,
        } => allow(pool_path, &name, identities, anyone)?,
        VolumeCommand::Import {
            name,
            file,
            force,
            resume,
        } => match file {
            None => transfer::take_as_is(pool_path, &name)?,
            Some(file) => {
                let mode = match (force, resume) {
                    (true, _) => transfer::ImportMode::Overwrite,
                    (false, true) => transfer::ImportMode::Resume,
                    (false, false) => transfer::ImportMode::Fresh,
                };
                transfer::import(pool_path, &name, &file, mode)?
            }
        },
        VolumeCommand::Export {
            name,
            file,
            force,
            skip_damaged,
        } => return crate::export::export(pool_path, &name, &file, force, skip_damaged),
        VolumeCommand::Send {
            name,
            from,
            resume_token,
            to,
        } => {
            let resume = resume_token
                .as_deref()
                .map(crate::send::ResumeToken::parse)
                .transpose()?;
            crate::send::send(pool_path, &name, from.as_deref(), resume, to.as_deref())?
        }
        VolumeCommand::Receive {
            name,
            from,
            resume,
            abandon,
            negotiate_with,
            force,
            reserve,
        } => crate::receive::receive(
            pool_path,
            &crate::receive::ReceiveRequest {
                name,
                from,
                resume,
                abandon,
                negotiate_with,
                force,
                provisioning: reserve.provisioning(),
            },
        )?,
    }
    Ok(ExitCode::SUCCESS)
}

/// Warn (on stderr; the command has succeeded) when `volume`, just made thin or
/// given a reservation below its size, could not write its unreserved part: thin
/// writes can use less than that now, so its writes fail with ENOSPC once they have
/// taken it. The usual cause: a thick volume reserves the rest of the pool.
fn warn_if_thin_cannot_write(pool_path: &Path, volume: &VolumeInfo) -> Result<()> {
    let unreserved = volume.size_bytes.saturating_sub(volume.reserved_bytes);
    if unreserved == 0 {
        return Ok(());
    }
    let info = inspect_pool(pool_path, |pool| match pool.call(&Request::PoolInfo)? {
        Answer::PoolInfo(info) => Ok(*info),
        other => bail!("unexpected answer to pool info: {other:?}"),
    })?;
    if info.space.available_bytes >= unreserved {
        return Ok(());
    }
    // The volume that holds back most is the first to look at.
    let holder = list_volumes(pool_path)?
        .into_iter()
        .filter(|v| v.name != volume.name && v.reserved_unused_bytes > 0)
        .max_by_key(|v| v.reserved_unused_bytes);
    let remedy = match holder {
        Some(v) => format!(
            "make '{0}' thin (`volume set {0} --thin`) or reserve less \
             (`volume set {0} --reserve SIZE`; it holds back {1}), ",
            v.name,
            format_size(v.reserved_unused_bytes)
        ),
        None => String::new(),
    };
    eprintln!(
        "warning: volume '{}' may need {} beyond its reservation, but thin writes can use \
         only {} of the pool now (Available; reservations hold back {} unused); its writes \
         past that fail with ENOSPC. To make room: {remedy}give it a reservation (`volume \
         set {} --reserve SIZE`), trim or delete volumes, or grow the pool (`pool grow`).",
        volume.name,
        format_size(unreserved),
        format_size(info.space.available_bytes),
        format_size(info.space.reserved_unused_bytes),
        volume.name,
    );
    Ok(())
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
        ("Type", Align::Left),
        ("Reserved", Align::Right),
        ("Reserved unused", Align::Right),
    ]);
    for volume in volumes {
        table.row(vec![
            volume.name.clone(),
            size(volume.size_bytes),
            size(volume.logical_used_bytes),
            size(volume.zero_bytes),
            size(volume.exclusive_stored_bytes),
            volume.users.to_string(),
            format!(
                "{}{}",
                match (volume.thin, volume.reserved_bytes) {
                    (false, _) => "thick",
                    (true, 0) => "thin",
                    (true, _) => "reserve",
                },
                // A cut-short import: `serve` refuses it (`volume import --resume`).
                if volume.incomplete {
                    ", incomplete"
                } else {
                    ""
                }
            ),
            size(volume.reserved_bytes),
            size(volume.reserved_unused_bytes),
        ]);
    }
    table
}

/// `volume snapshot create|list|delete`.
fn snapshot_command(pool_path: &Path, command: SnapshotCommand) -> Result<()> {
    match command {
        SnapshotCommand::Create { name, snapshot } => {
            let full = format!("{name}@{snapshot}");
            // The snapshot holds the volume's bytes: it keeps the volume's limit.
            copy_allowed(pool_path, &name, &full)?;
            let taken = expect_volume(
                pool_path,
                &Request::SnapshotVolume {
                    name: name.clone(),
                    snapshot,
                },
            );
            let volume = match taken {
                Ok(volume) => volume,
                Err(e) => {
                    let taken = list_snapshots(pool_path, &name)
                        .is_ok_and(|list| list.iter().any(|s| s.name == full));
                    if !taken {
                        let _ = forget_allowed(pool_path, &full);
                    }
                    return Err(e);
                }
            };
            println!(
                "Snapshot '{}' of {} taken.",
                volume.name,
                format_size(volume.size_bytes)
            );
        }
        SnapshotCommand::List { name, format } => {
            let snapshots = list_snapshots(pool_path, &name)?;
            if format.json {
                print_json(&snapshots)?;
            } else {
                format.print(&snapshots)?;
            }
        }
        SnapshotCommand::Delete { name, snapshot } => {
            let full = format!("{name}@{snapshot}");
            // Another pool's allow file is refused here, before the snapshot is gone.
            let pool_id = access::pool_id(pool_path)?;
            access::read(&access::allow_path(pool_path)?, &pool_id)?;
            with_pool(pool_path, |pool| {
                pool.call(&Request::DeleteVolume {
                    name: full.clone(),
                    force: false,
                })
            })?;
            forget_allowed(pool_path, &full)?;
            println!("Snapshot '{full}' deleted.");
        }
    }
    Ok(())
}

/// The snapshots of volume `name`, oldest first.
fn list_snapshots(pool_path: &Path, name: &str) -> Result<Vec<VolumeInfo>> {
    inspect_pool(pool_path, |pool| {
        match pool.call(&Request::ListSnapshots {
            name: name.to_string(),
        })? {
            Answer::Volumes(list) => Ok(list),
            other => bail!("unexpected answer to volume snapshot list: {other:?}"),
        }
    })
}
