//! The catalog: the volumes of a pool and the directories of every page table.
//! Written whole at each checkpoint as a byte stream split over catalog pages.

use crate::{FormatError, Reader, Writer};

/// "FBCT".
pub const CATALOG_MAGIC: u32 = 0x5443_4246;
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
    /// Page-store slots of the directory pages of its block map (0 = no page yet).
    pub map_dir_slots: Vec<u32>,
}

/// The whole catalog.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Catalog {
    /// Next volume id to hand out.
    pub next_volume_id: u64,
    /// Directory pages of the slab object table (0 = no page yet).
    pub object_dir_slots: Vec<u32>,
    /// Volumes, by slot order.
    pub volumes: Vec<VolumeRecord>,
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
    /// Encoded size in bytes.
    pub fn encoded_len(&self) -> usize {
        20 + 4 * self.object_dir_slots.len()
            + self
                .volumes
                .iter()
                .map(|v| 2 + 2 + v.name.len() + 8 + 8 + 4 + 4 * v.map_dir_slots.len())
                .sum::<usize>()
    }

    /// Encode into a byte stream.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.encoded_len()];
        let mut w = Writer::new(&mut out);
        w.u32(CATALOG_MAGIC);
        w.u32(self.volumes.len() as u32);
        w.u64(self.next_volume_id);
        w.u32(self.object_dir_slots.len() as u32);
        for s in &self.object_dir_slots {
            w.u32(*s);
        }
        for v in &self.volumes {
            w.u16(v.slot);
            w.u16(v.name.len() as u16);
            w.put(v.name.as_bytes());
            w.u64(v.id);
            w.u64(v.size_bytes);
            w.u32(v.map_dir_slots.len() as u32);
            for s in &v.map_dir_slots {
                w.u32(*s);
            }
        }
        out
    }

    /// Decode a byte stream; every count is checked against the bytes present.
    pub fn decode(bytes: &[u8]) -> Result<Self, FormatError> {
        let what = "catalog";
        let mut r = Reader::new(what, bytes);
        let magic = r.u32()?;
        if magic != CATALOG_MAGIC {
            return Err(FormatError::BadMagic {
                what,
                found: u64::from(magic),
            });
        }
        let volume_count = r.u32()? as usize;
        if volume_count > MAX_VOLUMES {
            return Err(FormatError::Invalid {
                what,
                reason: format!("{volume_count} volumes (max {MAX_VOLUMES})"),
            });
        }
        let next_volume_id = r.u64()?;
        let object_dirs = r.u32()? as usize;
        if object_dirs * 4 > bytes.len() {
            return Err(FormatError::Truncated {
                what,
                got: bytes.len(),
                need: object_dirs * 4,
            });
        }
        let mut object_dir_slots = Vec::with_capacity(object_dirs);
        for _ in 0..object_dirs {
            object_dir_slots.push(r.u32()?);
        }
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
            let dirs = r.u32()? as usize;
            if dirs * 4 > bytes.len() {
                return Err(FormatError::Truncated {
                    what,
                    got: bytes.len(),
                    need: dirs * 4,
                });
            }
            let mut map_dir_slots = Vec::with_capacity(dirs);
            for _ in 0..dirs {
                map_dir_slots.push(r.u32()?);
            }
            volumes.push(VolumeRecord {
                slot,
                id,
                name,
                size_bytes,
                map_dir_slots,
            });
        }
        Ok(Catalog {
            next_volume_id,
            object_dir_slots,
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

    #[test]
    fn catalog_round_trips() {
        let c = Catalog {
            next_volume_id: 5,
            object_dir_slots: vec![1, 0, 9],
            volumes: vec![VolumeRecord {
                slot: 2,
                id: 4,
                name: "vm-100-disk-0".into(),
                size_bytes: 1 << 30,
                map_dir_slots: vec![7],
            }],
        };
        assert_eq!(Catalog::decode(&c.encode()).unwrap(), c);
    }

    proptest! {
        #[test]
        fn random_catalogs_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            let mut b = bytes;
            if b.len() >= 4 { b[..4].copy_from_slice(&CATALOG_MAGIC.to_le_bytes()); }
            let _ = Catalog::decode(&b);
        }
    }
}
