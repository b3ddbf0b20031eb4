-- A duplicate about to wait (after it subscribed to the record's channel):
-- marks a processing record as watched, so that the complete and release
-- scripts publish when its attempt ends (they skip the PUBLISH for records
-- nobody waits on), and answers the record's state. Atomic with those
-- scripts: an attempt that ended first is seen in the state, one that
-- ends later sees the mark. Runs without the shared prologue.
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'processing' then
  redis.call('HSET', KEYS[1], 'w', '1')
end
return state
