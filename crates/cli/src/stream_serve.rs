//! The server's side of a send stream over the control socket (`stream_socket.rs`
//! has the frames and the command's side): a `SendVolume` or `ReceiveVolume`
//! request run through the server's engine, its bytes in frames, its reply the
//! last frame.

use anyhow::{bail, Result};
use fewerbytes_engine::Pool;
use std::collections::HashSet;
use std::io::Read;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Arc, Mutex};

use crate::control::{Answer, Reply, Request};
use crate::receive::receive_into_pool;
use crate::send::send_from_pool;
use crate::stream_socket::{write_frame, FrameWriter, FRAME_REPLY};

/// Names a receive on this server is writing: a second receive into one (a resume
/// sent while the cut one still applies what reached it) is refused.
static RECEIVING: Mutex<Option<HashSet<String>>> = Mutex::new(None);

/// A name held in `RECEIVING` while a receive runs.
struct ReceivingName(String);

impl ReceivingName {
    fn take(name: &str) -> Result<ReceivingName> {
        let mut names = RECEIVING.lock().unwrap_or_else(|e| e.into_inner());
        if !names
            .get_or_insert_with(HashSet::new)
            .insert(name.to_string())
        {
            bail!(
                "a receive into '{name}' is running on this server; wait for it to stop \
                 (a cut stream stops it), then resume"
            );
        }
        Ok(ReceivingName(name.to_string()))
    }
}

impl Drop for ReceivingName {
    fn drop(&mut self) {
        let mut names = RECEIVING.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(names) = names.as_mut() {
            names.remove(&self.0);
        }
    }
}

/// The server's side of a streaming request, after the `Streaming` line: run it,
/// then write the reply frame. An error is the reply, not this function's.
pub fn serve(stream: &UnixStream, pool: &Arc<Pool>, pool_path: &Path, request: &Request) {
    let result = match request {
        Request::SendVolume(send) => {
            let mut sink = FrameWriter { inner: stream };
            let mut answers = stream;
            let answers = send.negotiated.then_some(&mut answers as &mut dyn Read);
            send_from_pool(pool, send, &mut sink, answers)
        }
        Request::ReceiveVolume(receive) => ReceivingName::take(&receive.name).and_then(|_held| {
            let mut input = stream;
            let mut answer_out = FrameWriter { inner: stream };
            receive_into_pool(pool, pool_path, receive, &mut input, &mut answer_out)
        }),
        other => Err(anyhow::anyhow!("{} does not stream", other.in_words())),
    };
    let what = request.in_words();
    let reply = match result {
        Ok(summary) => {
            tracing::info!("control: {what}: {summary}");
            Reply {
                ok: true,
                value: Some(Answer::Streamed(summary)),
                error: None,
                wrong_pool: false,
            }
        }
        Err(e) => {
            tracing::info!("control: {what}: stopped: {e:#}");
            Reply {
                ok: false,
                value: None,
                error: Some(format!("{e:#}")),
                wrong_pool: false,
            }
        }
    };
    let line = serde_json::to_string(&reply).unwrap_or_else(|e| {
        format!(r#"{{"ok":false,"error":"the reply could not be encoded: {e}"}}"#)
    });
    if let Err(e) = write_frame(&mut &*stream, FRAME_REPLY, line.as_bytes()) {
        tracing::warn!("control: {what}: the command left before the reply: {e}");
    }
}
