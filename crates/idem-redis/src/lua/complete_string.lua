-- A completion's hot path on a record kept as one string (record format 3,
-- see string_record.rs): while the record is this reservation's
-- (processing, the caller's owner token), it becomes the completed record,
-- keeping its expiry (retention counts from the reservation). Reads no
-- clock, and runs without the shared prologue. A record a duplicate waits
-- on (its state byte 'a', awaited, for 'p': marked by watch.lua) publishes
-- on the record's channel, as complete.lua does for a watched hash, where
-- the store notifies (NOTIFY, head.lua).
-- ARGV: owner token, the completion (string_record.rs, write_completion).
-- Answers 1 when it recorded, 0 for anything else (a hash, a record held
-- by another owner, no record): the caller then runs complete.lua, which
-- answers every such case.
local raw = redis.pcall('GET', KEYS[1])
if type(raw) ~= 'string' or string.sub(raw, 3, 38) ~= ARGV[1] then
  return 0
end
local head = string.sub(raw, 1, 2)
if head ~= '3p' and head ~= '3a' then
  return 0
end
redis.call('SET', KEYS[1], '3c' .. string.sub(raw, 3) .. ARGV[2], 'KEEPTTL')
if head == '3a' and @NOTIFY@ then
  redis.call('PUBLISH', KEYS[1] .. ':c', '1')
end
return 1
