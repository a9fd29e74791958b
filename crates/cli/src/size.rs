//! Sizes as people type and read them: `512`, `4K`, `64M`, `10G`, `1.5T`, `16GiB`.
//!
//! Every unit is binary (K = KiB = 1024 bytes), as in lvcreate and qemu-img: a VM
//! disk of "10G" is 10 GiB everywhere in this tool.

use anyhow::{bail, Context, Result};

const KIB: u64 = 1024;

/// Parse a size: a number (optionally with a decimal fraction) and an optional
/// binary unit: B, K/KB/KiB, M/MB/MiB, G/GB/GiB, T/TB/TiB, P/PB/PiB (any case).
pub fn parse_size(text: &str) -> Result<u64> {
    let trimmed = text.trim();
    let split_at = trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split_at);
    if number.is_empty() {
        bail!("'{text}' is not a size (examples: 512, 4K, 64M, 10G, 1T)");
    }
    let multiplier = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => KIB,
        "m" | "mb" | "mib" => KIB.pow(2),
        "g" | "gb" | "gib" => KIB.pow(3),
        "t" | "tb" | "tib" => KIB.pow(4),
        "p" | "pb" | "pib" => KIB.pow(5),
        other => bail!("'{text}' has an unknown unit '{other}' (use K, M, G, T: binary units)"),
    };
    let (whole, fraction) = match number.split_once('.') {
        Some((w, f)) => (w, f),
        None => (number, ""),
    };
    let whole: u64 = if whole.is_empty() {
        0
    } else {
        whole
            .parse()
            .with_context(|| format!("'{text}' is not a size"))?
    };
    let mut bytes = whole
        .checked_mul(multiplier)
        .with_context(|| format!("'{text}' is too large"))?;
    if !fraction.is_empty() {
        // Decimal fraction of the unit, computed exactly in integers; at most 9
        // digits so the numerator cannot overflow.
        if fraction.len() > 9 || !fraction.bytes().all(|b| b.is_ascii_digit()) {
            bail!("'{text}' is not a size");
        }
        let numerator: u128 = fraction
            .parse()
            .with_context(|| format!("'{text}' is not a size"))?;
        let denominator = 10u128.pow(fraction.len() as u32);
        let extra = numerator * u128::from(multiplier) / denominator;
        let extra = u64::try_from(extra).with_context(|| format!("'{text}' is too large"))?;
        bytes = bytes
            .checked_add(extra)
            .with_context(|| format!("'{text}' is too large"))?;
    }
    Ok(bytes)
}

/// For clap's `value_parser`.
pub fn parse_size_arg(text: &str) -> std::result::Result<u64, String> {
    parse_size(text).map_err(|e| format!("{e:#}"))
}

/// Human-readable, binary units, two decimals: `512 B`, `4.00 KiB`, `9.61 GiB`.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if bytes < KIB {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / KIB as f64;
    let mut unit = UNITS[0];
    for next in &UNITS[1..] {
        if value < 1024.0 {
            break;
        }
        value /= 1024.0;
        unit = next;
    }
    format!("{value:.2} {unit}")
}

/// Round `value` up to a multiple of `step` (a power of two or any non-zero step).
pub fn round_up(value: u64, step: u64) -> u64 {
    value.div_ceil(step).saturating_mul(step)
}

/// Round `value` down to a multiple of `step`.
pub fn round_down(value: u64, step: u64) -> u64 {
    value / step * step
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_examples() {
        assert_eq!(parse_size("512").unwrap(), 512);
        assert_eq!(parse_size("4K").unwrap(), 4096);
        assert_eq!(parse_size("64M").unwrap(), 64 << 20);
        assert_eq!(parse_size("10G").unwrap(), 10 << 30);
        assert_eq!(parse_size("1T").unwrap(), 1 << 40);
        assert_eq!(parse_size("16GiB").unwrap(), 16 << 30);
        assert_eq!(parse_size("2 MiB").unwrap(), 2 << 20);
        assert_eq!(parse_size("1.5G").unwrap(), 3 << 29);
        assert_eq!(parse_size("4096b").unwrap(), 4096);
    }

    #[test]
    fn refuses_what_is_not_a_size() {
        assert!(parse_size("").is_err());
        assert!(parse_size("G").is_err());
        assert!(parse_size("10X").is_err());
        assert!(parse_size("1.2.3G").is_err());
        assert!(parse_size("99999999999P").is_err());
    }

    #[test]
    fn formats_with_binary_units() {
        assert_eq!(format_size(512), "512 B");
        assert_eq!(format_size(4096), "4.00 KiB");
        assert_eq!(format_size(390 << 20), "390.00 MiB");
        assert_eq!(format_size(10 << 30), "10.00 GiB");
    }

    #[test]
    fn rounds() {
        assert_eq!(round_up(1, 4096), 4096);
        assert_eq!(round_up(4096, 4096), 4096);
        assert_eq!(round_down(4097, 4096), 4096);
    }
}
