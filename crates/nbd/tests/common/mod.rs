//! A hand-built NBD client for the raw-socket tests: every byte it sends is
//! written here, so tests can send exactly the malformed input they mean to.

#![allow(dead_code)]

use fewerbytes_nbd::protocol::*;
use fewerbytes_nbd::{
    Export, ExportDesc, ExportProvider, MemoryExport, MemoryExports, Server, ServerConfig,
};
use parking_lot::{Condvar, Mutex};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Size of the test exports.
pub const EXPORT_BYTES: usize = 4 << 20;

/// A server on loopback TCP with two in-memory exports, "a" (the default) and "b".
pub struct TestServer {
    pub server: Arc<Server>,
    pub addr: SocketAddr,
    pub a: Arc<MemoryExport>,
    pub b: Arc<MemoryExport>,
}

impl TestServer {
    pub fn start() -> TestServer {
        TestServer::with_config(ServerConfig::default())
    }

    pub fn with_config(config: ServerConfig) -> TestServer {
        let a = Arc::new(MemoryExport::new(EXPORT_BYTES));
        let b = Arc::new(MemoryExport::new(EXPORT_BYTES));
        let provider = MemoryExports::new(vec![
            ("a".to_string(), Arc::clone(&a)),
            ("b".to_string(), Arc::clone(&b)),
        ]);
        TestServer::with_provider(config, Arc::new(provider), a, b)
    }

    pub fn with_provider(
        config: ServerConfig,
        provider: Arc<dyn ExportProvider>,
        a: Arc<MemoryExport>,
        b: Arc<MemoryExport>,
    ) -> TestServer {
        let server = Server::new(config, provider);
        let addr = server.listen_tcp("127.0.0.1:0").expect("listen");
        TestServer { server, addr, a, b }
    }

    pub fn connect(&self) -> Client {
        Client::connect(self.addr)
    }

    /// A well-behaved client must still be served: negotiate, write, read back.
    pub fn assert_healthy(&self) {
        let mut c = self.connect();
        c.handshake();
        c.go("b", &[]).expect("GO on a healthy server");
        let data = vec![0x5au8; 4096];
        c.send_request(0, CMD_WRITE, 900, 4096 * 3, 4096, &data);
        assert_eq!(c.simple_reply(), (0, 900));
        c.send_request(0, CMD_READ, 901, 4096 * 3, 4096, &[]);
        assert_eq!(c.simple_reply(), (0, 901));
        assert_eq!(c.read_bytes(4096), data);
        c.disconnect();
    }

    /// Wait until every connection has ended.
    pub fn wait_idle(&self) {
        for _ in 0..500 {
            if self.server.connections() == 0 {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("connections did not end: {}", self.server.connections());
    }
}

/// Replies to one GO/INFO: (info items, final reply type, final data).
#[derive(Debug)]
pub struct GoReply {
    pub infos: Vec<Vec<u8>>,
}

impl GoReply {
    /// The INFO item of `kind`, without its type field.
    pub fn info(&self, kind: u16) -> Option<&[u8]> {
        self.infos
            .iter()
            .find(|i| i.len() >= 2 && u16::from_be_bytes([i[0], i[1]]) == kind)
            .map(|i| &i[2..])
    }

    pub fn size_and_flags(&self) -> (u64, u16) {
        let e = self.info(INFO_EXPORT).expect("NBD_INFO_EXPORT");
        assert_eq!(e.len(), 10);
        (
            u64::from_be_bytes(e[0..8].try_into().unwrap()),
            u16::from_be_bytes(e[8..10].try_into().unwrap()),
        )
    }
}

/// A structured or extended reply chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    pub flags: u16,
    pub kind: u16,
    pub cookie: u64,
    /// The extended header's offset field (0 for structured chunks).
    pub offset: u64,
    pub payload: Vec<u8>,
}

pub struct Client {
    pub s: TcpStream,
    pub extended: bool,
}

impl Client {
    pub fn connect(addr: SocketAddr) -> Client {
        let s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        Client { s, extended: false }
    }

    pub fn read_bytes(&mut self, n: usize) -> Vec<u8> {
        let mut b = vec![0u8; n];
        self.s.read_exact(&mut b).expect("read from server");
        b
    }

    pub fn u16(&mut self) -> u16 {
        u16::from_be_bytes(self.read_bytes(2).try_into().unwrap())
    }
    pub fn u32(&mut self) -> u32 {
        u32::from_be_bytes(self.read_bytes(4).try_into().unwrap())
    }
    pub fn u64(&mut self) -> u64 {
        u64::from_be_bytes(self.read_bytes(8).try_into().unwrap())
    }

    pub fn send(&mut self, bytes: &[u8]) {
        self.s.write_all(bytes).expect("send");
    }

    /// The server closed the connection (EOF or reset) without sending more.
    pub fn assert_dropped(&mut self) {
        let mut b = [0u8; 1];
        match self.s.read(&mut b) {
            Ok(0) | Err(_) => {}
            Ok(_) => panic!("server sent data instead of dropping the connection"),
        }
    }

    /// Read the greeting and answer with client flags FIXED_NEWSTYLE | NO_ZEROES.
    pub fn handshake(&mut self) {
        self.handshake_with_flags(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
    }

    pub fn handshake_with_flags(&mut self, flags: u32) {
        assert_eq!(self.u64(), NBD_MAGIC);
        assert_eq!(self.u64(), IHAVEOPT);
        assert_eq!(self.u16(), FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
        self.send(&flags.to_be_bytes());
    }

    pub fn send_option(&mut self, option: u32, data: &[u8]) {
        let mut b = Vec::new();
        b.extend_from_slice(&IHAVEOPT.to_be_bytes());
        b.extend_from_slice(&option.to_be_bytes());
        b.extend_from_slice(&(data.len() as u32).to_be_bytes());
        b.extend_from_slice(data);
        self.send(&b);
    }

    /// One option reply: (reply type, data); checks magic and option echo.
    pub fn option_reply(&mut self, option: u32) -> (u32, Vec<u8>) {
        assert_eq!(self.u64(), OPTION_REPLY_MAGIC);
        assert_eq!(self.u32(), option);
        let kind = self.u32();
        let len = self.u32() as usize;
        (kind, self.read_bytes(len))
    }

    /// Send an option that takes no data and expect an ACK.
    pub fn option_ack(&mut self, option: u32) {
        self.send_option(option, &[]);
        let (kind, data) = self.option_reply(option);
        assert_eq!(
            kind,
            REP_ACK,
            "option {option}: {}",
            String::from_utf8_lossy(&data)
        );
    }

    pub fn info_data(name: &str, requests: &[u16]) -> Vec<u8> {
        let mut d = Vec::new();
        d.extend_from_slice(&(name.len() as u32).to_be_bytes());
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&(requests.len() as u16).to_be_bytes());
        for r in requests {
            d.extend_from_slice(&r.to_be_bytes());
        }
        d
    }

    /// NBD_OPT_GO or NBD_OPT_INFO; Err(reply type) on an error reply.
    pub fn info_or_go(
        &mut self,
        option: u32,
        name: &str,
        requests: &[u16],
    ) -> Result<GoReply, (u32, String)> {
        self.send_option(option, &Client::info_data(name, requests));
        let mut infos = Vec::new();
        loop {
            let (kind, data) = self.option_reply(option);
            match kind {
                REP_INFO => infos.push(data),
                REP_ACK => return Ok(GoReply { infos }),
                err => return Err((err, String::from_utf8_lossy(&data).into_owned())),
            }
        }
    }

    pub fn go(&mut self, name: &str, requests: &[u16]) -> Result<GoReply, (u32, String)> {
        self.info_or_go(OPT_GO, name, requests)
    }

    pub fn meta_data(name: &str, queries: &[&str]) -> Vec<u8> {
        let mut d = Vec::new();
        d.extend_from_slice(&(name.len() as u32).to_be_bytes());
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&(queries.len() as u32).to_be_bytes());
        for q in queries {
            d.extend_from_slice(&(q.len() as u32).to_be_bytes());
            d.extend_from_slice(q.as_bytes());
        }
        d
    }

    /// LIST/SET_META_CONTEXT: the contexts replied, then the final reply type.
    pub fn meta_context(
        &mut self,
        option: u32,
        name: &str,
        queries: &[&str],
    ) -> (Vec<(u32, String)>, u32) {
        self.send_option(option, &Client::meta_data(name, queries));
        let mut contexts = Vec::new();
        loop {
            let (kind, data) = self.option_reply(option);
            if kind == REP_META_CONTEXT {
                let id = u32::from_be_bytes(data[0..4].try_into().unwrap());
                contexts.push((id, String::from_utf8(data[4..].to_vec()).unwrap()));
            } else {
                return (contexts, kind);
            }
        }
    }

    /// Send a request (compact or extended, per `self.extended`) and its payload.
    pub fn send_request(
        &mut self,
        flags: u16,
        kind: u16,
        cookie: u64,
        offset: u64,
        len: u64,
        payload: &[u8],
    ) {
        let mut b = Vec::with_capacity(32 + payload.len());
        if self.extended {
            b.extend_from_slice(&EXTENDED_REQUEST_MAGIC.to_be_bytes());
        } else {
            b.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        }
        b.extend_from_slice(&flags.to_be_bytes());
        b.extend_from_slice(&kind.to_be_bytes());
        b.extend_from_slice(&cookie.to_be_bytes());
        b.extend_from_slice(&offset.to_be_bytes());
        if self.extended {
            b.extend_from_slice(&len.to_be_bytes());
        } else {
            b.extend_from_slice(&(len as u32).to_be_bytes());
        }
        b.extend_from_slice(payload);
        self.send(&b);
    }

    /// A simple reply: (error, cookie). The caller reads any read payload.
    pub fn simple_reply(&mut self) -> (u32, u64) {
        assert_eq!(self.u32(), SIMPLE_REPLY_MAGIC, "not a simple reply");
        let error = self.u32();
        (error, self.u64())
    }

    /// One structured (or extended, per `self.extended`) chunk.
    pub fn chunk(&mut self) -> Chunk {
        let magic = self.u32();
        self.chunk_after_magic(magic)
    }

    /// Under structured replies the server may answer a command without payload
    /// with a simple reply: read whichever comes. A simple reply is returned as a
    /// NONE chunk (or an ERROR chunk carrying its error value).
    pub fn reply_as_chunk(&mut self) -> Chunk {
        let magic = self.u32();
        if magic != SIMPLE_REPLY_MAGIC {
            return self.chunk_after_magic(magic);
        }
        let error = self.u32();
        let cookie = self.u64();
        if error == 0 {
            return Chunk {
                flags: REPLY_FLAG_DONE,
                kind: REPLY_TYPE_NONE,
                cookie,
                offset: 0,
                payload: Vec::new(),
            };
        }
        let mut payload = error.to_be_bytes().to_vec();
        payload.extend_from_slice(&[0, 0]);
        Chunk {
            flags: REPLY_FLAG_DONE,
            kind: REPLY_TYPE_ERROR,
            cookie,
            offset: 0,
            payload,
        }
    }

    fn chunk_after_magic(&mut self, magic: u32) -> Chunk {
        let flags = self.u16();
        let kind = self.u16();
        let cookie = self.u64();
        let (offset, len) = if self.extended {
            assert_eq!(magic, EXTENDED_REPLY_MAGIC, "not an extended reply");
            (self.u64(), self.u64())
        } else {
            assert_eq!(magic, STRUCTURED_REPLY_MAGIC, "not a structured reply");
            (0, u64::from(self.u32()))
        };
        let payload = self.read_bytes(len as usize);
        Chunk {
            flags,
            kind,
            cookie,
            offset,
            payload,
        }
    }

    /// Chunks up to and including the one flagged DONE.
    pub fn chunks(&mut self) -> Vec<Chunk> {
        let mut out = Vec::new();
        loop {
            let c = self.chunk();
            let done = c.flags & REPLY_FLAG_DONE != 0;
            out.push(c);
            if done {
                return out;
            }
        }
    }

    pub fn disconnect(&mut self) {
        self.send_request(0, CMD_DISC, 0, 0, 0, &[]);
        self.assert_dropped();
    }
}

/// The error value of an ERROR chunk.
pub fn chunk_error(c: &Chunk) -> u32 {
    assert_eq!(c.kind, REPLY_TYPE_ERROR, "not an error chunk: {c:?}");
    u32::from_be_bytes(c.payload[0..4].try_into().unwrap())
}

/// An export whose reads of one offset wait for a gate: to hold a request in
/// flight for as long as a test needs.
pub struct GatedExport {
    pub inner: Arc<MemoryExport>,
    pub gated_offset: u64,
    pub open: Mutex<bool>,
    pub opened: Condvar,
    pub waiting: Mutex<usize>,
    /// Writes at this offset wait at the gate too (none unless set).
    pub gated_write_offset: Mutex<Option<u64>>,
}

impl GatedExport {
    pub fn new(inner: Arc<MemoryExport>, gated_offset: u64) -> Arc<GatedExport> {
        Arc::new(GatedExport {
            inner,
            gated_offset,
            open: Mutex::new(false),
            opened: Condvar::new(),
            waiting: Mutex::new(0),
            gated_write_offset: Mutex::new(None),
        })
    }

    pub fn open_gate(&self) {
        *self.open.lock() = true;
        self.opened.notify_all();
    }

    /// Block until the gate opens (counted in `waiting`).
    fn wait_at_gate(&self) {
        *self.waiting.lock() += 1;
        let mut open = self.open.lock();
        while !*open {
            self.opened.wait(&mut open);
        }
        drop(open);
        *self.waiting.lock() -= 1;
    }

    /// Requests waiting at the gate now.
    pub fn waiting(&self) -> usize {
        *self.waiting.lock()
    }

    pub fn wait_for_waiting(&self, n: usize) {
        for _ in 0..1000 {
            if self.waiting() >= n {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        panic!(
            "only {} requests reached the gate, expected {n}",
            self.waiting()
        );
    }
}

impl Export for GatedExport {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), u32> {
        if offset == self.gated_offset {
            self.wait_at_gate();
        }
        self.inner.read(offset, buf)
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), u32> {
        if *self.gated_write_offset.lock() == Some(offset) {
            self.wait_at_gate();
        }
        self.inner.write(offset, data, fua)
    }
    fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<(), u32> {
        self.inner.write_zeroes(offset, len, fua)
    }
    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<(), u32> {
        self.inner.trim(offset, len, fua)
    }
    fn flush(&self) -> Result<(), u32> {
        self.inner.flush()
    }
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<(u64, bool)>, u32> {
        self.inner.extents(offset, len)
    }
}

/// A provider serving one gated export as "g".
pub struct GatedProvider(pub Arc<GatedExport>);

impl ExportProvider for GatedProvider {
    fn list(&self) -> Vec<ExportDesc> {
        vec![ExportDesc {
            name: "g".into(),
            description: "gated".into(),
            size_bytes: self.0.size_bytes(),
        }]
    }
    fn default_name(&self) -> Option<String> {
        Some("g".into())
    }
    fn open(&self, name: &str) -> Result<Arc<dyn Export>, String> {
        if name == "g" {
            Ok(self.0.clone())
        } else {
            Err(format!("no export '{name}'"))
        }
    }
}

/// A server over one gated export "g".
pub fn gated_server(config: ServerConfig, gated_offset: u64) -> (TestServer, Arc<GatedExport>) {
    let inner = Arc::new(MemoryExport::new(EXPORT_BYTES));
    let gated = GatedExport::new(Arc::clone(&inner), gated_offset);
    let provider = Arc::new(GatedProvider(Arc::clone(&gated)));
    let t = TestServer::with_provider(config, provider, Arc::clone(&inner), inner);
    (t, gated)
}

/// A directory under the system temp dir, removed with everything in it on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!(
            "fewerbytes-nbd-{tag}-{}-{:?}",
            std::process::id(),
            std::time::SystemTime::now()
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
