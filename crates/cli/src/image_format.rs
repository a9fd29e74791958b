//! Which disk image format a file is, by its magic bytes: `volume import` takes raw
//! images only, and a qcow2, VMDK, VHD, VHDX or VDI file imported as raw would store its
//! container's bytes, not the disk it holds.
//!
//! The magic numbers are those of QEMU's own probes (`block/qcow2.c`, `vmdk.c`,
//! `vpc.c`, `vhdx.c`, `vdi.c`): a raw disk image begins with a boot sector or a file
//! system, never with one of these.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

/// A format that is not raw, named as qemu-img names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageFormat {
    /// QEMU copy-on-write v2/v3: `QFI\xfb` at 0.
    Qcow2,
    /// VMware: a sparse extent (`KDMV` at 0) or a text descriptor.
    Vmdk,
    /// Virtual PC / Hyper-V VHD: `conectix` at 0 (dynamic) or in the last 512 bytes
    /// (fixed, a raw disk with a footer).
    Vpc,
    /// Hyper-V VHDX: `vhdxfile` at 0.
    Vhdx,
    /// VirtualBox: signature 0xbeda107f at byte 64.
    Vdi,
}

impl ImageFormat {
    /// The name qemu-img's `-f` takes.
    pub fn qemu_name(self) -> &'static str {
        match self {
            ImageFormat::Qcow2 => "qcow2",
            ImageFormat::Vmdk => "vmdk",
            ImageFormat::Vpc => "vpc",
            ImageFormat::Vhdx => "vhdx",
            ImageFormat::Vdi => "vdi",
        }
    }

    /// What a person calls it.
    pub fn description(self) -> &'static str {
        match self {
            ImageFormat::Qcow2 => "a qcow2 image",
            ImageFormat::Vmdk => "a VMDK image",
            ImageFormat::Vpc => "a VHD image",
            ImageFormat::Vhdx => "a VHDX image",
            ImageFormat::Vdi => "a VDI image",
        }
    }
}

/// Bytes read from the start of the file: every magic below lies within them.
const HEAD_BYTES: usize = 512;
/// Where VDI keeps its signature, and the signature (little-endian).
const VDI_SIGNATURE_OFFSET: usize = 64;
const VDI_SIGNATURE: u32 = 0xbeda_107f;
/// A fixed VHD's footer: the last 512 bytes.
const VHD_FOOTER_BYTES: u64 = 512;

/// The format of the image in `file` of `len_bytes`, or `None` for raw (anything else).
pub fn detect(file: &File, len_bytes: u64) -> io::Result<Option<ImageFormat>> {
    let mut head = [0u8; HEAD_BYTES];
    let head_len = read_prefix(file, &mut head, 0)?;
    if let Some(format) = detect_head(head.get(..head_len).unwrap_or_default()) {
        return Ok(Some(format));
    }
    if len_bytes >= VHD_FOOTER_BYTES {
        let mut footer = [0u8; 8];
        let footer_len = read_prefix(file, &mut footer, len_bytes - VHD_FOOTER_BYTES)?;
        if footer.get(..footer_len) == Some(b"conectix".as_slice()) {
            return Ok(Some(ImageFormat::Vpc));
        }
    }
    Ok(None)
}

/// The format named by the first bytes of a file, if any.
fn detect_head(head: &[u8]) -> Option<ImageFormat> {
    let starts = |magic: &[u8]| head.starts_with(magic);
    if starts(b"QFI\xfb") {
        Some(ImageFormat::Qcow2)
    } else if starts(b"KDMV") || starts(b"COWD") || starts(b"# Disk DescriptorFile") {
        Some(ImageFormat::Vmdk)
    } else if starts(b"vhdxfile") {
        Some(ImageFormat::Vhdx)
    } else if starts(b"conectix") {
        Some(ImageFormat::Vpc)
    } else {
        let signature = head.get(VDI_SIGNATURE_OFFSET..VDI_SIGNATURE_OFFSET + 4)?;
        let signature = u32::from_le_bytes(signature.try_into().ok()?);
        (signature == VDI_SIGNATURE).then_some(ImageFormat::Vdi)
    }
}

/// Read up to `buf.len()` bytes at `offset`; returns how many (fewer at the end).
fn read_prefix(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        let rest = buf.get_mut(filled..).unwrap_or_default();
        match file.read_at(rest, offset + filled as u64) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_magic_names_its_format() {
        assert_eq!(detect_head(b"QFI\xfb\0\0\0\x03"), Some(ImageFormat::Qcow2));
        assert_eq!(detect_head(b"KDMV\x01\0\0\0"), Some(ImageFormat::Vmdk));
        assert_eq!(
            detect_head(b"# Disk DescriptorFile\nversion=1"),
            Some(ImageFormat::Vmdk)
        );
        assert_eq!(detect_head(b"vhdxfile"), Some(ImageFormat::Vhdx));
        assert_eq!(detect_head(b"conectix\0\0\0\x02"), Some(ImageFormat::Vpc));
        let mut vdi = [0u8; 72];
        vdi[64..68].copy_from_slice(&VDI_SIGNATURE.to_le_bytes());
        assert_eq!(detect_head(&vdi), Some(ImageFormat::Vdi));
    }

    #[test]
    fn a_boot_sector_or_zeros_are_raw() {
        let mut mbr = [0u8; 512];
        mbr[510] = 0x55;
        mbr[511] = 0xaa;
        assert_eq!(detect_head(&mbr), None);
        assert_eq!(detect_head(&[0u8; 512]), None);
        assert_eq!(detect_head(b"QFI"), None, "a short file is raw");
    }
}
