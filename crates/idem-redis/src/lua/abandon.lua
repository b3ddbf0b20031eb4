-- ARGV: attempt id, owner token. Frees a reservation whose caller gave up
-- before its reply came (the call timed out, for example behind a paused
-- server): nobody runs that attempt, so the key must not stay taken for a
-- whole lease. Anything else about the record is left alone.
expand()
local state, expires, cur_id, owner =
  unpack(redis.call('HMGET', record, @state@, @expires@, @cur_id@, @owner@))
if not live(state, expires) then
  return {'vacant'}
end
if state == 'processing' and cur_id == ARGV[1] and owner == ARGV[2] then
  -- A takeover given up leaves the record as the takeover found it:
  -- processing, its lease lapsed, held by nobody. Released, it would take
  -- any payload, while the attempt it superseded may have acted: a changed
  -- request must still conflict, and the same one takes over.
  if rare().superseded_by(tonumber(redis.call('HGET', record, @gen@))) then
    redis.call('HSET', record, @owner@, '', @lease_until@, ms(now))
    rare().notify()
    return {'released'}
  end
  -- Otherwise as its release would (release.lua).
  rare().release_current(now)
  rare().notify()
  return {'released'}
end
return {'untouched'}
