//! The configuration file, `/etc/rksm/rksm.toml` by default.
//!
//! Operators keep a service's settings in a file, not in its unit's command line. Every
//! `rksm daemon` flag has a key of the same name (`min_age` for `--min-age`); a flag given on
//! the command line wins over the file. Unknown keys and bad values are errors that name the
//! file, the line and the key, so a typo never quietly falls back to a default.
//!
//! ```
//! let config = rksm::service::config::ConfigFile::parse(
//!     "comm = '^python'\ndirty = 'ebpf'\ninterval = 2.5\n",
//!     "rksm.toml".as_ref(),
//! )
//! .unwrap();
//! assert_eq!(config.interval, Some(2.5));
//!
//! let err = rksm::service::config::ConfigFile::parse("intervall = 2\n", "rksm.toml".as_ref()).unwrap_err();
//! assert!(err.to_string().starts_with("rksm.toml: line 1: unknown field `intervall`"));
//! ```

use std::{
    fmt::Display,
    net::SocketAddr,
    path::{Path, PathBuf},
    str::FromStr,
};

use regex::Regex;
use serde::{de::Error as _, Deserialize, Deserializer};

use crate::{
    daemon::{DirtyMode, DomainPolicy, NewPages, OutsiderPolicy, SeveralDomains},
    engine::{checksum::ChecksumKind, dirty::protection::WriteProtectChoice},
};

/// Where the daemon looks for its configuration when `--config` is not given.
pub const DEFAULT_PATH: &str = "/etc/rksm/rksm.toml";

/// Errors reading the configuration file; every one is the operator's input.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// `--config` names a file that does not exist.
    #[error("{0}: no such configuration file")]
    Missing(PathBuf),
    /// The file exists but cannot be read.
    #[error("{path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// What failed.
        source: std::io::Error,
    },
    /// Not TOML, an unknown key, or a bad value.
    #[error("{path}: line {line}: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// 1-based line of the offending key or value (1 if the parser does not say).
        line: usize,
        /// What is wrong, on one line.
        message: String,
    },
}

/// Everything the file can set; absent keys are `None` (or empty) and take the command
/// line's value or the default.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    /// `--pid`: processes to work on.
    #[serde(default, deserialize_with = "pids")]
    pub pid: Vec<u32>,
    /// `--cgroup`: cgroups whose processes to work on.
    #[serde(default)]
    pub cgroup: Vec<PathBuf>,
    /// `--uid`: users whose processes to work on.
    #[serde(default)]
    pub uid: Vec<u32>,
    /// `--comm`: command names to work on (narrows the others).
    #[serde(default, deserialize_with = "regex")]
    pub comm: Option<Regex>,
    /// `--all`: every user process.
    #[serde(default)]
    pub all: Option<bool>,
    /// `--min-age`: seconds a process must have run.
    #[serde(default, deserialize_with = "age")]
    pub min_age: Option<f64>,
    /// `--dirty`.
    #[serde(default, deserialize_with = "parsed")]
    pub dirty: Option<DirtyMode>,
    /// `--write-protect`.
    #[serde(default, deserialize_with = "parsed")]
    pub write_protect: Option<WriteProtectChoice>,
    /// `--new-pages`: `sample` or `read`.
    #[serde(default, deserialize_with = "parsed")]
    pub new_pages: Option<NewPages>,
    /// `--checksum`.
    #[serde(default, deserialize_with = "parsed")]
    pub checksum: Option<ChecksumKind>,
    /// `--domain`.
    #[serde(default, deserialize_with = "parsed")]
    pub domain: Option<DomainPolicy>,
    /// `--several-domains`: `refuse` or `allow`.
    #[serde(default, deserialize_with = "parsed")]
    pub several_domains: Option<SeveralDomains>,
    /// `--outsiders`: `refuse` or `warn`.
    #[serde(default, deserialize_with = "parsed")]
    pub outsiders: Option<OutsiderPolicy>,
    /// `--interval`: seconds between passes.
    #[serde(default, deserialize_with = "seconds")]
    pub interval: Option<f64>,
    /// `--duration`: seconds to run.
    #[serde(default, deserialize_with = "seconds")]
    pub duration: Option<f64>,
    /// `--passes`: passes to run.
    #[serde(default, deserialize_with = "passes")]
    pub passes: Option<u64>,
    /// `--audit-passes`: passes over which the ebpf mode audits every armed page once.
    #[serde(default, deserialize_with = "audit_passes")]
    pub audit_passes: Option<u64>,
    /// `--json`: final counters as JSON.
    #[serde(default)]
    pub json: Option<bool>,
    /// `--log-level`: a level or a filter (`info`, `rksm::daemon=debug`).
    #[serde(default, deserialize_with = "log_filter")]
    pub log_level: Option<String>,
    /// `--log-format`: `text` or `json`.
    #[serde(default, deserialize_with = "parsed")]
    pub log_format: Option<LogFormat>,
    /// `--socket`: where `rksm status` reaches the daemon.
    #[serde(default)]
    pub socket: Option<PathBuf>,
    /// `--metrics-address`: serve Prometheus metrics over HTTP here (off unless set).
    #[serde(default, deserialize_with = "parsed")]
    pub metrics_address: Option<SocketAddr>,
    /// `--metrics-token-file`: a bearer token that also gets the per-target series over HTTP.
    #[serde(default)]
    pub metrics_token_file: Option<PathBuf>,
    /// `--metrics-textfile`: write the public metrics here after every pass.
    #[serde(default)]
    pub metrics_textfile: Option<PathBuf>,
}

impl ConfigFile {
    /// Parses `text`, the contents of `path` (named in errors).
    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| {
            let start = e.span().map_or(0, |span| span.start.min(text.len()));
            let line = text.as_bytes()[..start]
                .iter()
                .filter(|&&b| b == b'\n')
                .count()
                + 1;
            ConfigError::Invalid {
                path: path.into(),
                line,
                message: e.message().trim().replace('\n', " "),
            }
        })
    }

    /// Reads `path`, which must exist.
    pub fn read(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| {
            if source.kind() == std::io::ErrorKind::NotFound {
                ConfigError::Missing(path.into())
            } else {
                ConfigError::Read {
                    path: path.into(),
                    source,
                }
            }
        })?;
        Self::parse(&text, path)
    }

    /// The file `--config` names, or else [`DEFAULT_PATH`] if it exists, or else nothing
    /// (every setting from the command line and the defaults). Returns the file used.
    pub fn load(explicit: Option<&Path>) -> Result<(Self, Option<PathBuf>), ConfigError> {
        Self::load_from(explicit, Path::new(DEFAULT_PATH))
    }

    /// [`ConfigFile::load`] with another default location (tests).
    pub fn load_from(
        explicit: Option<&Path>,
        default: &Path,
    ) -> Result<(Self, Option<PathBuf>), ConfigError> {
        match explicit {
            Some(path) => Ok((Self::read(path)?, Some(path.into()))),
            None if default.exists() => Ok((Self::read(default)?, Some(default.into()))),
            None => Ok((Self::default(), None)),
        }
    }

    /// True if the file selects targets.
    pub fn has_targets(&self) -> bool {
        !self.pid.is_empty()
            || !self.cgroup.is_empty()
            || !self.uid.is_empty()
            || self.comm.is_some()
            || self.all == Some(true)
    }
}

fn parsed<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: FromStr,
    T::Err: Display,
{
    let text = String::deserialize(d)?;
    text.parse().map(Some).map_err(D::Error::custom)
}

fn regex<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Regex>, D::Error> {
    let text = String::deserialize(d)?;
    Regex::new(&text).map(Some).map_err(|e| {
        D::Error::custom(format!(
            "not a valid regular expression: {}",
            e.to_string().lines().last().unwrap_or("")
        ))
    })
}

/// A number of seconds, written as an integer or a float.
fn number<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Number {
        Int(i64),
        Float(f64),
    }
    match Number::deserialize(d) {
        Ok(Number::Int(i)) => Ok(i as f64),
        Ok(Number::Float(f)) => Ok(f),
        Err(_) => Err(D::Error::custom("expected a number of seconds")),
    }
}

fn seconds<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    Seconds::INTERVAL
        .check(number(d)?)
        .map(Some)
        .map_err(D::Error::custom)
}

fn age<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    Seconds::AGE
        .check(number(d)?)
        .map(Some)
        .map_err(D::Error::custom)
}

/// A value that a flag or a key of the configuration file does not accept.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValueError {
    /// Not a number of seconds within the rule's bounds.
    #[error("{given} is not {bounds}")]
    Seconds {
        /// The value, as it was written.
        given: String,
        /// The bounds, as people say them.
        bounds: String,
    },
    /// Not a log filter.
    #[error("`{0}` is not a log level (off, error, warn, info, debug, trace, or TARGET=LEVEL, comma-separated)")]
    LogFilter(String),
}

/// Bounds on a number of seconds: the one rule every flag and key that takes seconds follows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Seconds {
    min: f64,
    /// Whether `min` itself is allowed.
    min_ok: bool,
    max: f64,
}

impl Seconds {
    /// Between passes, or how long to run: more than 0, at most a day.
    pub const INTERVAL: Seconds = Seconds {
        min: 0.0,
        min_ok: false,
        max: 86_400.0,
    };
    /// How long a process must have run: 0 or more.
    pub const AGE: Seconds = Seconds {
        min: 0.0,
        min_ok: true,
        max: 1e9,
    };
    /// How long to trace: more than 0.
    pub const TRACE: Seconds = Seconds {
        min: 0.0,
        min_ok: false,
        max: 1e9,
    };
    /// Between `rksm estimate` passes: 0 to an hour.
    pub const ESTIMATE: Seconds = Seconds {
        min: 0.0,
        min_ok: true,
        max: 3600.0,
    };
    /// One `rksm bench` run: 2 s to an hour.
    pub const BENCH: Seconds = Seconds {
        min: 2.0,
        min_ok: true,
        max: 3600.0,
    };

    /// `value` if it is within bounds, else why not.
    ///
    /// ```
    /// use rksm::service::config::Seconds;
    /// assert_eq!(Seconds::INTERVAL.parse("2.5"), Ok(2.5));
    /// assert_eq!(
    ///     Seconds::INTERVAL.parse("0").unwrap_err().to_string(),
    ///     "0 is not a number of seconds more than 0 and at most 86400"
    /// );
    /// assert_eq!(
    ///     Seconds::BENCH.parse("fast").unwrap_err().to_string(),
    ///     "`fast` is not a number of seconds from 2 to 3600"
    /// );
    /// ```
    pub fn check(self, value: f64) -> Result<f64, ValueError> {
        let above_min = value > self.min || (self.min_ok && value == self.min);
        if value.is_finite() && above_min && value <= self.max {
            Ok(value)
        } else {
            Err(self.refuse(value.to_string()))
        }
    }

    /// Why `given` is refused.
    fn refuse(self, given: String) -> ValueError {
        ValueError::Seconds {
            given,
            bounds: self.bounds(),
        }
    }

    /// "a number of seconds ..." with the bounds, as errors say it.
    fn bounds(self) -> String {
        if self.min_ok {
            format!("a number of seconds from {} to {}", self.min, self.max)
        } else {
            format!(
                "a number of seconds more than {} and at most {}",
                self.min, self.max
            )
        }
    }

    /// Parses `text` as a number of seconds within bounds.
    pub fn parse(self, text: &str) -> Result<f64, ValueError> {
        match text.parse::<f64>() {
            Ok(value) => self.check(value),
            Err(_) => Err(self.refuse(format!("`{text}`"))),
        }
    }
}

fn passes<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    match i64::deserialize(d)? {
        n if n >= 1 => Ok(Some(n as u64)),
        n => Err(D::Error::custom(format!("{n} passes: at least 1"))),
    }
}

fn audit_passes<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    match i64::deserialize(d)? {
        n @ 1..=1000 => Ok(Some(n as u64)),
        n => Err(D::Error::custom(format!("{n} passes: from 1 to 1000"))),
    }
}

fn pids<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u32>, D::Error> {
    let pids = Vec::<i64>::deserialize(d)?;
    pids.into_iter()
        .map(|p| {
            u32::try_from(p)
                .ok()
                .filter(|&p| p > 0)
                .ok_or_else(|| D::Error::custom(format!("{p} is not a process id")))
        })
        .collect()
}

fn log_filter<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    let text = String::deserialize(d)?;
    check_log_filter(&text).map_err(D::Error::custom)?;
    Ok(Some(text))
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// `rksm: info: message key=value ...`, for people and journald.
    #[default]
    Text,
    /// One JSON object per line, for log pipelines.
    Json,
}

crate::value_enum_text!(LogFormat => "log format");

/// Checks a log filter: comma-separated `LEVEL` or `TARGET=LEVEL` directives.
pub fn check_log_filter(filter: &str) -> Result<(), ValueError> {
    const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];
    for directive in filter.split(',') {
        let level = directive.rsplit('=').next().unwrap_or("").trim();
        let target_ok = directive.split('=').count() <= 2;
        if !target_ok || !LEVELS.contains(&level.to_ascii_lowercase().as_str()) {
            return Err(ValueError::LogFilter(filter.into()));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<ConfigFile, ConfigError> {
        ConfigFile::parse(text, Path::new("/etc/rksm/rksm.toml"))
    }

    fn error(text: &str) -> String {
        parse(text).unwrap_err().to_string()
    }

    #[test]
    fn every_key_is_read() {
        let config = parse(
            r#"
pid = [12, 34]
cgroup = ["system.slice/a.service"]
comm = "^python"
all = false
min_age = 30
dirty = "pagemap"
checksum = "crc32c"
domain = "cgroup"
interval = 2.5
duration = 600
passes = 3
json = true
log_level = "rksm::daemon=debug,info"
log_format = "json"
socket = "/run/rksm/other.sock"
metrics_address = "127.0.0.1:9464"
metrics_token_file = "/etc/rksm/metrics-token"
metrics_textfile = "/var/lib/node_exporter/textfile/rksm.prom"
"#,
        )
        .unwrap();
        assert_eq!(config.pid, [12, 34]);
        assert_eq!(config.cgroup, [PathBuf::from("system.slice/a.service")]);
        assert_eq!(config.comm.unwrap().as_str(), "^python");
        assert_eq!(config.all, Some(false));
        assert_eq!(config.min_age, Some(30.0));
        assert_eq!(config.dirty, Some(DirtyMode::Pagemap));
        assert_eq!(config.checksum, Some(ChecksumKind::Crc32c));
        assert_eq!(config.domain, Some(DomainPolicy::Cgroup));
        assert_eq!(config.interval, Some(2.5));
        assert_eq!(config.duration, Some(600.0));
        assert_eq!(config.passes, Some(3));
        assert_eq!(config.json, Some(true));
        assert_eq!(config.log_level.as_deref(), Some("rksm::daemon=debug,info"));
        assert_eq!(config.log_format, Some(LogFormat::Json));
        assert_eq!(config.socket, Some(PathBuf::from("/run/rksm/other.sock")));
        assert_eq!(
            config.metrics_address,
            Some("127.0.0.1:9464".parse().unwrap())
        );
        assert_eq!(
            config.metrics_token_file,
            Some(PathBuf::from("/etc/rksm/metrics-token"))
        );
        assert_eq!(
            config.metrics_textfile,
            Some(PathBuf::from("/var/lib/node_exporter/textfile/rksm.prom"))
        );
    }

    #[test]
    fn an_empty_file_sets_nothing() {
        let config = parse("# nothing yet\n").unwrap();
        assert!(!config.has_targets());
        assert!(config.dirty.is_none() && config.interval.is_none());
    }

    #[test]
    fn unknown_keys_are_named_with_their_line() {
        let err = error("dirty = \"ebpf\"\n\nintervall = 2\n");
        assert!(
            err.starts_with("/etc/rksm/rksm.toml: line 3: unknown field `intervall`"),
            "{err}"
        );
    }

    #[test]
    fn bad_values_name_the_line_and_say_what_is_wrong() {
        for (text, line, says) in [
            (
                "dirty = \"soft-dirty\"",
                1,
                "unknown dirty mode `soft-dirty`",
            ),
            ("\nchecksum = \"md5\"", 2, "md5"),
            ("domain = \"tenant\"", 1, "unknown merge domain"),
            ("interval = 0", 1, "more than 0 and at most 86400"),
            ("interval = \"fast\"", 1, "expected a number of seconds"),
            ("min_age = -1", 1, "not a number of seconds"),
            ("passes = 0", 1, "at least 1"),
            ("audit_passes = 1001", 1, "from 1 to 1000"),
            ("pid = [0]", 1, "not a process id"),
            ("pid = 5", 1, "sequence"),
            ("comm = \"(\"", 1, "not a valid regular expression"),
            ("log_level = \"loud\"", 1, "not a log level"),
            ("log_format = \"xml\"", 1, "unknown log format"),
            (
                "metrics_address = \"localhost\"",
                1,
                "invalid socket address",
            ),
            ("all = \"yes\"", 1, "bool"),
            ("dirty = ", 1, ""),
            ("[daemon]\ndirty = \"ebpf\"", 1, "unknown field `daemon`"),
        ] {
            let err = error(text);
            assert!(
                err.starts_with(&format!("/etc/rksm/rksm.toml: line {line}: ")),
                "{text:?}: {err}"
            );
            assert!(err.contains(says), "{text:?}: {err}");
            assert_eq!(err.lines().count(), 1, "{text:?}: {err}");
        }
    }

    #[test]
    fn an_explicit_file_must_exist_the_default_need_not() {
        let missing = Path::new("/nonexistent/rksm.toml");
        let err = ConfigFile::load_from(Some(missing), missing).unwrap_err();
        assert_eq!(
            err.to_string(),
            "/nonexistent/rksm.toml: no such configuration file"
        );
        let (config, used) = ConfigFile::load_from(None, missing).unwrap();
        assert!(used.is_none() && !config.has_targets());
    }

    #[test]
    fn log_filters_are_checked() {
        for good in [
            "info",
            "DEBUG",
            "rksm=trace",
            "warn,rksm::daemon=debug",
            "off",
        ] {
            assert!(check_log_filter(good).is_ok(), "{good}");
        }
        for bad in ["", "loud", "a=b=c", "rksm=", "info,"] {
            assert!(check_log_filter(bad).is_err(), "{bad}");
        }
    }

    proptest::proptest! {
        /// Any text, and any mutation of a valid file: parsed or refused with one line that
        /// names the file, never a panic.
        #[test]
        fn parsing_never_panics_and_errors_are_one_line(text in "\\PC{0,200}") {
            if let Err(e) = parse(&text) {
                let msg = e.to_string();
                proptest::prop_assert!(msg.starts_with("/etc/rksm/rksm.toml: line "), "{}", msg);
                proptest::prop_assert_eq!(msg.lines().count(), 1);
            }
        }

        #[test]
        fn mutated_corpus_files_never_panic(
            file in proptest::sample::select(corpus()),
            at in 0usize..4096,
            insert in "\\PC{0,6}",
            cut in 0usize..8,
        ) {
            let mut text = file;
            let at = (0..=at.min(text.len())).rev().find(|&i| text.is_char_boundary(i)).unwrap_or(0);
            let end = (at..=(at + cut).min(text.len())).rev().find(|&i| text.is_char_boundary(i)).unwrap_or(at);
            text.replace_range(at..end, &insert);
            if let Err(e) = parse(&text) {
                proptest::prop_assert_eq!(e.to_string().lines().count(), 1);
            }
        }
    }

    /// The configuration files kept in `fuzz-corpus/config/`.
    fn corpus() -> Vec<String> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz-corpus/config");
        let mut files: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| std::fs::read_to_string(e.unwrap().path()).unwrap())
            .collect();
        files.sort();
        assert!(!files.is_empty(), "no corpus in {}", dir.display());
        files
    }

    #[test]
    fn the_corpus_and_the_packaged_example_parse() {
        for text in corpus() {
            parse(&text).unwrap();
        }
        let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/rksm.toml");
        ConfigFile::read(&example).unwrap();
    }
}
