-- ARGV: attempt id, owner token. Frees a reservation whose caller gave up
-- before its reply came (the call timed out, for example behind a paused
-- server): nobody runs that attempt, so the key must not stay taken for a
-- whole lease. Anything else about the record is left alone.
expand()
local state, expires, cur_id, owner =
  unpack(redis.call('HMGET', record, 'state', 'expires', 'cur_id', 'owner'))
if not live(state, expires) then
  return {'vacant'}
end
if state == 'processing' and cur_id == ARGV[1] and owner == ARGV[2] then
  redis.call('HSET', record, 'state', 'released', 'owner', '', 'cur_end', now,
    'cur_outcome', 'released')
  rare().notify()
  return {'released'}
end
return {'untouched'}
