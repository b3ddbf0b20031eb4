//! The Lua scripts, each assembled from the shared prologue, its own body
//! and the shared helpers.
//!
//! A script is `head.lua` (the record key, the store's constants), then
//! its body, with `clock.lua` (the store's clock), `common.lua` (the
//! helpers), `holder.lua` (what complete and release read of the lease's
//! holder) and `fence.lua` (their answer to a caller that no longer holds
//! it) put where the body has a `--@clock`, `--@common`, `--@holder` or
//! `--@fence` line; a
//! body without `--@clock` reads the clock first, one without `--@common`
//! gets the helpers before it. The hot paths (a new key, a replay, a
//! completion, a release) come before the helpers, so a call that takes
//! one never builds their closures, and a replay, a completion and a
//! release come before the clock (the last two take the attempt's end time
//! from the caller).

use redis::Script;

use idem_core::ATTEMPT_HISTORY;

use crate::format::{self, RecordFormat};
use crate::string_record;

const HEAD: &str = include_str!("lua/head.lua");
const CLOCK: &str = include_str!("lua/clock.lua");
const COMMON: &str = include_str!("lua/common.lua");
const FENCE: &str = include_str!("lua/fence.lua");
const HOLDER: &str = include_str!("lua/holder.lua");
/// Reads a record kept as one string (format 3): for `get.lua` and
/// `convert.lua`.
pub(crate) use string_record::LUA as STRING_RECORD;

/// The settings a store's scripts are assembled with.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Constants {
    /// Whether the scripts ending an attempt publish to its waiters.
    pub(crate) notify: bool,
    /// The format the store writes (see `format.rs`).
    pub(crate) format: RecordFormat,
}

/// The source of a script: the prologue with the store's constants
/// filled in, then `body` with the helpers in place and every field
/// placeholder replaced (`tenant_field`: the field the reservation writes
/// the tenant to).
pub(crate) fn source(body: &str, constants: Constants, tenant_field: &str) -> String {
    let flag = |on: bool| if on { "true" } else { "false" };
    // A format 3 store's scripts work on format 2 hashes (format.rs).
    let hashes = constants.format.hash_format();
    let written = match hashes {
        RecordFormat::V1 => String::new(),
        other => other.number().to_string(),
    };
    let head = HEAD
        .replace("@NOTIFY@", flag(constants.notify))
        .replace("@PACKED@", flag(hashes.packed()))
        .replace("@FORMAT@", &written)
        .replace("@NEWEST@", &format::NEWEST.number().to_string())
        .replace("@HISTORY@", &ATTEMPT_HISTORY.to_string());
    // `part` at the body's `marker` line, or before the body.
    let place = |body: &str, marker: &str, part: &str| {
        if body.contains(marker) {
            body.replacen(marker, part, 1)
        } else {
            format!("{part}\n{body}")
        }
    };
    let body = place(body, "--@common\n", COMMON);
    let body = place(&body, "--@clock\n", CLOCK);
    let body = body
        .replacen("--@holder\n", HOLDER, 1)
        .replacen("--@fence\n", FENCE, 1);
    let source = format::substitute(&format!("{head}\n{body}"))
        .replace("@TENANT_FIELD@", &format!("'{tenant_field}'"));
    string_record::substitute_layout(&source)
}

/// The scripts of one store.
#[derive(Debug)]
pub(crate) struct Scripts {
    /// For a tenant kept as text.
    pub(crate) reserve: Script,
    /// For a hashed tenant kept as bytes (`tenant_bin`, see `decode.rs`).
    pub(crate) reserve_bin: Script,
    pub(crate) renew: Script,
    pub(crate) complete: Script,
    pub(crate) release: Script,
    pub(crate) cancel: Script,
    pub(crate) get: Script,
    /// Shared with the guards that may run it after their call was given
    /// up (cloning a `Script` copies its source).
    pub(crate) abandon: std::sync::Arc<Script>,
    pub(crate) force_release: Script,
    pub(crate) erase: Script,
    /// Marks a record as waited on and reads its state (no prologue).
    pub(crate) watch: Script,
    /// Counts the lapsed records of a `SCAN` page (no prologue).
    pub(crate) count_lapsed: Script,
    /// A completion's hot path on a string record (format 3, no
    /// prologue).
    pub(crate) complete_string: Script,
}

impl Scripts {
    /// The scripts of a store with these settings.
    pub(crate) fn new(constants: Constants) -> Self {
        let script = |name: &str| Script::new(&source(body(name), constants, format::TENANT));
        Self {
            reserve: script("reserve"),
            reserve_bin: Script::new(&source(body("reserve"), constants, format::TENANT_BIN)),
            renew: script("renew"),
            complete: script("complete"),
            release: script("release"),
            cancel: script("cancel"),
            get: Script::new(&source(
                &format!("{STRING_RECORD}\n{}", body("get")),
                constants,
                format::TENANT,
            )),
            abandon: std::sync::Arc::new(script("abandon")),
            force_release: script("force_release"),
            erase: script("erase"),
            watch: Script::new(&no_prologue(include_str!("lua/watch.lua"))),
            count_lapsed: Script::new(&no_prologue(include_str!("lua/count_lapsed.lua"))),
            complete_string: Script::new(&no_prologue(
                &include_str!("lua/complete_string.lua")
                    .replace("@NOTIFY@", if constants.notify { "true" } else { "false" }),
            )),
        }
    }
}

/// A script that runs without the prologue, its fields and the string
/// record's layout filled in.
fn no_prologue(source: &str) -> String {
    string_record::substitute_layout(&format::substitute(source))
}

/// The body of the script `name`, empty for an unknown name.
pub(crate) fn body(name: &str) -> &'static str {
    match name {
        "reserve" => include_str!("lua/reserve.lua"),
        "renew" => include_str!("lua/renew.lua"),
        "complete" => include_str!("lua/complete.lua"),
        "release" => include_str!("lua/release.lua"),
        "cancel" => include_str!("lua/cancel.lua"),
        "get" => include_str!("lua/get.lua"),
        "abandon" => include_str!("lua/abandon.lua"),
        "force_release" => include_str!("lua/force_release.lua"),
        "erase" => include_str!("lua/erase.lua"),
        _ => "",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every script with a body of its own.
    const BODIES: [&str; 9] = [
        "reserve",
        "renew",
        "complete",
        "release",
        "cancel",
        "get",
        "abandon",
        "force_release",
        "erase",
    ];

    /// Where each part lands: a replay before the clock, a new key, a
    /// completion and a release before the helpers' closures, no
    /// placeholder left.
    #[test]
    fn hot_paths_come_before_the_clock_and_the_helpers() {
        let at = |source: &str, what: &str| {
            source
                .find(what)
                .unwrap_or_else(|| panic!("{what:?} missing"))
        };
        let on = Constants {
            notify: true,
            format: RecordFormat::V2,
        };
        let off = Constants {
            notify: false,
            format: RecordFormat::V1,
        };
        let reserve = source(body("reserve"), on, "tenant_bin");
        assert!(at(&reserve, "if state == 'completed'") < at(&reserve, "redis.call('TIME')"));
        assert!(at(&reserve, "return 1") < at(&reserve, "local function"));
        assert!(reserve.contains("local TENANT_FIELD = 'tenant_bin'"));
        assert!(reserve.contains("local PACKED = true"));
        for name in ["complete", "release"] {
            let script = source(body(name), off, "tenant");
            // The hot path takes its end time from the caller: no clock.
            assert!(at(&script, "if state == 'processing'") < at(&script, "redis.call('TIME')"));
            assert!(at(&script, "redis.call('TIME')") < at(&script, "local function"));
            assert!(at(&script, "local function fenced") < at(&script, "return fenced("));
            assert!(script.contains("local NOTIFY = false"));
        }
        for name in BODIES {
            let script = source(body(name), on, "tenant");
            for placeholder in ["@", "--@"] {
                let code: String = script
                    .lines()
                    .filter(|line| !line.trim_start().starts_with("-- "))
                    .collect();
                assert!(!code.contains(placeholder), "{name}: {placeholder} left");
            }
            assert_eq!(script.matches("redis.call('TIME')").count(), 1, "{name}");
        }
        assert!(reserve.contains("local FORMAT = '2'"));
        assert!(source(body("reserve"), off, "tenant").contains("local FORMAT = ''"));
    }

    /// The sources that read or write a record kept as one string.
    fn string_sources() -> [(&'static str, &'static str); 5] {
        [
            ("string_record.lua", STRING_RECORD),
            ("watch.lua", include_str!("lua/watch.lua")),
            ("count_lapsed.lua", include_str!("lua/count_lapsed.lua")),
            (
                "complete_string.lua",
                include_str!("lua/complete_string.lua"),
            ),
            ("convert.lua", include_str!("lua/convert.lua")),
        ]
    }

    /// The string record's layout is defined once (string_record.rs): the
    /// sources reach into a string record only through its placeholders.
    /// A literal offset (`string.sub(raw, 3, 38)`) or a literal format or
    /// state byte (`'3p'`) would escape a change of the layout.
    #[test]
    fn string_records_are_read_through_the_layout_alone() {
        let reaching = [
            "string.sub(raw,",
            "string.find(raw,",
            "string.match(raw,",
            "'SETRANGE',",
        ];
        let mut used = std::collections::BTreeSet::new();
        for (name, source) in string_sources() {
            for line in source.lines() {
                let code = line.split("--").next().unwrap_or_default();
                for call in reaching {
                    for (at, _) in code.match_indices(call) {
                        // The call's arguments, up to its closing bracket.
                        let args = &code[at + call.len()..];
                        let mut depth = 0;
                        let end = args
                            .char_indices()
                            .find(|(_, c)| {
                                match c {
                                    '(' => depth += 1,
                                    ')' if depth == 0 => return true,
                                    ')' => depth -= 1,
                                    _ => {}
                                }
                                false
                            })
                            .map_or(args.len(), |(end, _)| end);
                        for arg in args[..end].split(',') {
                            let arg = arg.trim();
                            assert!(
                                arg.is_empty() || !arg.bytes().all(|b| b.is_ascii_digit()),
                                "{name}: a literal offset {arg} in {line:?}"
                            );
                        }
                    }
                }
                for literal in ["'3'", "'3p'", "'3a'", "'3c'"] {
                    assert!(!code.contains(literal), "{name}: {literal} in {line:?}");
                }
                for (placeholder, _) in string_record::layout() {
                    if code.contains(&format!("@{placeholder}@")) {
                        used.insert(placeholder);
                    }
                }
            }
        }
        // Every placeholder is used, and none is left once assembled.
        for (placeholder, _) in string_record::layout() {
            assert!(used.contains(placeholder), "{placeholder} unused");
        }
        let constants = Constants {
            notify: true,
            format: RecordFormat::V3,
        };
        let get = source(
            &format!("{STRING_RECORD}\n{}", body("get")),
            constants,
            "tenant",
        );
        let assembled = [
            get,
            no_prologue(include_str!("lua/watch.lua")),
            no_prologue(include_str!("lua/count_lapsed.lua")),
            no_prologue(include_str!("lua/complete_string.lua")),
            no_prologue(&format!(
                "{STRING_RECORD}\n{}",
                include_str!("lua/convert.lua")
            )),
        ];
        for script in &assembled {
            assert!(!script.contains("@S_"), "a layout placeholder left");
        }
        // What the layout renders: string_record.rs's ranges, 1-based.
        let [get, watch, _, complete, _] = &assembled;
        for read in [
            "string.sub(raw, 3, 38)",
            "string.sub(raw, 39, 74)",
            "string.sub(raw, 75, 138)",
            "([tb])(%d+):', 139)",
            "local version = string.sub(raw, 1, 1)",
            "if version ~= '3' then",
            "string.sub(raw, 2, 2)",
        ] {
            assert!(get.contains(read), "{read}");
        }
        assert!(watch.contains("redis.call('SETRANGE', KEYS[1], 1, 'a')"));
        assert!(complete.contains("'3c' .. string.sub(raw, 3) .. ARGV[2]"));
    }

    /// The sources name fields only through placeholders (format.rs), and
    /// every placeholder names a field: a field spelled out in a source
    /// would escape a rename.
    #[test]
    fn sources_spell_no_field_and_name_only_known_ones() {
        let sources = [
            HEAD,
            CLOCK,
            COMMON,
            FENCE,
            HOLDER,
            include_str!("lua/watch.lua"),
            include_str!("lua/count_lapsed.lua"),
            include_str!("lua/convert.lua"),
            STRING_RECORD,
            include_str!("lua/complete_string.lua"),
        ]
        .into_iter()
        .chain(BODIES.map(body));
        let constants = ["@NOTIFY@", "@HISTORY@", "@PACKED@", "@FORMAT@", "@NEWEST@"];
        let mut used = std::collections::BTreeSet::new();
        for source in sources {
            for line in source.lines() {
                // Only code: a comment may speak of a field.
                let code = line.split("--").next().unwrap_or_default();
                for (_, field) in format::FIELDS {
                    assert!(
                        !code.contains(&format!("'{field}'")),
                        "{field:?} spelled out in {line:?}"
                    );
                }
                let mut parts = code.split('@');
                parts.next();
                while let (Some(name), Some(_)) = (parts.next(), parts.next()) {
                    if constants.contains(&format!("@{name}@").as_str())
                        || name == "TENANT_FIELD"
                        || string_record::layout()
                            .iter()
                            .any(|(layout, _)| *layout == name)
                    {
                        continue;
                    }
                    assert!(
                        format::FIELDS
                            .iter()
                            .any(|(placeholder, _)| placeholder.to_ascii_lowercase() == name),
                        "unknown placeholder @{name}@ in {line:?}"
                    );
                    used.insert(name.to_owned());
                }
            }
        }
        // Every field but the tenant's two (filled in as TENANT_FIELD, and
        // read by get.lua) appears in the sources.
        for (placeholder, _) in format::FIELDS {
            assert!(
                used.contains(&placeholder.to_ascii_lowercase()),
                "{placeholder} unused"
            );
        }
    }
}
