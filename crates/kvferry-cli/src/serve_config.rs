//! `kvferry serve --config FILE.toml`: settings from a file, flags still winning.
//!
//! The file is a flat TOML table whose keys are `serve`'s long flag names (`io-timeout`
//! or `io_timeout`) and whose values are what the flag takes: strings (`"1GiB"`,
//! `"5s"`), integers, or `true` for a switch. Every key is checked against the flags
//! `serve` really has, so a misspelt key is an error naming it, never silently ignored;
//! values go through the very same parsers as flags, so `io-timeout = "0s"` is refused
//! exactly like `--io-timeout 0s`.
//!
//! Mechanism: the file becomes flags inserted right after `serve`, before the ones typed
//! on the command line, and `serve` lets a later occurrence of a flag override an
//! earlier one — so the command line wins over the file, and the file over defaults.

use std::ffi::OsString;
use std::path::Path;

use anyhow::Context;

/// Keys the file may not set: the file itself, and help/version.
const NOT_SETTABLE: &[&str] = &["config", "help", "version"];

/// If `argv` runs `serve` with `--config FILE` (or `--config=FILE`), returns `argv` with
/// the file's settings inserted as flags right after `serve`; otherwise `argv` as is.
pub fn expand(argv: Vec<OsString>, serve: &clap::Command) -> anyhow::Result<Vec<OsString>> {
    // The subcommand is the first argument after the program that is not a flag
    // (the only global flag, --log-json, takes no value).
    let Some(at) = argv.iter().skip(1).position(|a| !a.to_string_lossy().starts_with('-')) else {
        return Ok(argv);
    };
    let at = at + 1;
    if argv[at] != "serve" {
        return Ok(argv);
    }
    let mut path = None;
    let mut i = at + 1;
    while i < argv.len() {
        let a = argv[i].to_string_lossy();
        if a == "--" {
            break;
        }
        if a == "--config" {
            let Some(p) = argv.get(i + 1) else {
                // Let clap report the missing value.
                return Ok(argv);
            };
            path = Some(std::path::PathBuf::from(p));
            i += 1;
        } else if let Some(p) = a.strip_prefix("--config=") {
            path = Some(p.into());
        }
        i += 1;
    }
    let Some(path) = path else {
        return Ok(argv);
    };
    let flags = flags_from_file(&path, serve)?;
    let mut out = argv[..=at].to_vec();
    out.extend(flags);
    out.extend_from_slice(&argv[at + 1..]);
    Ok(out)
}

/// Reads `path` and turns it into `serve` flags.
pub fn flags_from_file(path: &Path, serve: &clap::Command) -> anyhow::Result<Vec<OsString>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading config file {}", path.display()))?;
    flags_from_str(&text, serve).with_context(|| format!("config file {}", path.display()))
}

/// Turns a config file's text into `serve` flags (see the module docs).
pub fn flags_from_str(text: &str, serve: &clap::Command) -> anyhow::Result<Vec<OsString>> {
    let table: toml::Table = text.parse().context("not valid TOML")?;
    let known: Vec<&clap::Arg> = serve
        .get_arguments()
        .filter(|a| !a.is_hide_set())
        .filter(|a| a.get_long().is_some_and(|l| !NOT_SETTABLE.contains(&l)))
        .collect();
    let mut flags = Vec::new();
    for (key, value) in &table {
        let name = key.replace('_', "-");
        let Some(arg) = known.iter().find(|a| a.get_long() == Some(name.as_str())) else {
            let mut names: Vec<&str> = known.iter().filter_map(|a| a.get_long()).collect();
            names.sort_unstable();
            anyhow::bail!("unknown key `{key}` (known keys: {})", names.join(", "));
        };
        let takes_value = arg.get_action().takes_values();
        let flag = format!("--{name}");
        match value {
            toml::Value::Boolean(b) if !takes_value => {
                if *b {
                    flags.push(flag.into());
                }
            }
            toml::Value::String(s) if takes_value => {
                flags.push(flag.into());
                flags.push(s.into());
            }
            toml::Value::Integer(n) if takes_value => {
                flags.push(flag.into());
                flags.push(n.to_string().into());
            }
            other if takes_value => anyhow::bail!(
                "key `{key}`: expected a string or an integer, got {} ({other})",
                other.type_str()
            ),
            other => anyhow::bail!("key `{key}` is a switch: expected true or false, got {other}"),
        }
    }
    // Parse the file's flags alone with the real parsers now, so a bad value is reported
    // as the file's (e.g. `io-timeout = "0s"`), not as a flag the user never typed.
    if let Err(e) = serve.clone().no_binary_name(true).try_get_matches_from(&flags) {
        let msg = e.to_string();
        let first = msg.lines().next().unwrap_or("invalid value");
        anyhow::bail!("{}", first.trim_start_matches("error: "));
    }
    Ok(flags)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Arg, ArgAction, Command};

    fn serve() -> Command {
        Command::new("serve")
            .args_override_self(true)
            .arg(Arg::new("listen").long("listen").default_value("127.0.0.1:7070"))
            .arg(Arg::new("io-timeout").long("io-timeout"))
            .arg(Arg::new("blocks").long("blocks"))
            .arg(Arg::new("verbose").long("verbose").action(ArgAction::SetTrue))
            .arg(Arg::new("secret-fault").long("secret-fault").hide(true))
            .arg(Arg::new("config").long("config"))
    }

    fn os(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    #[test]
    fn keys_become_flags_and_underscores_are_dashes() {
        let f = flags_from_str(
            "listen = \"0.0.0.0:1\"\nio_timeout = \"2s\"\nblocks = 64\nverbose = true\n",
            &serve(),
        )
        .unwrap();
        assert_eq!(
            f,
            // The table's (sorted) key order; flags do not depend on order.
            os(&[
                "--blocks",
                "64",
                "--io-timeout",
                "2s",
                "--listen",
                "0.0.0.0:1",
                "--verbose"
            ])
        );
        assert!(flags_from_str("verbose = false", &serve()).unwrap().is_empty());
    }

    #[test]
    fn unknown_hidden_and_reserved_keys_are_refused_by_name() {
        for bad in [
            "lisen = \"x\"",
            "secret-fault = \"1\"",
            "config = \"other.toml\"",
            "help = true",
        ] {
            let e = format!("{:#}", flags_from_str(bad, &serve()).unwrap_err());
            assert!(e.contains("unknown key"), "{bad}: {e}");
            assert!(e.contains("io-timeout"), "lists the known keys: {e}");
        }
    }

    #[test]
    fn bad_values_are_reported_as_the_files() {
        let cmd = serve().arg(
            Arg::new("ttl")
                .long("ttl")
                .value_parser(|s: &str| s.parse::<u32>().map_err(|e| e.to_string())),
        );
        let e = format!("{:#}", flags_from_str("ttl = \"soon\"", &cmd).unwrap_err());
        assert!(e.contains("soon") && e.contains("--ttl"), "{e}");
        assert!(flags_from_str("ttl = 5", &cmd).is_ok());
    }

    #[test]
    fn wrong_value_types_and_bad_toml_are_refused() {
        let e = format!("{:#}", flags_from_str("blocks = [1, 2]", &serve()).unwrap_err());
        assert!(e.contains("`blocks`") && e.contains("array"), "{e}");
        let e = format!("{:#}", flags_from_str("verbose = \"yes\"", &serve()).unwrap_err());
        assert!(e.contains("switch"), "{e}");
        let e = format!("{:#}", flags_from_str("listen = ", &serve()).unwrap_err());
        assert!(e.contains("TOML"), "{e}");
    }

    #[test]
    fn command_line_flags_win_over_the_file() {
        let dir = std::env::temp_dir().join(format!("kvferry-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("serve.toml");
        std::fs::write(&file, "blocks = 32\nio-timeout = \"2s\"\n").unwrap();
        let argv = os(&["kvferry", "serve", "--blocks", "64", "--config", file.to_str().unwrap()]);
        let cmd = Command::new("kvferry").subcommand(serve());
        let expanded = expand(argv, &serve()).unwrap();
        let m = cmd.try_get_matches_from(expanded).unwrap();
        let (_, m) = m.subcommand().unwrap();
        assert_eq!(m.get_one::<String>("blocks").unwrap(), "64", "the flag wins");
        assert_eq!(m.get_one::<String>("io-timeout").unwrap(), "2s", "the file fills in");
        assert_eq!(
            m.get_one::<String>("listen").unwrap(),
            "127.0.0.1:7070",
            "defaults stay"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn other_commands_and_a_missing_file() {
        let argv = os(&["kvferry", "bench", "--config", "x.toml"]);
        assert_eq!(
            expand(argv.clone(), &serve()).unwrap(),
            argv,
            "only serve reads a config"
        );
        let e = expand(os(&["kvferry", "serve", "--config=/nonexistent/k.toml"]), &serve()).unwrap_err();
        assert!(format!("{e:#}").contains("/nonexistent/k.toml"), "{e:#}");
    }
}
