//! A send stream over the control socket: `volume send` and `volume receive` on a
//! pool a server holds. The server reads or writes the volume through its engine;
//! the command only carries bytes between its stdin/stdout and the connection.
//!
//! The request is one JSON line, as every control request (`SendVolume`,
//! `ReceiveVolume`); the server answers `Streaming` on one line, and from then on:
//!
//! - server to command: *frames*, a kind byte, a payload length (u32, little-endian)
//!   and the payload. Kind 1 carries bytes (a send's stream; a two-way receive's
//!   answer); kind 2, the last frame, carries the reply line (`Streamed` with the
//!   summary, or the error).
//! - command to server: raw bytes (a receive's stream; a two-way send's answer, which
//!   is self-delimiting), ended by shutting the connection's writing side.
//!
//! The stream's own format (docs/stream.md) is unchanged: a receive reads the same
//! bytes whether they come from stdin or the connection, so a cut connection is a
//! truncated stream, resumed as any other. A server runs one receive into a name at
//! a time, so a resume cannot meet the receive it resumes still applying records.

use anyhow::{bail, Context, Result};
use std::io::{BufRead, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;

use crate::control::{answer_of, Answer, ControlClient, Request};
use crate::stream_request::{ReceiveRequest, SendRequest};

/// A frame of stream bytes.
const FRAME_DATA: u8 = 1;
/// The last frame: the reply line.
pub(crate) const FRAME_REPLY: u8 = 2;
/// Largest frame payload: a frame is a buffer on each side, and the sender's
/// buffer drains at 1 MiB.
const FRAME_BYTES_MAX: usize = 4 << 20;
/// Bytes a command moves from its stdin (or a receiver's answer) per read.
const PUMP_BYTES: usize = 256 << 10;

/// Frames of kind 1 over a writer: what the server's send and answer write to.
pub(crate) struct FrameWriter<W: Write> {
    pub(crate) inner: W,
}

impl<W: Write> Write for FrameWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let len = buf.len().min(FRAME_BYTES_MAX);
        if len == 0 {
            return Ok(0);
        }
        write_frame(&mut self.inner, FRAME_DATA, &buf[..len])?;
        Ok(len)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

pub(crate) fn write_frame(out: &mut impl Write, kind: u8, payload: &[u8]) -> std::io::Result<()> {
    debug_assert!(payload.len() <= FRAME_BYTES_MAX);
    let mut head = [0u8; 5];
    head[0] = kind;
    head[1..].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    out.write_all(&head)?;
    out.write_all(payload)
}

/// A frame read by the command.
enum Frame {
    Data(Vec<u8>),
    Reply(String),
}

fn read_frame(input: &mut impl Read) -> Result<Frame> {
    let mut head = [0u8; 5];
    input.read_exact(&mut head).context(
        "the server closed the connection in the middle of the stream (its log says why)",
    )?;
    let mut len_bytes = [0u8; 4];
    len_bytes.copy_from_slice(&head[1..]);
    let len = u32::from_le_bytes(len_bytes) as usize;
    if len > FRAME_BYTES_MAX {
        bail!("the server sent a frame of {len} bytes, more than {FRAME_BYTES_MAX}");
    }
    let mut payload = vec![0u8; len];
    input
        .read_exact(&mut payload)
        .context("the server closed the connection in the middle of a frame")?;
    match head[0] {
        FRAME_DATA => Ok(Frame::Data(payload)),
        FRAME_REPLY => Ok(Frame::Reply(
            String::from_utf8(payload).context("the server's reply is not text")?,
        )),
        kind => bail!("the server sent a frame of unknown kind {kind}"),
    }
}

/// Copy `from` to the connection's writing side until `from` ends, then shut that
/// side: the server reads the end of the input there.
fn pump(mut from: impl Read, mut to: UnixStream) {
    let mut buffer = vec![0u8; PUMP_BYTES];
    loop {
        let n = match from.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::warn!("could not read the input to send to the server: {e}");
                break;
            }
        };
        // The server stopped reading (its reply says why): stop.
        if to.write_all(&buffer[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

/// Read the server's frames: bytes to `sink` (flushed at each frame, as an answer
/// must reach the sender while it waits), until the reply; its summary.
fn frames_to(reader: &mut impl BufRead, sink: &mut dyn Write, what: &str) -> Result<String> {
    loop {
        match read_frame(reader)? {
            Frame::Data(bytes) => sink
                .write_all(&bytes)
                .and_then(|()| sink.flush())
                .with_context(|| format!("could not write {what}"))?,
            Frame::Reply(line) => {
                return match answer_of(&line)? {
                    Answer::Streamed(summary) => Ok(summary),
                    other => bail!("the server ended the stream with {other:?}"),
                }
            }
        }
    }
}

/// The command's side of `volume send` on a served pool: the stream's frames to
/// `sink`; in two-way mode the receiver's `answers` to the server.
pub fn send_through(
    client: &ControlClient,
    request: &SendRequest,
    mut sink: Box<dyn Write + Send>,
    answers: Option<Box<dyn Read + Send>>,
) -> Result<String> {
    ignore_sigpipe();
    let (mut reader, writer) = client.open_stream(&Request::SendVolume(request.clone()))?;
    match answers {
        Some(answers) => {
            std::thread::Builder::new()
                .name("send-answer".into())
                .spawn(move || pump(answers, writer))
                .context("could not start the thread that carries the answer")?;
        }
        None => {
            let _ = writer.shutdown(Shutdown::Write);
        }
    }
    frames_to(&mut reader, &mut sink, "the stream")
}

/// The command's side of `volume receive` on a served pool: stdin to the server,
/// a two-way receive's answer from it to stdout.
pub fn receive_through(client: &ControlClient, request: &ReceiveRequest) -> Result<String> {
    ignore_sigpipe();
    let (mut reader, writer) = client.open_stream(&Request::ReceiveVolume(request.clone()))?;
    if request.abandon {
        let _ = writer.shutdown(Shutdown::Write);
    } else {
        // Not joined: when the server stops early (a refused base), stdin may
        // still be open, and the command ends with the server's reply.
        std::thread::Builder::new()
            .name("receive-input".into())
            .spawn(move || pump(std::io::stdin().lock(), writer))
            .context("could not start the thread that carries the stream")?;
    }
    frames_to(&mut reader, &mut std::io::stdout(), "the answer to stdout")
}

/// A server that stopped reading must cost an error (EPIPE), not end the command
/// silently by SIGPIPE.
fn ignore_sigpipe() {
    // SAFETY: setting a signal disposition; no handler runs.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
}
