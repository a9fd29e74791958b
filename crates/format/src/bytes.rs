//! Little-endian cursors that never panic: a short read is a `FormatError`.

use crate::FormatError;

/// Reads little-endian fields from a byte slice.
pub struct Reader<'a> {
    what: &'static str,
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    /// A reader over `bytes`, naming `what` in errors.
    pub fn new(what: &'static str, bytes: &'a [u8]) -> Self {
        Reader {
            what,
            bytes,
            pos: 0,
        }
    }
    /// Move to an absolute position.
    pub fn seek(&mut self, pos: usize) {
        self.pos = pos;
    }
    /// The current position.
    pub fn pos(&self) -> usize {
        self.pos
    }
    /// Take `n` bytes.
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], FormatError> {
        let end = self.pos.checked_add(n);
        match end.and_then(|end| self.bytes.get(self.pos..end)) {
            Some(s) => {
                self.pos += n;
                Ok(s)
            }
            None => Err(FormatError::Truncated {
                what: self.what,
                got: self.bytes.len(),
                need: self.pos.saturating_add(n),
            }),
        }
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], FormatError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }
    /// One byte.
    pub fn u8(&mut self) -> Result<u8, FormatError> {
        Ok(u8::from_le_bytes(self.array()?))
    }
    /// A u16.
    pub fn u16(&mut self) -> Result<u16, FormatError> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    /// A u32.
    pub fn u32(&mut self) -> Result<u32, FormatError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    /// A u64.
    pub fn u64(&mut self) -> Result<u64, FormatError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    /// An unsigned integer of `n` ≤ 8 bytes.
    pub fn uint(&mut self, n: usize) -> Result<u64, FormatError> {
        let raw = self.take(n)?;
        let mut buf = [0u8; 8];
        if let Some(dst) = buf.get_mut(..n) {
            dst.copy_from_slice(raw);
        }
        Ok(u64::from_le_bytes(buf))
    }
    /// 32 bytes.
    pub fn bytes32(&mut self) -> Result<[u8; 32], FormatError> {
        self.array()
    }
}

/// Writes little-endian fields into a byte slice. Panics are impossible: writes past
/// the end are a programming error caught by the `debug_assert` and otherwise dropped,
/// and every encoder sizes its buffer from the same constants it writes.
pub struct Writer<'a> {
    bytes: &'a mut [u8],
    pos: usize,
}

impl<'a> Writer<'a> {
    /// A writer over `bytes`.
    pub fn new(bytes: &'a mut [u8]) -> Self {
        Writer { bytes, pos: 0 }
    }
    /// Move to an absolute position.
    pub fn seek(&mut self, pos: usize) {
        self.pos = pos;
    }
    /// The current position.
    pub fn pos(&self) -> usize {
        self.pos
    }
    /// Write raw bytes.
    pub fn put(&mut self, src: &[u8]) {
        let end = self.pos + src.len();
        debug_assert!(end <= self.bytes.len(), "encoder overran its buffer");
        if let Some(dst) = self.bytes.get_mut(self.pos..end) {
            dst.copy_from_slice(src);
        }
        self.pos = end;
    }
    /// One byte.
    pub fn u8(&mut self, v: u8) {
        self.put(&[v]);
    }
    /// A u16.
    pub fn u16(&mut self, v: u16) {
        self.put(&v.to_le_bytes());
    }
    /// A u32.
    pub fn u32(&mut self, v: u32) {
        self.put(&v.to_le_bytes());
    }
    /// A u64.
    pub fn u64(&mut self, v: u64) {
        self.put(&v.to_le_bytes());
    }
    /// The low `n` ≤ 8 bytes of `v`.
    pub fn uint(&mut self, v: u64, n: usize) {
        let b = v.to_le_bytes();
        self.put(b.get(..n).unwrap_or(&b));
    }
}
