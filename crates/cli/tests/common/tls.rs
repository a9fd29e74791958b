//! TLS credentials made at test time with the `openssl` tool: a CA, a server
//! certificate laid out as `serve --tls-certificates` reads it, client certificates
//! laid out as libnbd's `tls-certificates=` and qemu's `tls-creds-x509` read them, and
//! psktool-format PSK files.

use super::{run_ok, tool};
use std::path::{Path, PathBuf};

/// A certificate authority: its key and certificate in `dir`.
pub struct Ca {
    pub dir: PathBuf,
}

impl Ca {
    /// A new CA named `name`, in `dir` (created).
    pub fn new(dir: &Path, name: &str) -> Ca {
        std::fs::create_dir_all(dir).expect("CA dir");
        run_ok(
            tool("openssl")
                .args(["req", "-x509", "-newkey", "ec", "-pkeyopt"])
                .args([
                    "ec_paramgen_curve:P-256",
                    "-nodes",
                    "-days",
                    "2",
                    "-subj",
                    &format!("/CN={name}"),
                    "-keyout",
                ])
                .arg(dir.join("ca-key.pem"))
                .arg("-out")
                .arg(dir.join("ca-cert.pem")),
        );
        Ca {
            dir: dir.to_path_buf(),
        }
    }

    /// `ca-cert.pem`.
    pub fn cert(&self) -> PathBuf {
        self.dir.join("ca-cert.pem")
    }

    /// A certificate for `cn` signed by this CA, in `out` (created) with the CA's
    /// certificate beside it, named `{prefix}-cert.pem` and `{prefix}-key.pem`
    /// (`server` or `client`). A server certificate names localhost and 127.0.0.1.
    pub fn issue(&self, out: &Path, cn: &str, prefix: &str) -> PathBuf {
        std::fs::create_dir_all(out).expect("certificate dir");
        let key = out.join(format!("{prefix}-key.pem"));
        let request = out.join(format!("{prefix}-req.pem"));
        let cert = out.join(format!("{prefix}-cert.pem"));
        let extensions = out.join(format!("{prefix}-ext.cnf"));
        run_ok(
            tool("openssl")
                .args(["req", "-newkey", "ec", "-pkeyopt"])
                .args([
                    "ec_paramgen_curve:P-256",
                    "-nodes",
                    "-subj",
                    &format!("/CN={cn}"),
                    "-keyout",
                ])
                .arg(&key)
                .arg("-out")
                .arg(&request),
        );
        let usage = if prefix == "server" {
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"
        } else {
            "extendedKeyUsage=clientAuth\n"
        };
        std::fs::write(&extensions, usage).expect("extensions");
        run_ok(
            tool("openssl")
                .args(["x509", "-req", "-days", "2", "-CAcreateserial", "-in"])
                .arg(&request)
                .arg("-CA")
                .arg(self.cert())
                .arg("-CAkey")
                .arg(self.dir.join("ca-key.pem"))
                .arg("-out")
                .arg(&cert)
                .arg("-extfile")
                .arg(&extensions),
        );
        std::fs::copy(self.cert(), out.join("ca-cert.pem")).expect("copy the CA certificate");
        out.to_path_buf()
    }
}

/// A PSK file in psktool's format (`identity:hexkey` lines) with a fresh random
/// 32-byte key for each identity, at `path`.
pub fn psk_file(path: &Path, identities: &[&str]) -> PathBuf {
    let mut text = String::new();
    for identity in identities {
        let key = run_ok(tool("openssl").args(["rand", "-hex", "32"]));
        text.push_str(&format!("{identity}:{}\n", key.stdout.trim()));
    }
    std::fs::write(path, text).expect("PSK file");
    path.to_path_buf()
}
