//! The catalog: the volumes of a pool and the directories of every page table.
//! Written whole at each checkpoint as a byte stream split over catalog pages.
//! Version 1 names directory pages by slot, every level-1 page of every table;
//! version 2 names each table's [`TableRoot`] (the depth of its directory tree and
//! at most four [`PageRef`]s, `dir_tree.rs`), and records each volume's reservation
//! and thin flag, so its size depends on the volumes alone. Version 3 is version 2
//! with twinned references (24 bytes, both copies of a directory page) in the top
//! lists.

use crate::dir_tree::{MAX_DEPTH, MAX_TOP_REFS};
use crate::page::{PageRef, PAGE_PAYLOAD_BYTES, PAGE_REF_BYTES, TWIN_REF_BYTES};
use crate::superblock::MAX_CATALOG_PAGES_V2;
use crate::{FormatError, Reader, Writer, FORMAT_VERSION, FORMAT_VERSION_1, FORMAT_VERSION_2};

/// "FBCT": a version-1 catalog stream.
pub const CATALOG_MAGIC: u32 = 0x5443_4246;
/// "FBC2": a version-2 catalog stream.
pub const CATALOG_MAGIC_V2: u32 = 0x3243_4246;
/// "FBC3": a version-3 catalog stream.
pub const CATALOG_MAGIC_V3: u32 = 0x3343_4246;
/// "FBL3": a version-3 catalog stream whose volume records carry a lineage and an
/// origin (super block flag bit 7, shared map pages): written when a volume shares
/// map pages with another or is a snapshot, so a reader that does not know shared
/// pages refuses the pool.
pub const CATALOG_MAGIC_V3_LINEAGE: u32 = 0x334C_4246;
/// Volume flag (version 2): the volume is thin (reserves less than its size).
pub const VOLUME_FLAG_THIN: u32 = 1;
/// Volume flag (version 2): the volume is limited to the TLS identities an allow
/// list outside the pool names; a server that cannot read that list keeps it closed.
/// Older readers refuse the bit (unknown flags), so they cannot open it to all.
pub const VOLUME_FLAG_LIMITED: u32 = 2;
/// Volume flag (lineage streams only): the volume is a snapshot of its origin, a
/// point in time that is never written.
pub const VOLUME_FLAG_SNAPSHOT: u32 = 4;
/// Volume flag (version 2 and later): an import into the volume began and has not
/// ended (`volume import`), so it may hold part of its image; a server refuses to
/// export it until the import is resumed or taken as it is. Set durably before the
/// import writes, cleared after its last flush. Older readers refuse the bit
/// (unknown flags), so they cannot serve the half-written disk.
pub const VOLUME_FLAG_INCOMPLETE: u32 = 8;
/// Longest volume name in bytes.
pub const MAX_NAME_BYTES: usize = 64;
/// Most volumes a pool holds (a volume slot is a u16 in journal records).
pub const MAX_VOLUMES: usize = 4096;

/// One volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeRecord {
    /// Slot: the volume's number in journal records while it exists.
    pub slot: u16,
    /// Unique for the pool's lifetime.
    pub id: u64,
    /// Name (UTF-8, 1–64 bytes, no '/').
    pub name: String,
    /// Size in bytes (a multiple of 4096).
    pub size_bytes: u64,
    /// Space held for the volume (version 2; a version-1 volume holds its size).
    pub reservation_bytes: u64,
    /// Thin: reserves less than its size (version 2; version 1: false).
    pub thin: bool,
    /// Limited to some TLS identities (version 2; version 1: false).
    pub limited: bool,
    /// An import into it began and has not ended (version 2; version 1: false).
    pub incomplete: bool,
    /// The owner its map pages name: its own id for a volume made empty, its
    /// source's lineage for a clone, a snapshot or a rollback, whose map pages it
    /// shares (lineage streams; otherwise its id).
    pub lineage: u64,
    /// The id of the volume this is a snapshot of (lineage streams; 0: none).
    pub origin: u64,
    /// A snapshot: read-only, a point in time of its origin (lineage streams).
    pub snapshot: bool,
    /// When a snapshot was made, in seconds since 1970 (lineage streams; 0 for a
    /// volume).
    pub created: u32,
    /// A snapshot's identity, the same in every pool a send stream carried it to
    /// (lineage streams; 0: none).
    pub guid: u64,
    /// The top of its block map's directory tree.
    pub map: TableRoot,
}

/// Where a table's directory tree starts: its depth and the references of its
/// top-level directory pages. Version 1 has one level, all of whose pages the
/// catalog lists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableRoot {
    /// Directory levels (1 to [`MAX_DEPTH`]).
    pub depth: u32,
    /// The top level's pages (version 2: at most [`MAX_TOP_REFS`]; a zero reference
    /// is a page never written).
    pub top: Vec<PageRef>,
}

impl Default for TableRoot {
    fn default() -> Self {
        TableRoot {
            depth: 1,
            top: Vec::new(),
        }
    }
}

/// The whole catalog.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Catalog {
    /// Format version of the stream (1, 2 or 3).
    pub version: u32,
    /// Next volume id to hand out.
    pub next_volume_id: u64,
    /// The slab object table (version 1) or the count table (version 2).
    pub objects: TableRoot,
    /// The fingerprint table (version 2; empty in version 1).
    pub fingerprints: TableRoot,
    /// Volumes, by slot order.
    pub volumes: Vec<VolumeRecord>,
}

impl Default for Catalog {
    fn default() -> Self {
        Catalog {
            version: FORMAT_VERSION,
            next_volume_id: 0,
            objects: TableRoot::default(),
            fingerprints: TableRoot::default(),
            volumes: Vec::new(),
        }
    }
}

/// Bytes of the largest table root (version 3): depth, count, four twinned
/// references.
const MAX_ROOT_BYTES_V3: usize = 8 + MAX_TOP_REFS * TWIN_REF_BYTES;
/// Bytes of the largest version-3 catalog: 4,096 volumes of 64-byte names, each
/// table with a full top list (819,424 bytes; version 2's is 688,288). It depends on
/// nothing else.
pub const MAX_ENCODED_BYTES_V3: usize = 16
    + 2 * MAX_ROOT_BYTES_V3
    + MAX_VOLUMES * (2 + 2 + MAX_NAME_BYTES + 8 + 8 + 12 + MAX_ROOT_BYTES_V3);
/// Bytes a lineage stream adds to each volume record: lineage, origin, created
/// (u32) and guid.
const LINEAGE_BYTES: usize = 8 + 8 + 4 + 8;
/// Bytes of the largest version-3 lineage stream: each volume record 28 bytes more
/// (934,112 bytes, of the 935,424 the catalog pages hold).
pub const MAX_ENCODED_BYTES_V3_LINEAGE: usize = MAX_ENCODED_BYTES_V3 + MAX_VOLUMES * LINEAGE_BYTES;
const _: () = assert!(
    MAX_ENCODED_BYTES_V3_LINEAGE <= MAX_CATALOG_PAGES_V2 * PAGE_PAYLOAD_BYTES,
    "the largest version-3 catalog fits the catalog pages a super block references, \
     so a checkpoint never runs out of catalog room"
);

/// A directory list's pointers: u32 slots (version 1), page references (version 2)
/// or twinned references (version 3).
fn pointer_bytes(version: u32) -> usize {
    match version {
        FORMAT_VERSION_1 => 4,
        FORMAT_VERSION_2 => PAGE_REF_BYTES,
        _ => TWIN_REF_BYTES,
    }
}

/// Check a new volume's name: 1 to [`MAX_NAME_BYTES`] ASCII letters, digits and
/// `- _ . : +`, starting with a letter or a digit. A name is an NBD export name, a
/// command-line argument and part of URIs and file names people make from it: a
/// leading `-` reads as an option (`volume delete -x`), and `.` or `..` as a
/// directory. Decoding does not check names, so a pool holding a name this refuses
/// (made by an earlier version) still opens.
pub fn validate_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_NAME_BYTES {
        return Err(format!(
            "a volume name must be 1 to {MAX_NAME_BYTES} bytes long"
        ));
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':' | '+'))
    {
        return Err(format!(
            "volume name '{name}' may use only letters, digits and - _ . : +"
        ));
    }
    if !name.starts_with(|c: char| c.is_ascii_alphanumeric()) {
        return Err(format!(
            "volume name '{name}' must start with a letter or a digit \
             (a leading - reads as an option, and . or .. as a directory)"
        ));
    }
    Ok(())
}

impl Catalog {
    /// Whether the stream must carry lineages (version 3 only): some volume shares
    /// pages under another's lineage, or is a snapshot.
    pub fn has_lineage(&self) -> bool {
        self.version >= FORMAT_VERSION
            && self.volumes.iter().any(|v| {
                v.lineage != v.id || v.origin != 0 || v.snapshot || v.created != 0 || v.guid != 0
            })
    }

    /// Encoded size in bytes.
    pub fn encoded_len(&self) -> usize {
        let v2 = self.version != FORMAT_VERSION_1;
        let lineage = if self.has_lineage() { LINEAGE_BYTES } else { 0 };
        let pointer = pointer_bytes(self.version);
        let root = |t: &TableRoot| {
            if v2 {
                8 + pointer * t.top.len()
            } else {
                4 + 4 * t.top.len()
            }
        };
        16 + root(&self.objects)
            + if v2 { root(&self.fingerprints) } else { 0 }
            + self
                .volumes
                .iter()
                .map(|v| {
                    2 + 2 + v.name.len() + 8 + 8 + if v2 { 12 } else { 0 } + lineage + root(&v.map)
                })
                .sum::<usize>()
    }

    /// Encode into a byte stream of its version. A version-1 stream keeps only the
    /// slot of each reference (version 1 has nothing more), a version-2 one no twin.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.encoded_len()];
        let mut w = Writer::new(&mut out);
        let v2 = self.version != FORMAT_VERSION_1;
        let twinned = self.version >= FORMAT_VERSION;
        let lineage = self.has_lineage();
        let root = |w: &mut Writer<'_>, t: &TableRoot| {
            if v2 {
                w.u32(t.depth);
            }
            w.u32(t.top.len() as u32);
            for r in &t.top {
                if v2 {
                    r.encode_as(twinned, w);
                } else {
                    w.u32(r.address as u32);
                }
            }
        };
        w.u32(match self.version {
            FORMAT_VERSION_1 => CATALOG_MAGIC,
            FORMAT_VERSION_2 => CATALOG_MAGIC_V2,
            _ if lineage => CATALOG_MAGIC_V3_LINEAGE,
            _ => CATALOG_MAGIC_V3,
        });
        w.u32(self.volumes.len() as u32);
        w.u64(self.next_volume_id);
        root(&mut w, &self.objects);
        if v2 {
            root(&mut w, &self.fingerprints);
        }
        for v in &self.volumes {
            w.u16(v.slot);
            w.u16(v.name.len() as u16);
            w.put(v.name.as_bytes());
            w.u64(v.id);
            w.u64(v.size_bytes);
            if v2 {
                w.u64(v.reservation_bytes);
                let thin = if v.thin { VOLUME_FLAG_THIN } else { 0 };
                let limited = if v.limited { VOLUME_FLAG_LIMITED } else { 0 };
                let snapshot = if v.snapshot { VOLUME_FLAG_SNAPSHOT } else { 0 };
                let incomplete = if v.incomplete {
                    VOLUME_FLAG_INCOMPLETE
                } else {
                    0
                };
                w.u32(thin | limited | snapshot | incomplete);
            }
            if lineage {
                w.u64(v.lineage);
                w.u64(v.origin);
                w.u32(v.created);
                w.u64(v.guid);
            }
            root(&mut w, &v.map);
        }
        out
    }

    /// Decode a byte stream of either version (its magic says which); every count
    /// is checked against the bytes present.
    pub fn decode(bytes: &[u8]) -> Result<Self, FormatError> {
        let what = "catalog";
        let mut r = Reader::new(what, bytes);
        let magic = r.u32()?;
        let lineage = magic == CATALOG_MAGIC_V3_LINEAGE;
        let version = match magic {
            CATALOG_MAGIC => FORMAT_VERSION_1,
            CATALOG_MAGIC_V2 => FORMAT_VERSION_2,
            CATALOG_MAGIC_V3 | CATALOG_MAGIC_V3_LINEAGE => FORMAT_VERSION,
            _ => {
                return Err(FormatError::BadMagic {
                    what,
                    found: u64::from(magic),
                })
            }
        };
        let v2 = version != FORMAT_VERSION_1;
        let twinned = version >= FORMAT_VERSION;
        let volume_count = r.u32()? as usize;
        if volume_count > MAX_VOLUMES {
            return Err(FormatError::Invalid {
                what,
                reason: format!("{volume_count} volumes (max {MAX_VOLUMES})"),
            });
        }
        let next_volume_id = r.u64()?;
        let root = |r: &mut Reader<'_>| -> Result<TableRoot, FormatError> {
            let depth = if v2 { r.u32()? } else { 1 };
            if !(1..=MAX_DEPTH).contains(&depth) {
                return Err(FormatError::Invalid {
                    what,
                    reason: format!("a directory tree of depth {depth} (max {MAX_DEPTH})"),
                });
            }
            let n = r.u32()? as usize;
            if v2 && n > MAX_TOP_REFS {
                return Err(FormatError::Invalid {
                    what,
                    reason: format!("{n} top-level directory references (max {MAX_TOP_REFS})"),
                });
            }
            let need = n.saturating_mul(pointer_bytes(version));
            if need > bytes.len() {
                return Err(FormatError::Truncated {
                    what,
                    got: bytes.len(),
                    need,
                });
            }
            let mut top = Vec::with_capacity(n);
            for _ in 0..n {
                top.push(if v2 {
                    PageRef::decode_as(twinned, r)?
                } else {
                    PageRef::slot_only(r.u32()?)
                });
            }
            Ok(TableRoot { depth, top })
        };
        let objects = root(&mut r)?;
        let fingerprints = if v2 {
            root(&mut r)?
        } else {
            TableRoot::default()
        };
        let mut volumes = Vec::with_capacity(volume_count);
        for _ in 0..volume_count {
            let slot = r.u16()?;
            let name_len = usize::from(r.u16()?);
            if name_len > MAX_NAME_BYTES {
                return Err(FormatError::Invalid {
                    what,
                    reason: format!("volume name of {name_len} bytes"),
                });
            }
            let name = String::from_utf8(r.take(name_len)?.to_vec()).map_err(|_| {
                FormatError::Invalid {
                    what,
                    reason: "volume name is not UTF-8".into(),
                }
            })?;
            let id = r.u64()?;
            let size_bytes = r.u64()?;
            let (reservation_bytes, flags) = if v2 {
                let reservation_bytes = r.u64()?;
                let flags = r.u32()?;
                let known = VOLUME_FLAG_THIN
                    | VOLUME_FLAG_LIMITED
                    | VOLUME_FLAG_INCOMPLETE
                    | if lineage { VOLUME_FLAG_SNAPSHOT } else { 0 };
                if flags & !known != 0 {
                    return Err(FormatError::Invalid {
                        what,
                        reason: format!("volume '{name}' has unknown flags {flags:#x}"),
                    });
                }
                (reservation_bytes, flags)
            } else {
                // Version 1 has no flags: thick, open to all, complete.
                (size_bytes, 0)
            };
            let flag = |bit: u32| flags & bit != 0;
            let (thin, limited, snapshot) = (
                flag(VOLUME_FLAG_THIN),
                flag(VOLUME_FLAG_LIMITED),
                flag(VOLUME_FLAG_SNAPSHOT),
            );
            let (lineage_id, origin, created, guid) = if lineage {
                (r.u64()?, r.u64()?, r.u32()?, r.u64()?)
            } else {
                (id, 0, 0, 0)
            };
            if snapshot && origin == 0 {
                return Err(FormatError::Invalid {
                    what,
                    reason: format!("snapshot '{name}' names no origin"),
                });
            }
            let map = root(&mut r)?;
            volumes.push(VolumeRecord {
                slot,
                id,
                name,
                size_bytes,
                reservation_bytes,
                thin,
                limited,
                incomplete: flag(VOLUME_FLAG_INCOMPLETE),
                lineage: lineage_id,
                origin,
                snapshot,
                created,
                guid,
                map,
            });
        }
        Ok(Catalog {
            version,
            next_volume_id,
            objects,
            fingerprints,
            volumes,
        })
    }
}

#[cfg(test)]
#[allow(
    clippy::unwrap_used,
    clippy::indexing_slicing,
    reason = "tests fail loudly by design"
)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample(version: u32) -> Catalog {
        let v2 = version != FORMAT_VERSION_1;
        let r = |slot: u32| PageRef {
            address: u64::from(slot),
            crc: if v2 && slot != 0 { slot * 7 } else { 0 },
            generation: if v2 && slot != 0 { 3 } else { 0 },
            twin: if version == FORMAT_VERSION && slot != 0 {
                u64::from(slot) + 1000
            } else {
                0
            },
        };
        Catalog {
            version,
            next_volume_id: 5,
            objects: TableRoot {
                depth: if v2 { 3 } else { 1 },
                top: vec![r(1), r(0), r(9)],
            },
            fingerprints: if v2 {
                TableRoot {
                    depth: 4,
                    top: vec![r(11)],
                }
            } else {
                TableRoot::default()
            },
            volumes: vec![VolumeRecord {
                slot: 2,
                id: 4,
                name: "vm-100-disk-0".into(),
                size_bytes: 1 << 30,
                reservation_bytes: if v2 { 1 << 20 } else { 1 << 30 },
                thin: v2,
                limited: v2,
                incomplete: v2,
                lineage: 4,
                origin: 0,
                snapshot: false,
                created: 0,
                guid: 0,
                map: TableRoot {
                    depth: 1,
                    top: vec![r(7)],
                },
            }],
        }
    }

    #[test]
    fn catalogs_of_every_version_round_trip() {
        for version in [FORMAT_VERSION_1, FORMAT_VERSION_2, FORMAT_VERSION] {
            let c = sample(version);
            let bytes = c.encode();
            assert_eq!(bytes.len(), c.encoded_len());
            assert_eq!(Catalog::decode(&bytes).unwrap(), c, "version {version}");
        }
    }

    #[test]
    fn a_volume_flag_no_reader_knows_is_refused() {
        let c = sample(FORMAT_VERSION);
        let mut bytes = c.encode();
        // The volume's flags: after its slot, name, id, size and reservation.
        let at = bytes.len() - (8 + TWIN_REF_BYTES) - 4;
        assert_eq!(
            bytes[at],
            (VOLUME_FLAG_THIN | VOLUME_FLAG_LIMITED | VOLUME_FLAG_INCOMPLETE) as u8
        );
        bytes[at] |= 16;
        assert!(matches!(
            Catalog::decode(&bytes),
            Err(FormatError::Invalid { .. })
        ));
    }

    #[test]
    fn a_version_2_root_past_the_depth_or_top_list_bound_is_refused() {
        let mut c = sample(FORMAT_VERSION);
        c.objects.depth = MAX_DEPTH + 1;
        assert!(matches!(
            Catalog::decode(&c.encode()),
            Err(FormatError::Invalid { .. })
        ));
        c.objects.depth = 0;
        assert!(Catalog::decode(&c.encode()).is_err());
        let mut c = sample(FORMAT_VERSION);
        c.volumes[0].map.top = vec![PageRef::NONE; MAX_TOP_REFS + 1];
        assert!(matches!(
            Catalog::decode(&c.encode()),
            Err(FormatError::Invalid { .. })
        ));
    }

    #[test]
    fn the_largest_catalog_is_its_computed_bound() {
        let full = TableRoot {
            depth: MAX_DEPTH,
            top: vec![PageRef::NONE; MAX_TOP_REFS],
        };
        let c = Catalog {
            version: FORMAT_VERSION,
            next_volume_id: 0,
            objects: full.clone(),
            fingerprints: full.clone(),
            volumes: (0..MAX_VOLUMES)
                .map(|i| VolumeRecord {
                    slot: i as u16,
                    id: i as u64,
                    name: "n".repeat(MAX_NAME_BYTES),
                    size_bytes: 0,
                    reservation_bytes: 0,
                    thin: false,
                    limited: true,
                    incomplete: true,
                    lineage: i as u64,
                    origin: 0,
                    snapshot: false,
                    created: 0,
                    guid: 0,
                    map: full.clone(),
                })
                .collect(),
        };
        assert_eq!(c.encoded_len(), MAX_ENCODED_BYTES_V3);
        assert_eq!(MAX_ENCODED_BYTES_V3, 819_424);
        let v2 = Catalog {
            version: FORMAT_VERSION_2,
            ..c
        };
        assert_eq!(v2.encoded_len(), 688_288);
        let mut shared = Catalog {
            version: FORMAT_VERSION,
            ..v2
        };
        shared.volumes[0].snapshot = true;
        shared.volumes[0].origin = 7;
        assert_eq!(shared.encoded_len(), MAX_ENCODED_BYTES_V3_LINEAGE);
    }

    #[test]
    fn lineages_and_snapshots_round_trip_in_their_own_stream_and_older_ones_read_as_their_own() {
        let plain = sample(FORMAT_VERSION);
        assert!(!plain.has_lineage());
        assert_eq!(plain.encode()[..4], CATALOG_MAGIC_V3.to_le_bytes());
        let mut c = plain.clone();
        c.volumes.push(VolumeRecord {
            slot: 3,
            id: 9,
            name: "before-upgrade".into(),
            lineage: 4,
            origin: 4,
            snapshot: true,
            created: 1_796_000_000,
            guid: 0x0123_4567_89ab_cdef,
            ..c.volumes[0].clone()
        });
        assert!(c.has_lineage());
        let bytes = c.encode();
        assert_eq!(bytes[..4], CATALOG_MAGIC_V3_LINEAGE.to_le_bytes());
        assert_eq!(bytes.len(), c.encoded_len());
        assert_eq!(Catalog::decode(&bytes).unwrap(), c);
        // A snapshot without an origin is refused.
        c.volumes[1].origin = 0;
        assert!(matches!(
            Catalog::decode(&c.encode()),
            Err(FormatError::Invalid { .. })
        ));
        // The snapshot flag means nothing in a stream without lineages.
        let mut bytes = plain.encode();
        let at = bytes.len() - (8 + TWIN_REF_BYTES) - 4;
        bytes[at] |= VOLUME_FLAG_SNAPSHOT as u8;
        assert!(Catalog::decode(&bytes).is_err());
    }

    proptest! {
        #[test]
        fn random_catalogs_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            let mut b = bytes;
            if b.len() >= 4 { b[..4].copy_from_slice(&CATALOG_MAGIC.to_le_bytes()); }
            let _ = Catalog::decode(&b);
            if b.len() >= 4 { b[..4].copy_from_slice(&CATALOG_MAGIC_V2.to_le_bytes()); }
            let _ = Catalog::decode(&b);
            if b.len() >= 4 { b[..4].copy_from_slice(&CATALOG_MAGIC_V3.to_le_bytes()); }
            let _ = Catalog::decode(&b);
            if b.len() >= 4 { b[..4].copy_from_slice(&CATALOG_MAGIC_V3_LINEAGE.to_le_bytes()); }
            let _ = Catalog::decode(&b);
        }
    }
}
