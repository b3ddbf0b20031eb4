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
if type(raw) ~= 'string' or string.sub(raw, @S_OWNER_FROM@, @S_OWNER_TO@) ~= ARGV[1] then
  return 0
end
local head = string.sub(raw, @S_VERSION_AT@, @S_STATE_AT@)
if head ~= @S_HEAD_PROCESSING@ and head ~= @S_HEAD_WATCHED@ then
  return 0
end
redis.call('SET', KEYS[1], @S_HEAD_COMPLETED@ .. string.sub(raw, @S_AFTER_HEAD@) .. ARGV[2], 'KEEPTTL')
if head == @S_HEAD_WATCHED@ and @NOTIFY@ then
  redis.call('PUBLISH', KEYS[1] .. ':c', '1')
end
return 1
