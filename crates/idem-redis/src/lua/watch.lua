-- A duplicate about to wait (after it subscribed to the record's channel):
-- marks a processing record as watched, so that the complete and release
-- scripts publish when its attempt ends (they skip the PUBLISH for records
-- nobody waits on), and answers the record's state. Atomic with those
-- scripts: an attempt that ended first is seen in the state, one that
-- ends later sees the mark. A processing record that nobody holds (a
-- release after a takeover empties its owner, see release.lua) is
-- answered 'free': there is nothing to wait for, the same request takes
-- it over at once. Runs without the shared prologue.
local state, owner = unpack(redis.call('HMGET', KEYS[1], @state@, @owner@))
if state == 'processing' then
  if owner == '' then
    return 'free'
  end
  redis.call('HSET', KEYS[1], @w@, '1')
end
return state
