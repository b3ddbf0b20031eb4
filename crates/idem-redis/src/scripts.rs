//! The Lua scripts, each prefixed with the shared functions.

use redis::Script;

pub(crate) const COMMON: &str = include_str!("lua/common.lua");
/// The lease check of the scripts that end an attempt (complete, release).
const FENCE: &str = include_str!("lua/fence.lua");

/// The scripts, each prefixed with the shared functions.
#[derive(Debug)]
pub(crate) struct Scripts {
    pub(crate) reserve: Script,
    pub(crate) renew: Script,
    pub(crate) complete: Script,
    pub(crate) release: Script,
    pub(crate) cancel: Script,
    pub(crate) get: Script,
    /// Shared with the guards that may run it after their call was given
    /// up (cloning a `Script` copies its source).
    pub(crate) abandon: std::sync::Arc<Script>,
    pub(crate) force_release: Script,
    /// Marks a record as waited on and reads its state (no prologue).
    pub(crate) watch: Script,
}

impl Scripts {
    pub(crate) fn new() -> Self {
        let script = |body: &str| Script::new(&format!("{COMMON}\n{body}"));
        let fenced = |body: &str| Script::new(&format!("{COMMON}\n{FENCE}\n{body}"));
        Self {
            reserve: script(include_str!("lua/reserve.lua")),
            renew: script(include_str!("lua/renew.lua")),
            complete: fenced(include_str!("lua/complete.lua")),
            release: fenced(include_str!("lua/release.lua")),
            cancel: script(include_str!("lua/cancel.lua")),
            get: script(include_str!("lua/get.lua")),
            abandon: std::sync::Arc::new(script(include_str!("lua/abandon.lua"))),
            force_release: script(include_str!("lua/force_release.lua")),
            watch: Script::new(include_str!("lua/watch.lua")),
        }
    }
}
