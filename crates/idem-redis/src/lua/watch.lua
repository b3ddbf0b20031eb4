-- A duplicate about to wait (after it subscribed to the record's channel):
-- marks a processing record as watched, so that the complete and release
-- scripts publish when its attempt ends (they skip the PUBLISH for records
-- nobody waits on), and answers the record's state. Atomic with those
-- scripts: an attempt that ended first is seen in the state, one that
-- ends later sees the mark. A processing record that nobody holds (a
-- release after a takeover empties its owner, see release.lua) is
-- answered 'free': there is nothing to wait for, the same request takes
-- it over at once. Runs without the shared prologue.
local fields = redis.pcall('HMGET', KEYS[1], @state@, @owner@)
if fields.err then
  -- A record kept as one string (format 3, string_record.rs): marked by
  -- its state byte, 'p' becoming 'a' (awaited; complete_string.lua
  -- publishes for it, convert.lua keeps the mark), without rewriting it
  -- as a hash.
  local raw = redis.pcall('GET', KEYS[1])
  if type(raw) ~= 'string' or string.sub(raw, @S_VERSION_AT@, @S_VERSION_AT@) ~= @S_VERSION@ then
    return redis.error_reply(fields.err)
  end
  local kind = string.sub(raw, @S_STATE_AT@, @S_STATE_AT@)
  if kind == @S_COMPLETED@ then
    return 'completed'
  end
  if kind == @S_PROCESSING@ then
    redis.call('SETRANGE', KEYS[1], @S_STATE_OFFSET@, @S_WATCHED@)
  end
  return 'processing'
end
local state, owner = unpack(fields)
if state == 'processing' then
  if owner == '' then
    return 'free'
  end
  redis.call('HSET', KEYS[1], @w@, '1')
end
return state
