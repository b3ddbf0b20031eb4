# Sourced by the Lua benches, from the checkout's root, with $lua set to
# crates/idem-redis/src/lua: `assemble OUT BODY` writes a script as
# idem-redis assembles it.
# shellcheck shell=bash
history=$(sed -n 's/^pub const ATTEMPT_HISTORY: usize = \([0-9]*\);/\1/p' crates/idem-core/src/*.rs)
# A script as idem-redis assembles it (src/scripts.rs): the prologue with
# the store's constants, then the body with the clock at its `--@clock`
# line and the helpers at its `--@common` line (each before the body when
# it has none), and the lease holder's check and the fence at its `--@holder`
# and `--@fence` lines, every `@field@` placeholder quoted (src/format.rs:
# each field is stored under its placeholder's name); a reservation for a
# tenant kept as text, by a store writing record format 2 (format 3, the default, runs them once a string record is converted) or
# the format the third argument names (RedisStoreBuilder::record_format).
assemble() { # out body [format]
  local out=$1 body=$2 format=${3:-2} packed=true written=2
  if [ "$format" = 1 ]; then packed=false written=; fi
  {
    sed -e "s/@NOTIFY@/true/; s/@HISTORY@/$history/; s/@PACKED@/$packed/" \
      -e "s/@FORMAT@/$written/; s/@NEWEST@/2/" "$lua/head.lua"
    printf '\n'
    grep -qx -- '--@clock' "$body" || { cat "$lua/clock.lua"; printf '\n'; }
    grep -qx -- '--@common' "$body" || { cat "$lua/common.lua"; printf '\n'; }
    sed -e "/^--@clock\$/{r $lua/clock.lua" -e 'd}' \
      -e "/^--@common\$/{r $lua/common.lua" -e 'd}' \
      -e "/^--@holder\$/{r $lua/holder.lua" -e 'd}' \
      -e "/^--@fence\$/{r $lua/fence.lua" -e 'd}' "$body"
  } | sed -e "s/@TENANT_FIELD@/'tenant'/" -e "s/@\([a-z_]*\)@/'\1'/g" >"$out"
}
