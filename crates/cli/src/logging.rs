//! Logs: what is logged (the level filter) and how it looks on stderr.
//!
//! The filter is, first found wins: `--log-level LEVEL`; `$FEWERBYTES_LOG`, then
//! `$RUST_LOG` (both take `tracing` directives such as `info,fewerbytes_nbd=debug`);
//! else `info` for `serve` and `warn` for the other commands. The flag wins because it
//! is the most specific thing a person typed; the variables allow per-crate levels.
//!
//! Logs always go to stderr, which a service manager hands to its journal. Under
//! systemd (`$JOURNAL_STREAM` names the very file stderr is) each line starts with the
//! syslog priority systemd reads (`<3>` error, `<4>` warning, `<6>` info, `<7>` debug
//! and trace; see `SyslogLevelPrefix=` in systemd.exec(5)) and carries no timestamp and
//! no colour: the journal stamps and colours lines itself.
//!
//! `--log-format json` (or `$FEWERBYTES_LOG_FORMAT=json`) writes one JSON object per
//! line instead — `time_unix_ms`, `level`, `target`, `message` and the event's other
//! fields — for log collectors; under systemd the `<N>` priority still comes first.

use std::fmt;
use std::io::IsTerminal;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicBool, Ordering};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

/// `--log-level`: the least severe level logged.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum LogLevel {
    /// Failures only.
    Error,
    /// Failures and what a person should look at.
    Warn,
    /// What the server does: listening, connections refused, stopping.
    Info,
    /// Each connection, negotiation and control request.
    Debug,
    /// Everything.
    Trace,
}

impl LogLevel {
    fn directive(self) -> &'static str {
        match self {
            LogLevel::Error => "error",
            LogLevel::Warn => "warn",
            LogLevel::Info => "info",
            LogLevel::Debug => "debug",
            LogLevel::Trace => "trace",
        }
    }
}

/// `--log-format`: how each log line looks.
#[derive(Clone, Copy, Debug, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// Text for people (the default).
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Whether stderr is the journal's stream, decided once by [`init`].
static TO_JOURNAL: AtomicBool = AtomicBool::new(false);

/// What starts a line written to stderr outside `tracing` that reports an error (the
/// command's final error): the journal's priority for errors, `<3>`, when stderr goes
/// there, else nothing.
pub fn error_line_prefix() -> &'static str {
    if TO_JOURNAL.load(Ordering::Relaxed) {
        "<3>"
    } else {
        ""
    }
}

/// What starts the line a command stopped by a signal writes last (not an error: the
/// user asked for the stop): the journal's priority for warnings, `<4>`, when stderr
/// goes there, else nothing.
pub fn warning_line_prefix() -> &'static str {
    if TO_JOURNAL.load(Ordering::Relaxed) {
        "<4>"
    } else {
        ""
    }
}

/// Install the logger for this process.
pub fn init(level: Option<LogLevel>, format: LogFormat, default_level: &str) {
    let filter = match level {
        Some(level) => EnvFilter::new(level.directive()),
        None => EnvFilter::try_from_env("FEWERBYTES_LOG")
            .or_else(|_| EnvFilter::try_from_env("RUST_LOG"))
            .unwrap_or_else(|_| EnvFilter::new(default_level)),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let journal = stderr_is_journal();
    TO_JOURNAL.store(journal, Ordering::Relaxed);
    if let LogFormat::Json = format {
        let builder = builder.with_ansi(false);
        if journal {
            builder.event_format(SyslogPrefix(JsonLines)).init();
        } else {
            builder.event_format(JsonLines).init();
        }
        return;
    }
    if journal {
        let format = tracing_subscriber::fmt::format()
            .without_time()
            .with_ansi(false);
        builder
            .with_ansi(false)
            .event_format(SyslogPrefix(format))
            .init();
    } else {
        builder
            .with_ansi(std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none())
            .init();
    }
}

/// Whether stderr is connected to the journal: systemd sets `$JOURNAL_STREAM` to the
/// device and inode of the stream it gave the service, and a process whose stderr is
/// something else (redirected by a script the service runs) must not take it.
fn stderr_is_journal() -> bool {
    let Some(value) = std::env::var_os("JOURNAL_STREAM") else {
        return false;
    };
    let Ok(stderr) = std::io::stderr().as_fd().try_clone_to_owned() else {
        return false;
    };
    let Ok(metadata) = std::fs::File::from(stderr).metadata() else {
        return false;
    };
    journal_stream_is(&value.to_string_lossy(), metadata.dev(), metadata.ino())
}

/// `$JOURNAL_STREAM` is `DEVICE:INODE`, both decimal.
fn journal_stream_is(value: &str, dev: u64, ino: u64) -> bool {
    let Some((dev_text, ino_text)) = value.split_once(':') else {
        return false;
    };
    dev_text.parse::<u64>() == Ok(dev) && ino_text.parse::<u64>() == Ok(ino)
}

/// The syslog priority systemd understands at the start of a line.
fn syslog_priority(level: Level) -> u8 {
    match level {
        Level::ERROR => 3,
        Level::WARN => 4,
        Level::INFO => 6,
        Level::DEBUG | Level::TRACE => 7,
    }
}

/// An event format with `<N>` (the syslog priority) in front.
struct SyslogPrefix<F>(F);

impl<S, N, F> FormatEvent<S, N> for SyslogPrefix<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        write!(writer, "<{}>", syslog_priority(*event.metadata().level()))?;
        self.0.format_event(ctx, writer, event)
    }
}

/// An event as one JSON object on one line.
struct JsonLines;

impl<S, N> FormatEvent<S, N> for JsonLines
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        _ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let time_unix_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let mut object = serde_json::Map::new();
        object.insert("time_unix_ms".into(), time_unix_ms.into());
        object.insert(
            "level".into(),
            event
                .metadata()
                .level()
                .as_str()
                .to_ascii_lowercase()
                .into(),
        );
        object.insert("target".into(), event.metadata().target().into());
        let mut fields = JsonFields(object);
        event.record(&mut fields);
        writeln!(writer, "{}", serde_json::Value::Object(fields.0))
    }
}

/// An event's fields, collected as JSON values.
struct JsonFields(serde_json::Map<String, serde_json::Value>);

impl tracing::field::Visit for JsonFields {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn fmt::Debug) {
        self.0
            .insert(field.name().into(), format!("{value:?}").into());
    }

    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_i64(&mut self, field: &tracing::field::Field, value: i64) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_bool(&mut self, field: &tracing::field::Field, value: bool) {
        self.0.insert(field.name().into(), value.into());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_journal_is_recognised_by_device_and_inode_only() {
        assert!(journal_stream_is("8:1234", 8, 1234));
        assert!(!journal_stream_is("8:1234", 8, 1235));
        assert!(!journal_stream_is("9:1234", 8, 1234));
        assert!(!journal_stream_is("", 8, 1234));
        assert!(!journal_stream_is("8-1234", 8, 1234));
    }

    #[test]
    fn priorities_are_syslogs() {
        assert_eq!(syslog_priority(Level::ERROR), 3);
        assert_eq!(syslog_priority(Level::WARN), 4);
        assert_eq!(syslog_priority(Level::INFO), 6);
        assert_eq!(syslog_priority(Level::DEBUG), 7);
        assert_eq!(syslog_priority(Level::TRACE), 7);
    }
}
