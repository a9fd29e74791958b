//! Reading what `volume send` and `volume receive` say on stderr.

use super::Ran;

/// The number before `what` in a summary line ("N the receiver held", "N blocks of
/// data").
pub fn count_before(ran: &Ran, what: &str) -> u64 {
    let end = ran
        .stderr
        .find(what)
        .unwrap_or_else(|| panic!("no '{what}':\n{}", ran.report()));
    ran.stderr[..end]
        .trim_end()
        .rsplit(|c: char| !c.is_ascii_digit())
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count before '{what}':\n{}", ran.report()))
}

/// The token a cut send or receive printed for `--resume-token`.
pub fn resume_token(ran: &Ran) -> String {
    let at = ran
        .stderr
        .find("--resume-token ")
        .unwrap_or_else(|| panic!("no token:\n{}", ran.report()));
    ran.stderr[at + "--resume-token ".len()..]
        .split_whitespace()
        .next()
        .expect("token")
        .trim_end_matches(|c: char| !c.is_ascii_alphanumeric())
        .to_string()
}
