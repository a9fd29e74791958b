//! `Image`: a device's bytes as 4 KiB pages shared copy-on-write, the memory behind
//! [`crate::FaultStorage`] and the crash simulation's replays: copying an image costs
//! a pointer per page, not the device's bytes.

use std::sync::Arc;

/// The unit in which images are shared (a page of the host, and the engine's block).
pub(crate) const PAGE_BYTES: usize = 4096;

/// A device's bytes as 4 KiB pages shared copy-on-write; a page never written is
/// zeros and takes no memory. Cloning copies one pointer per page.
#[derive(Clone)]
pub struct Image {
    len_bytes: u64,
    pages: Vec<Option<Arc<[u8; PAGE_BYTES]>>>,
}

impl Image {
    /// `len_bytes` of zeros.
    pub fn zeroed(len_bytes: u64) -> Self {
        Image {
            len_bytes,
            pages: vec![None; len_bytes.div_ceil(PAGE_BYTES as u64) as usize],
        }
    }

    /// An image holding `bytes`.
    pub fn from_bytes(bytes: &[u8]) -> Self {
        let mut image = Image::zeroed(bytes.len() as u64);
        for (page, chunk) in image.pages.iter_mut().zip(bytes.chunks(PAGE_BYTES)) {
            if chunk.iter().any(|b| *b != 0) {
                let mut copy = [0u8; PAGE_BYTES];
                copy.iter_mut().zip(chunk).for_each(|(d, s)| *d = *s);
                *page = Some(Arc::new(copy));
            }
        }
        image
    }

    /// The image's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.len_bytes as usize];
        self.read(&mut out, 0);
        out
    }

    /// The image's length.
    pub fn len_bytes(&self) -> u64 {
        self.len_bytes
    }

    /// Copy `buf.len()` bytes at `offset_bytes` out (the caller checked the bounds).
    pub fn read(&self, buf: &mut [u8], offset_bytes: u64) {
        let mut at = offset_bytes as usize;
        let mut rest = buf;
        while !rest.is_empty() {
            let (page, within) = (at / PAGE_BYTES, at % PAGE_BYTES);
            let n = (PAGE_BYTES - within).min(rest.len());
            let (dst, tail) = rest.split_at_mut(n);
            let src = self.pages.get(page).and_then(Option::as_ref);
            match src.and_then(|p| p.get(within..within + n)) {
                Some(src) => dst.copy_from_slice(src),
                None => dst.fill(0),
            }
            rest = tail;
            at += n;
        }
    }

    /// Copy `data` in at `offset_bytes`; bytes past the end are dropped.
    pub fn write(&mut self, data: &[u8], offset_bytes: u64) {
        let mut at = offset_bytes as usize;
        let mut rest = data;
        while !rest.is_empty() {
            let (page, within) = (at / PAGE_BYTES, at % PAGE_BYTES);
            let n = (PAGE_BYTES - within).min(rest.len());
            let (src, tail) = rest.split_at(n);
            let Some(slot) = self.pages.get_mut(page) else {
                return;
            };
            // Zeros onto a page never written (a discard replayed, say) leave it
            // unallocated: it reads as zeros either way.
            if slot.is_none() && src.iter().all(|b| *b == 0) {
                rest = tail;
                at += n;
                continue;
            }
            let page = Arc::make_mut(slot.get_or_insert_with(|| Arc::new([0u8; PAGE_BYTES])));
            if let Some(dst) = page.get_mut(within..within + n) {
                dst.copy_from_slice(src);
            }
            rest = tail;
            at += n;
        }
    }
}

impl Image {
    /// Zero `[offset_bytes, offset_bytes+len_bytes)`: whole pages are dropped (they
    /// take no memory again), partial ones are filled with zeros.
    pub fn zero(&mut self, offset_bytes: u64, len_bytes: u64) {
        let end = offset_bytes.saturating_add(len_bytes).min(self.len_bytes);
        let mut at = offset_bytes;
        while at < end {
            let within = (at % PAGE_BYTES as u64) as usize;
            let n = (PAGE_BYTES - within).min((end - at) as usize);
            let Some(slot) = self.pages.get_mut((at / PAGE_BYTES as u64) as usize) else {
                return;
            };
            if n == PAGE_BYTES {
                *slot = None;
            } else if let Some(page) = slot {
                if let Some(bytes) = Arc::make_mut(page).get_mut(within..within + n) {
                    bytes.fill(0);
                }
            }
            at += n as u64;
        }
    }

    /// Make the image `len_bytes` long (not shorter than it is): the new bytes are zeros.
    pub fn grow(&mut self, len_bytes: u64) {
        assert!(len_bytes >= self.len_bytes, "an image only grows");
        self.len_bytes = len_bytes;
        self.pages
            .resize(len_bytes.div_ceil(PAGE_BYTES as u64) as usize, None);
    }
}

impl Image {
    /// Per page, whether it holds bytes (was written with anything but zeros onto
    /// a page never written, and not dropped since).
    pub(crate) fn allocated_pages(&self) -> Vec<bool> {
        self.pages.iter().map(Option::is_some).collect()
    }

    /// How many 4 KiB pages the image spans.
    pub(crate) fn page_count(&self) -> usize {
        self.pages.len()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn an_image_shares_pages_until_written() {
        let mut a = Image::from_bytes(&[7u8; 3 * PAGE_BYTES]);
        let b = a.clone();
        a.write(&[9; 10], PAGE_BYTES as u64 + 5);
        let (mut x, mut y) = ([0u8; 20], [0u8; 20]);
        a.read(&mut x, PAGE_BYTES as u64);
        b.read(&mut y, PAGE_BYTES as u64);
        assert_eq!(x[5..15], [9; 10], "the write is in the copy written");
        assert_eq!(y, [7; 20], "the other copy is untouched");
        assert_eq!(Image::zeroed(100).to_bytes(), vec![0u8; 100]);
    }
}
