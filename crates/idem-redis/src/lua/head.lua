-- The prologue of every idem script. KEYS[1] is the record's hash; all
-- state of a scope lives in that one hash, so every script touches one
-- slot. scripts.rs fills in the store's constants (@NOTIFY@, @HISTORY@)
-- instead of passing them per call: each script argument costs Redis
-- about as much as a field it writes.
--
-- Fields are named once, in format.rs: the sources write @name@ and
-- scripts.rs puts the quoted field in its place.
-- Fields: tenant (or tenant_bin: a tenant that ends in a 64-digit hex hash,
--         with the hash as its 32 bytes) op key fp state gen owner
--         lease_until lease_ms retention_ms expires status stored, the
--         response as headers and body when both fit in 64 bytes, else as
--         split (the length of the headers) with headers..body in the
--         string key KEYS[1]..':r' (same hash tag, same expiry), cur_id
--         cur_start cur_end cur_outcome cur_late (the newest attempt),
--         created (only once a second attempt starts; until then it is
--         cur_start) and hist (older attempts, JSON, touched only when a
--         record gets a second attempt or a fenced write arrives).
--         owner (the lease holder's token) means something only while the
--         state is processing: every check of it checks the state first,
--         so ending an attempt leaves it in place instead of writing it.
-- A store writing record format 2 (the default, format.rs) writes a
-- new key's record packed, in fewer fields: state owner fp cur_id tenant op key
-- and n ('cur_start:lease_ms:retention_ms'); its completion or release
-- adds d ('status:stored:cur_end', status and stored empty for a release)
-- and the response as above. The rest follows: gen is 1, expires and
-- lease_until are cur_start plus retention_ms and lease_ms, cur_outcome
-- is running, completed or released by the state. Only the hot paths (a new
-- key, a replay, a completion, a release) write a packed record as it is:
-- every other path that changes it first expands it into the fields above
-- (expand() in common.lua; get reads it expanded without writing), and
-- every store reads both layouts, whichever it writes.
-- Every value of a typical record fits Redis' compact hash encoding (64
-- bytes), and no field repeats another: the completion time is cur_end,
-- the completed status is status, the last change is the later of
-- cur_start and cur_end. Format 2 records carry v ('2'); a record of a
-- format newer than NEWEST is refused (common.lua, reserve.lua).
-- The hot paths call TIME (only a new key's reservation: a replay needs
-- no clock, and a completion and a release take the attempt's end time
-- from the caller's clock; leases, retention and expiry stay on Redis'
-- clock), one HMGET (two for a
-- reservation of an existing record, the second reading only what its
-- state needs; a store reading a record of the other layout reads once
-- more) and at most one HSET, plus one PEXPIREAT when a new attempt
-- starts (retention counts from there; PEXPIRE by the retention for a
-- packed new key), and one SET or GET of the response key when the
-- response is large.
-- A record is live until its expiry: the key carries it (PEXPIREAT, set
-- with the expires field whenever that changes), so a record Redis hands
-- a script is live by Redis' own clock, and the hot paths (a new key, a
-- replay, a completion, a release) check nothing more; the other paths
-- check the field as well.

local record = KEYS[1]
-- Whether the scripts that end an attempt publish to its waiters
-- (watch.rs): true on a single node.
local NOTIFY = @NOTIFY@
-- How many attempts a record keeps, the newest included.
local HISTORY = @HISTORY@
-- Whether a new key's record is packed (see above); which layout the hot
-- paths look for first.
local PACKED = @PACKED@
-- The format this store writes, as the text of a record's v field ('' for
-- format 1, whose records carry none), and the newest it reads (format.rs).
local FORMAT = '@FORMAT@'
local NEWEST = @NEWEST@
