//! What `volume send` and `volume receive` are asked for: the same on the command
//! line and over the control socket (`control.rs`'s `SendVolume` and
//! `ReceiveVolume`), so the control protocol names them without depending on the
//! code that runs them (`send.rs`, `receive.rs`, `stream_serve.rs`).

use fewerbytes_engine::Provisioning;
use serde::{Deserialize, Serialize};

/// What a send is asked for: the same on the command line and over the control
/// socket.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SendRequest {
    /// The volume sent.
    pub name: String,
    /// The base of an incremental stream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    /// `--resume-token`: the key, and the first record written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume_token: Option<String>,
    /// Two-way mode: offers go out first and the answer comes back on `answers`.
    #[serde(default)]
    pub negotiated: bool,
}

/// How `volume receive` was asked to run: the same on the command line and over
/// the control socket.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReceiveRequest {
    /// The new volume's name.
    pub name: String,
    /// The base of an incremental stream, when not the name the stream carries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    /// Continue a receive that stopped.
    #[serde(default)]
    pub resume: bool,
    /// Discard a receive that stopped.
    #[serde(default)]
    pub abandon: bool,
    /// What the new volume reserves (as `volume create` and `volume clone`).
    #[serde(default)]
    pub provisioning: Provisioning,
    /// Two-way mode: the volumes whose blocks answer the sender's offers.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub negotiate_with: Vec<String>,
    /// Updating NAME in place: discard what was written to it since its base
    /// snapshot (refused otherwise).
    #[serde(default)]
    pub force: bool,
}
