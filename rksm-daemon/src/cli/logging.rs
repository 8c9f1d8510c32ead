//! Logs: one line per event on stderr, as text for people and journald, or as JSON lines for
//! log pipelines. Key-value pairs attached to a record (`log::info!(pid = 5; "...")`) become
//! fields of the JSON object (the text line is the message alone, which already says them).
//! The eBPF program's aya-log lines arrive through the same logger, with target `rksm::ebpf`.

use std::io::Write;

use log::kv::{Key, Value, VisitSource};
use rksm::service::config::LogFormat;

/// The filter in force: `--log-level`, else `RUST_LOG`, else the configuration file's, else
/// `info`.
pub fn filter(flag: Option<&str>, file: Option<&str>) -> String {
    flag.map(str::to_string)
        .or_else(|| std::env::var("RUST_LOG").ok().filter(|v| !v.is_empty()))
        .or_else(|| file.map(str::to_string))
        .unwrap_or_else(|| "info".into())
}

/// Installs the logger (once per process).
pub fn init(filter: &str, format: LogFormat) {
    env_logger::Builder::new()
        .parse_filters(filter)
        .format(move |buf, record| {
            let mut fields = Fields::default();
            let _ = record.key_values().visit(&mut fields);
            let level = record.level().as_str().to_lowercase();
            match format {
                // The message already says what the fields hold; they are for machines.
                LogFormat::Text => writeln!(buf, "rksm: {level}: {}", record.args()),
                LogFormat::Json => {
                    let mut line = serde_json::Map::new();
                    line.insert("time".into(), buf.timestamp_millis().to_string().into());
                    line.insert("level".into(), level.into());
                    line.insert("target".into(), record.target().into());
                    line.insert("message".into(), record.args().to_string().into());
                    for (key, value) in fields.0 {
                        line.insert(key, value);
                    }
                    writeln!(buf, "{}", serde_json::Value::Object(line))
                }
            }
        })
        .init();
}

#[derive(Default)]
struct Fields(Vec<(String, serde_json::Value)>);

impl<'kvs> VisitSource<'kvs> for Fields {
    fn visit_pair(&mut self, key: Key<'kvs>, value: Value<'kvs>) -> Result<(), log::kv::Error> {
        let json = if let Some(n) = value.to_u64() {
            n.into()
        } else if let Some(n) = value.to_i64() {
            n.into()
        } else if let Some(b) = value.to_bool() {
            b.into()
        } else if let Some(x) = value.to_f64().and_then(serde_json::Number::from_f64) {
            x.into()
        } else {
            value.to_string().into()
        };
        self.0.push((key.as_str().to_string(), json));
        Ok(())
    }
}
